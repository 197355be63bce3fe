// generated from kernels/templates/nvfp4/moe_nvfp4.cu.j2 by build_tools/instances.py; do not edit
// nvfp4 experts: the grouped GEMM over all experts in one launch (routing: atlas_moe_route) for
// prefill; two GEMVs over the (token, slot) pairs for decode (down: k and k + 1 slots).
#include "atlas/moe_quant.cuh"

extern "C" __global__ void __launch_bounds__(atlas::moe::kGemmThreads) atlas_moe_qgemm_nvfp4_gate_up(const MoeQuantGemmParams p) {
  atlas::pdl_enter();
  atlas::quant::moe_quant_gemm<true, atlas::quant::Nvfp4Format>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::moe::kGemmThreads) atlas_moe_qgemm_nvfp4_down(const MoeQuantGemmParams p) {
  atlas::pdl_enter();
  atlas::quant::moe_quant_gemm<false, atlas::quant::Nvfp4Format>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_moe_qgemv_nvfp4_gate_up(const MoeQuantGemvParams p) {
  atlas::pdl_enter();
  atlas::quant::moe_qgemv_gate_up<atlas::quant::Nvfp4Format>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_moe_qgemv_nvfp4_down_k2(const MoeQuantGemvParams p) {
  atlas::pdl_enter();
  atlas::quant::moe_qgemv_down<atlas::quant::Nvfp4Format, 2>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_moe_qgemv_nvfp4_down_k3(const MoeQuantGemvParams p) {
  atlas::pdl_enter();
  atlas::quant::moe_qgemv_down<atlas::quant::Nvfp4Format, 3>(p);
}
