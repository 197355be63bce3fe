// generated from kernels/templates/bf16/linear.cu.j2 by build_tools/instances.py; do not edit
// linear: GEMV for tokens 1..8 (one instance per token count, wide and narrow row shapes),
// mma.sync GEMM above (and on h200 the opt-in wgmma GEMM). A GEMV enters through pdl_enter inside
// gemv(), after its first weight loads (gemv.cuh).
#include "atlas/gemm.cuh"
#include "atlas/gemv.cuh"
extern "C" __global__ void __launch_bounds__(atlas::kGemvThreads) atlas_gemv_t1(const LinearParams p) {
  atlas::gemv_prefetch<atlas::kGemvWideRows>(p);
  atlas::gemv<1, atlas::kGemvWideRows, atlas::kGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kGemvThreads) atlas_gemv_narrow_t1(const LinearParams p) {
  atlas::gemv_prefetch<atlas::kGemvNarrowRows>(p);
  atlas::gemv<1, atlas::kGemvNarrowRows, atlas::gemv_narrow_unroll(1)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::kGemvThreads) atlas_gemv_t2(const LinearParams p) {
  atlas::gemv_prefetch<atlas::kGemvWideRows>(p);
  atlas::gemv<2, atlas::kGemvWideRows, atlas::kGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kGemvThreads) atlas_gemv_narrow_t2(const LinearParams p) {
  atlas::gemv_prefetch<atlas::kGemvNarrowRows>(p);
  atlas::gemv<2, atlas::kGemvNarrowRows, atlas::gemv_narrow_unroll(2)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::kGemvThreads) atlas_gemv_t3(const LinearParams p) {
  atlas::gemv_prefetch<atlas::kGemvWideRows>(p);
  atlas::gemv<3, atlas::kGemvWideRows, atlas::kGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kGemvThreads) atlas_gemv_narrow_t3(const LinearParams p) {
  atlas::gemv_prefetch<atlas::kGemvNarrowRows>(p);
  atlas::gemv<3, atlas::kGemvNarrowRows, atlas::gemv_narrow_unroll(3)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::kGemvThreads) atlas_gemv_t4(const LinearParams p) {
  atlas::gemv_prefetch<atlas::kGemvWideRows>(p);
  atlas::gemv<4, atlas::kGemvWideRows, atlas::kGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kGemvThreads) atlas_gemv_narrow_t4(const LinearParams p) {
  atlas::gemv_prefetch<atlas::kGemvNarrowRows>(p);
  atlas::gemv<4, atlas::kGemvNarrowRows, atlas::gemv_narrow_unroll(4)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::kGemvThreads) atlas_gemv_t5(const LinearParams p) {
  atlas::gemv_prefetch<atlas::kGemvWideRows>(p);
  atlas::gemv<5, atlas::kGemvWideRows, atlas::kGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kGemvThreads) atlas_gemv_narrow_t5(const LinearParams p) {
  atlas::gemv_prefetch<atlas::kGemvNarrowRows>(p);
  atlas::gemv<5, atlas::kGemvNarrowRows, atlas::gemv_narrow_unroll(5)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::kGemvThreads) atlas_gemv_t6(const LinearParams p) {
  atlas::gemv_prefetch<atlas::kGemvWideRows>(p);
  atlas::gemv<6, atlas::kGemvWideRows, atlas::kGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kGemvThreads) atlas_gemv_narrow_t6(const LinearParams p) {
  atlas::gemv_prefetch<atlas::kGemvNarrowRows>(p);
  atlas::gemv<6, atlas::kGemvNarrowRows, atlas::gemv_narrow_unroll(6)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::kGemvThreads) atlas_gemv_t7(const LinearParams p) {
  atlas::gemv_prefetch<atlas::kGemvWideRows>(p);
  atlas::gemv<7, atlas::kGemvWideRows, atlas::kGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kGemvThreads) atlas_gemv_narrow_t7(const LinearParams p) {
  atlas::gemv_prefetch<atlas::kGemvNarrowRows>(p);
  atlas::gemv<7, atlas::kGemvNarrowRows, atlas::gemv_narrow_unroll(7)>(p);
}
extern "C" __global__ void __launch_bounds__(atlas::kGemvThreads) atlas_gemv_t8(const LinearParams p) {
  atlas::gemv_prefetch<atlas::kGemvWideRows>(p);
  atlas::gemv<8, atlas::kGemvWideRows, atlas::kGemvWideUnroll>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kGemvThreads) atlas_gemv_narrow_t8(const LinearParams p) {
  atlas::gemv_prefetch<atlas::kGemvNarrowRows>(p);
  atlas::gemv<8, atlas::kGemvNarrowRows, atlas::gemv_narrow_unroll(8)>(p);
}
// One token of add_rms_norm's output, the norm taken in (ATLAS_NORM=fused; gemv.cuh's gemv_norm): the
// wide shape only (the narrow one's 4x blocks would each stage the three rows, norm_fusion.py).
extern "C" __global__ void __launch_bounds__(atlas::kGemvThreads) atlas_gemv_norm_t1(const LinearNormParams p) {
  atlas::gemv_prefetch<atlas::kGemvWideRows>(p.linear);
  atlas::gemv_norm<atlas::kGemvWideRows, atlas::kGemvWideUnroll, atlas::model::hidden_size>(p);
}

extern "C" __global__ void __launch_bounds__(atlas::kGemmThreads) atlas_gemm_bf16(const LinearParams p) {
  atlas::pdl_enter();
  atlas::gemm_bf16(p);
}
// Hopper only (sm_90a): the wgmma GEMM, opt-in through ATLAS_GEMM=wgmma.
#include "atlas/gemm_wgmma.cuh"

extern "C" __global__ void __launch_bounds__(atlas::kWgmmaThreads, 1) atlas_gemm_wgmma(const LinearParams p) {
  atlas::pdl_enter();
  atlas::gemm_wgmma(p);
}
