// GEMV building block of the router and the decode MoE kernels: a warp's bf16 weight row of
// compile-time length N, loaded as raw 16-byte chunks (lanes strided by 8 elements, so a warp
// reads 512 contiguous bytes per step) before any arithmetic, so every load of the row is in
// flight at once; then the per-lane partial dot with an f32 vector in shared memory. Callers
// finish with warp_sum.
#pragma once

#include "atlas/common.cuh"

namespace atlas::gemv_row {

template <int N>
struct RowChunks {
  static_assert(N % 8 == 0, "RowChunks: N must be a multiple of 8");
  static constexpr int kSteps = (N + kWarpSize * 8 - 1) / (kWarpSize * 8);
  uint4 raw[kSteps];
};

// row 16-byte aligned; lanes past the row's end hold zeros.
template <int N>
__device__ __forceinline__ void load_row(const uint16_t* row, int lane, RowChunks<N>& chunks) {
#pragma unroll
  for (int i = 0; i < RowChunks<N>::kSteps; ++i) {
    const int c = lane * 8 + i * kWarpSize * 8;
    chunks.raw[i] = c < N ? __ldg(reinterpret_cast<const uint4*>(row + c)) : make_uint4(0u, 0u, 0u, 0u);
  }
}

template <int N>
__device__ __forceinline__ void zero_row(RowChunks<N>& chunks) {
#pragma unroll
  for (int i = 0; i < RowChunks<N>::kSteps; ++i) chunks.raw[i] = make_uint4(0u, 0u, 0u, 0u);
}

// vec_s: N floats in shared memory, 32-byte aligned.
template <int N>
__device__ __forceinline__ float dot_row(const RowChunks<N>& chunks, const float* vec_s, int lane) {
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < RowChunks<N>::kSteps; ++i) {
    const int c = lane * 8 + i * kWarpSize * 8;
    if (c >= N) continue;
    const uint32_t words[4] = {chunks.raw[i].x, chunks.raw[i].y, chunks.raw[i].z, chunks.raw[i].w};
    float v[8];
    load_f32<8>(vec_s + c, v);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float lo;
      float hi;
      unpack_bf16x2(words[j], lo, hi);
      acc = fmaf(lo, v[2 * j], acc);
      acc = fmaf(hi, v[2 * j + 1], acc);
    }
  }
  return acc;
}

}  // namespace atlas::gemv_row
