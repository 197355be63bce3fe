// generated from kernels/templates/nvfp4/linear_nvfp4.cu.j2 by build_tools/instances.py; do not edit
// nvfp4 linear: dequantizing GEMV for tokens 1..8 (wide and narrow row shapes), mma.sync GEMM above.
// Narrow: 2 blocks per SM asked for, which stops sm_121a ptxas capping registers into spills.
// The GEMVs enter through pdl_enter inside gemv_quant, after their first weight loads.
#include "atlas/gemm_quant.cuh"
#include "atlas/gemv_quant.cuh"
extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_qgemv_nvfp4_t1(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Nvfp4Format, 1, atlas::quant::kQGemvWideRows, atlas::quant::kQGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads, 2) atlas_qgemv_nvfp4_narrow_t1(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Nvfp4Format, 1, atlas::quant::kQGemvNarrowRows, atlas::quant::qgemv_narrow_unroll(1)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_qgemv_nvfp4_t2(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Nvfp4Format, 2, atlas::quant::kQGemvWideRows, atlas::quant::kQGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads, 2) atlas_qgemv_nvfp4_narrow_t2(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Nvfp4Format, 2, atlas::quant::kQGemvNarrowRows, atlas::quant::qgemv_narrow_unroll(2)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_qgemv_nvfp4_t3(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Nvfp4Format, 3, atlas::quant::kQGemvWideRows, atlas::quant::kQGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads, 2) atlas_qgemv_nvfp4_narrow_t3(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Nvfp4Format, 3, atlas::quant::kQGemvNarrowRows, atlas::quant::qgemv_narrow_unroll(3)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_qgemv_nvfp4_t4(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Nvfp4Format, 4, atlas::quant::kQGemvWideRows, atlas::quant::kQGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads, 2) atlas_qgemv_nvfp4_narrow_t4(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Nvfp4Format, 4, atlas::quant::kQGemvNarrowRows, atlas::quant::qgemv_narrow_unroll(4)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_qgemv_nvfp4_t5(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Nvfp4Format, 5, atlas::quant::kQGemvWideRows, atlas::quant::kQGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads, 2) atlas_qgemv_nvfp4_narrow_t5(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Nvfp4Format, 5, atlas::quant::kQGemvNarrowRows, atlas::quant::qgemv_narrow_unroll(5)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_qgemv_nvfp4_t6(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Nvfp4Format, 6, atlas::quant::kQGemvWideRows, atlas::quant::kQGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads, 2) atlas_qgemv_nvfp4_narrow_t6(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Nvfp4Format, 6, atlas::quant::kQGemvNarrowRows, atlas::quant::qgemv_narrow_unroll(6)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_qgemv_nvfp4_t7(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Nvfp4Format, 7, atlas::quant::kQGemvWideRows, atlas::quant::kQGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads, 2) atlas_qgemv_nvfp4_narrow_t7(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Nvfp4Format, 7, atlas::quant::kQGemvNarrowRows, atlas::quant::qgemv_narrow_unroll(7)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_qgemv_nvfp4_t8(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Nvfp4Format, 8, atlas::quant::kQGemvWideRows, atlas::quant::kQGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads, 2) atlas_qgemv_nvfp4_narrow_t8(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Nvfp4Format, 8, atlas::quant::kQGemvNarrowRows, atlas::quant::qgemv_narrow_unroll(8)>(p);
}
// One token of add_rms_norm's output, the norm taken in (ATLAS_NORM=fused; gemv_quant.cuh's
// gemv_quant_norm): the wide shape only, as for bf16. 3 blocks per SM asked for: without, sm_90a's
// ptxas took 99 registers (2 blocks per SM) where the plain t1 takes 73.
extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads, 3) atlas_qgemv_nvfp4_norm_t1(const QuantLinearNormParams p) {
  atlas::quant::gemv_quant_norm<atlas::quant::Nvfp4Format, atlas::quant::kQGemvWideRows, atlas::quant::kQGemvWideUnroll, atlas::model::hidden_size>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kGemmThreads) atlas_qgemm_nvfp4(const QuantLinearParams p) {
  atlas::pdl_enter();
  atlas::quant::gemm_quant<atlas::quant::Nvfp4Format>(p);
}
