// generated from kernels/templates/bf16/sampling.cu.j2 by build_tools/instances.py; do not edit
#include "atlas/sampling.cuh"

extern "C" __global__ void __launch_bounds__(atlas::kArgmaxThreads) atlas_argmax_partial(const ArgmaxParams p) {
  atlas::argmax_partial(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kArgmaxThreads) atlas_argmax_final(const ArgmaxParams p) {
  atlas::argmax_final(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kSampleThreads) atlas_sample(const SampleParams p) {
  atlas::sample(p);
}
