// generated from kernels/templates/fp8/moe_fp8.cu.j2 by build_tools/instances.py; do not edit
// fp8 experts: the grouped GEMM over all experts in one launch (routing: atlas_moe_route) for
// prefill; two GEMVs over the (token, slot) pairs for decode (down: k and k + 1 slots).
#include "atlas/moe_quant.cuh"

extern "C" __global__ void __launch_bounds__(atlas::moe::kGemmThreads) atlas_moe_qgemm_fp8_gate_up(const MoeQuantGemmParams p) {
  atlas::pdl_enter();
  atlas::quant::moe_quant_gemm<true, atlas::quant::Fp8Format>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::moe::kGemmThreads) atlas_moe_qgemm_fp8_down(const MoeQuantGemmParams p) {
  atlas::pdl_enter();
  atlas::quant::moe_quant_gemm<false, atlas::quant::Fp8Format>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_moe_qgemv_fp8_gate_up(const MoeQuantGemvParams p) {
  atlas::pdl_enter();
  atlas::quant::moe_qgemv_gate_up<atlas::quant::Fp8Format>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_moe_qgemv_fp8_down_k8(const MoeQuantGemvParams p) {
  atlas::pdl_enter();
  atlas::quant::moe_qgemv_down<atlas::quant::Fp8Format, 8>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_moe_qgemv_fp8_down_k9(const MoeQuantGemvParams p) {
  atlas::pdl_enter();
  atlas::quant::moe_qgemv_down<atlas::quant::Fp8Format, 9>(p);
}
