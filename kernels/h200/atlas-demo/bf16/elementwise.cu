// generated from kernels/templates/bf16/elementwise.cu.j2 by build_tools/instances.py; do not edit
#include "atlas/elementwise.cuh"

extern "C" __global__ void __launch_bounds__(256) atlas_add(const AddParams p) {
  atlas::pdl_enter();
  atlas::add(p);
}

extern "C" __global__ void __launch_bounds__(256) atlas_silu_mul(const SiluMulParams p) {
  atlas::pdl_enter();
  atlas::silu_mul(p);
}

extern "C" __global__ void __launch_bounds__(256) atlas_sigmoid_mul(const SigmoidMulParams p) {
  atlas::pdl_enter();
  atlas::sigmoid_mul(p);
}

extern "C" __global__ void __launch_bounds__(256) atlas_nonfinite_count(const NonfiniteCountParams p) {
  atlas::pdl_enter();
  atlas::nonfinite_count(p);
}
