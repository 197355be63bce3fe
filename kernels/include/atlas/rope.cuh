// q/k head RMSNorm + partial rotary embedding (rotate-half / NeoX layout). One warp per
// (token, head); the normalised head goes through a per-warp shared-memory row because the
// rotation pairs element j with j +- rotary_dim/2, which another lane holds.
// Angles are computed in double (pos * theta^(-2i/rotary_dim)) like the numpy reference, so long
// positions do not lose phase to f32 rounding. Dynamic smem: warps_per_block * head_dim * 4 bytes.
#pragma once

#include "atlas/common.cuh"

namespace atlas {

constexpr int kRopeThreads = 128;

__device__ void head_norm_rope(const HeadNormRopeParams& p) {
  extern __shared__ __align__(16) float rope_rows[];  // [warps, head_dim]
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int row = blockIdx.x * (blockDim.x / kWarpSize) + warp;  // token * heads + head
  if (row >= p.tokens * p.heads) return;  // whole warp leaves; only __syncwarp below
  const int token = row / p.heads;
  const int dim = p.head_dim;
  const float* x = static_cast<const float*>(p.x) + static_cast<int64_t>(row) * dim;
  const float* weight = static_cast<const float*>(p.weight);
  float* out = static_cast<float*>(p.out) + static_cast<int64_t>(row) * dim;
  float* normed = rope_rows + warp * dim;

  float squares = 0.0f;
  for (int j = lane; j < dim; j += kWarpSize) squares += x[j] * x[j];
  const float inv_rms = rsqrtf(warp_sum(squares) / static_cast<float>(dim) + p.eps);
  for (int j = lane; j < dim; j += kWarpSize) normed[j] = x[j] * inv_rms * weight[j];
  __syncwarp();

  const int half = p.rotary_dim / 2;
  const double position = static_cast<double>(static_cast<const int32_t*>(p.positions)[token]);
  for (int j = lane; j < dim; j += kWarpSize) {
    if (j >= 2 * half) {
      out[j] = normed[j];
      continue;
    }
    const int i = j < half ? j : j - half;
    const double inv_freq = 1.0 / pow(static_cast<double>(p.rope_theta), 2.0 * i / p.rotary_dim);
    double s, c;
    sincos(position * inv_freq, &s, &c);
    const float cos_f = static_cast<float>(c);
    const float sin_f = static_cast<float>(s);
    out[j] = j < half ? normed[j] * cos_f - normed[j + half] * sin_f : normed[j] * cos_f + normed[j - half] * sin_f;
  }
}

}  // namespace atlas
