// generated from kernels/templates/fp8/linear_fp8.cu.j2 by build_tools/instances.py; do not edit
// fp8 linear: dequantizing GEMV for tokens 1..8 (wide and narrow row shapes), mma.sync GEMM above.
// Narrow: 2 blocks per SM asked for, which stops sm_121a ptxas capping registers into spills.
// The GEMVs enter through pdl_enter inside gemv_quant, after their first weight loads.
#include "atlas/gemm_quant.cuh"
#include "atlas/gemv_quant.cuh"
extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_qgemv_fp8_t1(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Fp8Format, 1, atlas::quant::kQGemvWideRows, atlas::quant::kQGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads, 2) atlas_qgemv_fp8_narrow_t1(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Fp8Format, 1, atlas::quant::kQGemvNarrowRows, atlas::quant::qgemv_narrow_unroll(1)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_qgemv_fp8_t2(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Fp8Format, 2, atlas::quant::kQGemvWideRows, atlas::quant::kQGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads, 2) atlas_qgemv_fp8_narrow_t2(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Fp8Format, 2, atlas::quant::kQGemvNarrowRows, atlas::quant::qgemv_narrow_unroll(2)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_qgemv_fp8_t3(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Fp8Format, 3, atlas::quant::kQGemvWideRows, atlas::quant::kQGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads, 2) atlas_qgemv_fp8_narrow_t3(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Fp8Format, 3, atlas::quant::kQGemvNarrowRows, atlas::quant::qgemv_narrow_unroll(3)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_qgemv_fp8_t4(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Fp8Format, 4, atlas::quant::kQGemvWideRows, atlas::quant::kQGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads, 2) atlas_qgemv_fp8_narrow_t4(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Fp8Format, 4, atlas::quant::kQGemvNarrowRows, atlas::quant::qgemv_narrow_unroll(4)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_qgemv_fp8_t5(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Fp8Format, 5, atlas::quant::kQGemvWideRows, atlas::quant::kQGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads, 2) atlas_qgemv_fp8_narrow_t5(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Fp8Format, 5, atlas::quant::kQGemvNarrowRows, atlas::quant::qgemv_narrow_unroll(5)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_qgemv_fp8_t6(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Fp8Format, 6, atlas::quant::kQGemvWideRows, atlas::quant::kQGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads, 2) atlas_qgemv_fp8_narrow_t6(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Fp8Format, 6, atlas::quant::kQGemvNarrowRows, atlas::quant::qgemv_narrow_unroll(6)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_qgemv_fp8_t7(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Fp8Format, 7, atlas::quant::kQGemvWideRows, atlas::quant::kQGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads, 2) atlas_qgemv_fp8_narrow_t7(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Fp8Format, 7, atlas::quant::kQGemvNarrowRows, atlas::quant::qgemv_narrow_unroll(7)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_qgemv_fp8_t8(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Fp8Format, 8, atlas::quant::kQGemvWideRows, atlas::quant::kQGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads, 2) atlas_qgemv_fp8_narrow_t8(const QuantLinearParams p) {
  atlas::quant::gemv_quant<atlas::quant::Fp8Format, 8, atlas::quant::kQGemvNarrowRows, atlas::quant::qgemv_narrow_unroll(8)>(p);
}
// One token of add_rms_norm's output, the norm taken in (ATLAS_NORM=fused; gemv_quant.cuh's
// gemv_quant_norm): the wide shape only, as for bf16.
extern "C" __global__ void __launch_bounds__(atlas::quant::kQGemvThreads) atlas_qgemv_fp8_norm_t1(const QuantLinearNormParams p) {
  atlas::quant::gemv_quant_norm<atlas::quant::Fp8Format, atlas::quant::kQGemvWideRows, atlas::quant::kQGemvWideUnroll, atlas::model::hidden_size>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kGemmThreads) atlas_qgemm_fp8(const QuantLinearParams p) {
  atlas::pdl_enter();
  atlas::quant::gemm_quant<atlas::quant::Fp8Format>(p);
}
