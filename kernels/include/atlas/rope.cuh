// q/k head RMSNorm + partial rotary embedding (rotate-half / NeoX layout). One warp per
// (token, head); the normalised head goes through a per-warp shared-memory row because the
// rotation pairs element j with j +- rotary_dim/2, which another lane holds.
// The angle is the float32 product pos * inv_freq[i], the table made on the host as transformers
// makes it (plain RoPE or YaRN): at long positions the rounding of that product moves the phase by
// more than any cos/sin error, so a more exact angle would disagree with the model as trained.
// cos/sin of that f32 angle are evaluated in double, then multiplied by p.scaling in float32.
// attention_prep also writes k and v into the bf16 KV cache (one launch instead of three).
// Dynamic smem: warps_per_block * head_dim * 4 bytes.
#pragma once

#include "atlas/common.cuh"

namespace atlas {

constexpr int kRopeThreads = 128;

// What every head row of one launch shares.
struct RopeSettings {
  const float* inv_freq;  // [rotary_dim / 2]
  int head_dim;
  int rotary_dim;
  float scaling;
};

// Elements a lane handles per pass of norm_rope_row: its loads of one pass are issued together.
// A loop over the row with a runtime trip count is not unrolled, and each iteration's use of its
// load then stalls the warp before the next load: one memory round trip per 32 elements.
constexpr int kRopePerLane = 8;  // a head row of up to 256 in one pass
constexpr int kRopeSpan = kRopePerLane * kWarpSize;

// One warp: RMSNorm of the head row x (weight, eps) into `normed` (the warp's shared row), then
// store(j, value) of each output element, rotated or passed through. Every lane of the warp calls it.
template <typename Store>
__device__ __forceinline__ void norm_rope_row(const RopeSettings& s, const float* x, const float* weight, float eps,
                                              int32_t position, float* normed, Store store) {
  const int lane = threadIdx.x % kWarpSize;
  const int dim = s.head_dim;
  float squares = 0.0f;
  for (int base = 0; base < dim; base += kRopeSpan) {
    float values[kRopePerLane];
#pragma unroll
    for (int m = 0; m < kRopePerLane; ++m) {
      const int j = base + lane + kWarpSize * m;
      values[m] = j < dim ? x[j] : 0.0f;
    }
#pragma unroll
    for (int m = 0; m < kRopePerLane; ++m) squares += values[m] * values[m];
  }
  const float inv_rms = rsqrtf(warp_sum(squares) / static_cast<float>(dim) + eps);
  for (int base = 0; base < dim; base += kRopeSpan) {
    float values[kRopePerLane];
    float weights[kRopePerLane];
#pragma unroll
    for (int m = 0; m < kRopePerLane; ++m) {
      const int j = base + lane + kWarpSize * m;
      values[m] = j < dim ? x[j] : 0.0f;
      weights[m] = j < dim ? weight[j] : 0.0f;
    }
#pragma unroll
    for (int m = 0; m < kRopePerLane; ++m) {
      const int j = base + lane + kWarpSize * m;
      if (j < dim) normed[j] = values[m] * inv_rms * weights[m];
    }
  }
  __syncwarp();

  const int half = s.rotary_dim / 2;
  const float pos = static_cast<float>(position);
  for (int j = lane; j < dim; j += kWarpSize) {  // kept rolled: values held across the sincos slow path (a call) spill
    if (j >= 2 * half) {
      store(j, normed[j]);
      continue;
    }
    const int i = j < half ? j : j - half;
    const float angle = __fmul_rn(pos, s.inv_freq[i]);
    double sin_d, cos_d;
    sincos(static_cast<double>(angle), &sin_d, &cos_d);
    const float cos_f = __fmul_rn(static_cast<float>(cos_d), s.scaling);
    const float sin_f = __fmul_rn(static_cast<float>(sin_d), s.scaling);
    store(j, j < half ? normed[j] * cos_f - normed[j + half] * sin_f : normed[j] * cos_f + normed[j - half] * sin_f);
  }
}

__device__ void head_norm_rope(const HeadNormRopeParams& p) {
  ATLAS_DYNAMIC_SMEM(float, rope_rows);  // [warps, head_dim]
  const int warp = threadIdx.x / kWarpSize;
  const int row = blockIdx.x * (blockDim.x / kWarpSize) + warp;  // token * heads + head
  if (row >= p.tokens * p.heads) return;  // whole warp leaves; only __syncwarp below
  const RopeSettings s{static_cast<const float*>(p.inv_freq), p.head_dim, p.rotary_dim, p.scaling};
  const int64_t offset = static_cast<int64_t>(row) * p.head_dim;
  float* out = static_cast<float*>(p.out) + offset;
  norm_rope_row(s, static_cast<const float*>(p.x) + offset, static_cast<const float*>(p.weight), p.eps,
                static_cast<const int32_t*>(p.positions)[row / p.heads], rope_rows + warp * p.head_dim,
                [out](int j, float value) { out[j] = value; });
}

// head_norm_rope of q and of k, and kv_cache_write of k and v, in one launch (the same per-element
// arithmetic, so the same bits): warps 0 .. T*Hq-1 own a (token, q head) row, the next T*Hkv a
// (token, kv head) row, whose rotated k and whose v they write into the caches as bf16.
__device__ void attention_prep(const AttentionPrepParams& p) {
  ATLAS_DYNAMIC_SMEM(float, rope_rows);  // [warps, head_dim]
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int row = blockIdx.x * (blockDim.x / kWarpSize) + warp;
  const int q_rows = p.tokens * p.q_heads;
  if (row >= q_rows + p.tokens * p.kv_heads) return;  // whole warp leaves; only __syncwarp below
  const RopeSettings s{static_cast<const float*>(p.inv_freq), p.head_dim, p.rotary_dim, p.scaling};
  const int32_t* positions = static_cast<const int32_t*>(p.positions);
  float* normed = rope_rows + warp * p.head_dim;
  if (row < q_rows) {
    const int64_t offset = static_cast<int64_t>(row) * p.head_dim;
    float* out = static_cast<float*>(p.q_out) + offset;
    norm_rope_row(s, static_cast<const float*>(p.q) + offset, static_cast<const float*>(p.q_weight), p.q_eps,
                  positions[row / p.q_heads], normed, [out](int j, float value) { out[j] = value; });
    return;
  }
  const int kv_row = row - q_rows;  // token * kv_heads + head
  const int position = positions[kv_row / p.kv_heads];
  if (position < 0 || position >= p.capacity) return;  // as kv_cache_write: nothing written
  const int64_t source = static_cast<int64_t>(kv_row) * p.head_dim;
  const int64_t slot = (static_cast<int64_t>(position) * p.kv_heads + kv_row % p.kv_heads) * p.head_dim;
  uint16_t* k_cache = static_cast<uint16_t*>(p.k_cache) + slot;
  uint16_t* v_cache = static_cast<uint16_t*>(p.v_cache) + slot;
  norm_rope_row(s, static_cast<const float*>(p.k) + source, static_cast<const float*>(p.k_weight), p.k_eps, position,
                normed, [k_cache](int j, float value) { k_cache[j] = f32_to_bf16(value); });
  const float* v = static_cast<const float*>(p.v) + source;
  for (int j = lane; j < p.head_dim; j += kWarpSize) v_cache[j] = f32_to_bf16(v[j]);
}

}  // namespace atlas
