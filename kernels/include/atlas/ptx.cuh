// The inline-PTX wrappers of the tensor-core paths: cp.async, ldmatrix and mma.sync m16n8k16 bf16
// (sm_80+: gemm, attention_mma, moe, gemm_quant), and wgmma m64n128k16 with its fences (sm_90a:
// gemm_wgmma). The host emulator of tests/simt builds the same
// kernels with ATLAS_SIMT_HOST defined and supplies its own versions of exactly these calls.
#pragma once

#include <cstdint>

namespace atlas {
constexpr int kWgmmaN128Accum = 64;  // f32 accumulators per thread of wgmma m64n128k16
}  // namespace atlas

#if defined(ATLAS_SIMT_HOST)
#include "simt_ptx.h"
#else

namespace atlas {

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;  // 0 source bytes: the 16 destination bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int Pending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(ptr)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(ptr)));
}

// d += a (16x16, row) * b (16x8, col): bf16 in, f32 accumulate.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- sm_90a warpgroup MMA (gemm_wgmma.cuh) ----

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Pins the accumulators at this point of the program so the compiler cannot move their uses
// across the asynchronous wgmma that writes them.
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[kWgmmaN128Accum]) {
#pragma unroll
  for (int i = 0; i < kWgmmaN128Accum; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define ATLAS_WG_F8(b)                                                                              \
  "+f"(d[b + 0]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]), \
      "+f"(d[b + 6]), "+f"(d[b + 7])

// d += A[64 x 16] @ B[128 x 16]^T, both K-major in shared memory (no transpose, scales +1).
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[kWgmmaN128Accum], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, accumulate, 1, 1, 0, 0;\n}\n"
      : ATLAS_WG_F8(0), ATLAS_WG_F8(8), ATLAS_WG_F8(16), ATLAS_WG_F8(24), ATLAS_WG_F8(32), ATLAS_WG_F8(40),
        ATLAS_WG_F8(48), ATLAS_WG_F8(56)
      : "l"(desc_a), "l"(desc_b), "r"(1));
}
#undef ATLAS_WG_F8

}  // namespace atlas

#endif
