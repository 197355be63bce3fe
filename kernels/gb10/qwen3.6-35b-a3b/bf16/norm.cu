// generated from kernels/templates/bf16/norm.cu.j2 by build_tools/instances.py; do not edit
#include "atlas/norm.cuh"

extern "C" __global__ void __launch_bounds__(atlas::kNormMaxThreads) atlas_rms_norm(const RmsNormParams p) {
  atlas::pdl_enter();
  atlas::rms_norm_rows<false>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kNormMaxThreads) atlas_add_rms_norm(const RmsNormParams p) {
  atlas::pdl_enter();
  atlas::rms_norm_rows<true>(p);
}
