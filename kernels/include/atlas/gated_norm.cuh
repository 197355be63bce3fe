// Gated RMSNorm of the DeltaNet output: rms_norm(x) * weight * silu(z) per (token, head) row of D.
// One warp per row, the row held in registers (D / 32 values per lane).
#pragma once

#include "atlas/common.cuh"

namespace atlas::gated_norm {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;

template <int D>
__device__ void gated_rms_norm(const GatedRmsNormParams& p) {
  static_assert(D % kWarpSize == 0, "gated_rms_norm: D must be a multiple of 32");
  constexpr int kPerLane = D / kWarpSize;
  if (p.dim != D || blockDim.x != kThreads) return;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  if (row >= p.rows) return;

  const float* x = static_cast<const float*>(p.x) + row * D;
  const float* z = static_cast<const float*>(p.z) + row * D;
  const float* weight = static_cast<const float*>(p.weight);
  float* out = static_cast<float*>(p.out) + row * D;
  float values[kPerLane];
  float squares = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    values[i] = x[lane + kWarpSize * i];
    squares = fmaf(values[i], values[i], squares);
  }
  const float inv_rms = rsqrtf(warp_sum(squares) / static_cast<float>(D) + p.eps);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + kWarpSize * i;
    out[d] = values[i] * inv_rms * weight[d] * silu(z[d]);
  }
}

}  // namespace atlas::gated_norm
