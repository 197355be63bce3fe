// Per-lane partial dot product of a bf16 weight row with an f32 vector in shared memory: the GEMV
// building block of the router and the decode MoE kernels (16-byte weight loads, lanes strided by
// 8 elements so a warp reads 512 contiguous bytes per step). Callers finish with warp_sum.
#pragma once

#include "atlas/common.cuh"

namespace atlas {

// n % 8 == 0; row 16-byte aligned; vec_s 32-byte aligned.
__device__ __forceinline__ float row_dot_partial(const uint16_t* row, const float* vec_s, int n, int lane) {
  float acc = 0.0f;
#pragma unroll 4
  for (int c = lane * 8; c < n; c += kWarpSize * 8) {
    float w[8];
    float v[8];
    load_bf16<8>(row + c, w);
    load_f32<8>(vec_s + c, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc = fmaf(w[j], v[j], acc);
  }
  return acc;
}

}  // namespace atlas
