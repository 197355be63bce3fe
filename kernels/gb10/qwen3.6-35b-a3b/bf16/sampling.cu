// generated from kernels/templates/bf16/sampling.cu.j2 by build_tools/instances.py; do not edit
#include "atlas/sampling_split.cuh"

extern "C" __global__ void __launch_bounds__(atlas::kArgmaxThreads) atlas_argmax_partial(const ArgmaxParams p) {
  atlas::pdl_enter();
  atlas::argmax_partial(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kArgmaxThreads) atlas_argmax_final(const ArgmaxParams p) {
  atlas::pdl_enter();
  atlas::argmax_final(p);
}

// One block per draw: minBlocks 1 lets ptxas use the 64 registers a 1024-thread block may have
// (for sm_90a it otherwise plans two resident blocks, 32 registers, and spills the fast path).
extern "C" __global__ void __launch_bounds__(atlas::kSampleThreads, 1) atlas_sample(const SampleParams p) {
  atlas::pdl_enter();
  atlas::sample(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kPenalizeThreads) atlas_penalize(const PenalizeParams p) {
  atlas::pdl_enter();
  atlas::penalize(p);
}

extern "C" __global__ void __launch_bounds__(32) atlas_count_token(const CountTokenParams p) {
  atlas::pdl_enter();
  atlas::count_token(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kSampleThreads, 1) atlas_top_ids(const TopIdsParams p) {
  atlas::pdl_enter();
  atlas::top_ids(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kSampleThreads, 1) atlas_logprob_rows(const LogprobParams p) {
  atlas::pdl_enter();
  atlas::logprob_rows(p);
}

// ATLAS_SAMPLE=split: `sample` in five launches, its whole-row passes over the GPU (sampling_split.cuh).
extern "C" __global__ void __launch_bounds__(atlas::kSampleUnitThreads) atlas_sample_units(const SampleParams p) {
  atlas::pdl_enter();
  atlas::sample_split_units(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kSampleThreads, 1) atlas_sample_row(const SampleParams p) {
  atlas::pdl_enter();
  atlas::sample_split_row(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kSampleUnitThreads) atlas_sample_count(const SampleParams p) {
  atlas::pdl_enter();
  atlas::sample_split_count(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kSampleUnitThreads) atlas_sample_gather(const SampleParams p) {
  atlas::pdl_enter();
  atlas::sample_split_gather(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kSampleThreads, 1) atlas_sample_pick(const SampleParams p) {
  atlas::pdl_enter();
  atlas::sample_split_pick(p);
}
