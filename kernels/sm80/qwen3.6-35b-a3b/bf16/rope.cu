// generated from kernels/templates/bf16/rope.cu.j2 by build_tools/instances.py; do not edit
#include "atlas/rope.cuh"

extern "C" __global__ void __launch_bounds__(atlas::kRopeThreads) atlas_head_norm_rope(const HeadNormRopeParams p) {
  atlas::pdl_enter();
  atlas::head_norm_rope(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kRopeThreads) atlas_attention_prep(const AttentionPrepParams p) {
  atlas::pdl_enter();
  atlas::attention_prep(p);
}
