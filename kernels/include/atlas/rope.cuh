// q/k head RMSNorm + partial rotary embedding (rotate-half / NeoX layout). One warp per
// (token, head); the normalised head goes through a per-warp shared-memory row because the
// rotation pairs element j with j +- rotary_dim/2, which another lane holds.
// The angle is the float32 product pos * inv_freq[i], the table made on the host as transformers
// makes it (plain RoPE or YaRN): at long positions the rounding of that product moves the phase by
// more than any cos/sin error, so a more exact angle would disagree with the model as trained.
// cos/sin of that f32 angle are evaluated in double, then multiplied by p.scaling in float32.
// Dynamic smem: warps_per_block * head_dim * 4 bytes.
#pragma once

#include "atlas/common.cuh"

namespace atlas {

constexpr int kRopeThreads = 128;

__device__ void head_norm_rope(const HeadNormRopeParams& p) {
  ATLAS_DYNAMIC_SMEM(float, rope_rows);  // [warps, head_dim]
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int row = blockIdx.x * (blockDim.x / kWarpSize) + warp;  // token * heads + head
  if (row >= p.tokens * p.heads) return;  // whole warp leaves; only __syncwarp below
  const int token = row / p.heads;
  const int dim = p.head_dim;
  const float* x = static_cast<const float*>(p.x) + static_cast<int64_t>(row) * dim;
  const float* weight = static_cast<const float*>(p.weight);
  const float* inv_freq = static_cast<const float*>(p.inv_freq);
  float* out = static_cast<float*>(p.out) + static_cast<int64_t>(row) * dim;
  float* normed = rope_rows + warp * dim;

  float squares = 0.0f;
  for (int j = lane; j < dim; j += kWarpSize) squares += x[j] * x[j];
  const float inv_rms = rsqrtf(warp_sum(squares) / static_cast<float>(dim) + p.eps);
  for (int j = lane; j < dim; j += kWarpSize) normed[j] = x[j] * inv_rms * weight[j];
  __syncwarp();

  const int half = p.rotary_dim / 2;
  const float position = static_cast<float>(static_cast<const int32_t*>(p.positions)[token]);
  for (int j = lane; j < dim; j += kWarpSize) {
    if (j >= 2 * half) {
      out[j] = normed[j];
      continue;
    }
    const int i = j < half ? j : j - half;
    const float angle = __fmul_rn(position, inv_freq[i]);
    double s, c;
    sincos(static_cast<double>(angle), &s, &c);
    const float cos_f = __fmul_rn(static_cast<float>(c), p.scaling);
    const float sin_f = __fmul_rn(static_cast<float>(s), p.scaling);
    out[j] = j < half ? normed[j] * cos_f - normed[j + half] * sin_f : normed[j] * cos_f + normed[j - half] * sin_f;
  }
}

}  // namespace atlas
