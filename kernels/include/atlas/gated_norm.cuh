// Gated RMSNorm of the DeltaNet output: rms_norm(x) * weight * silu(z) per (token, head) row of D.
// One warp per row, the row held in registers (D / 32 values per lane).
#pragma once

#include "atlas/common.cuh"

namespace atlas::gated_norm {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;

// One row of D by one warp: out = x * rsqrt(mean(x^2) + eps) * weight * silu(z). x is read
// through L2 (__ldcg): the fused DeltaNet decode kernel normalises rows other blocks wrote in the
// same launch (delta_decode.cuh), with this code, so both kernels compute the same bits.
template <int D>
__device__ __forceinline__ void norm_row(const float* x, const float* z, const float* weight, float* out, float eps,
                                         int lane) {
  static_assert(D % kWarpSize == 0, "gated_rms_norm: D must be a multiple of 32");
  constexpr int kPerLane = D / kWarpSize;
  float values[kPerLane];
  float weights[kPerLane];
  float gates[kPerLane];  // silu(z)
  float squares = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {  // every load before the first store, which might alias them
    const int d = lane + kWarpSize * i;
    values[i] = __ldcg(x + d);
    weights[i] = weight[d];
    gates[i] = silu(z[d]);
    squares = fmaf(values[i], values[i], squares);
  }
  const float inv_rms = rsqrtf(warp_sum(squares) / static_cast<float>(D) + eps);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) out[lane + kWarpSize * i] = values[i] * inv_rms * weights[i] * gates[i];
}

template <int D>
__device__ void gated_rms_norm(const GatedRmsNormParams& p) {
  if (p.dim != D || blockDim.x != kThreads) return;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  if (row >= p.rows) return;
  norm_row<D>(static_cast<const float*>(p.x) + row * D, static_cast<const float*>(p.z) + row * D,
              static_cast<const float*>(p.weight), static_cast<float*>(p.out) + row * D, p.eps, lane);
}

}  // namespace atlas::gated_norm
