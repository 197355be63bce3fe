// Gated delta rule, recurrent form, with the prep fused (q/k/v split from mixed_qkv, per-head
// L2 norm of q and k, q scale Dk^-0.5, decay exp(g) with g = -exp(A_log) * softplus(a + dt_bias),
// beta = sigmoid(b), key head = value head / (Hv / Hk)).
//
// Grid (Hv, Dv / kColsPerBlock), kThreads threads. Value columns are independent given q and k,
// so a block owns kColsPerBlock columns of one head's state [Dk, Dv] and keeps them in registers
// for the whole call: each column is split over kKeyParts lanes (rows i = part + kKeyParts * r),
// whose partial dot products meet through two shuffles. Tokens are walked sequentially (decode is
// T = 1; prefill walks T on chip: the first version, the chunked WY form is not written yet).
#pragma once

#include "atlas/common.cuh"

namespace atlas::delta_rule {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kColsPerWarp = 8;
constexpr int kKeyParts = kWarpSize / kColsPerWarp;  // lanes sharing one value column
constexpr int kColsPerBlock = kWarps * kColsPerWarp;
constexpr float kL2Eps = 1e-6f;

__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Sum over the kKeyParts lanes of one column (lanes col, col + 8, col + 16, col + 24).
__device__ __forceinline__ float column_sum(float value) {
#pragma unroll
  for (int offset = kColsPerWarp; offset < kWarpSize; offset *= 2)
    value += __shfl_xor_sync(kFullMask, value, offset);
  return value;
}

struct TokenScalars {
  float q_scale;  // rsqrt(|q|^2 + eps) * Dk^-0.5
  float k_scale;  // rsqrt(|k|^2 + eps)
  float decay;    // exp(g)
  float beta;
};

// Stages raw q, k of key head `hk` for token t in smem and computes the token's scalars.
// Starts and ends with a barrier; every thread of the block must call it.
template <int Hk, int Hv, int Dk, int Dv>
__device__ void prepare_token(const GatedDeltaRuleParams& p, int t, int h, float* q_s, float* k_s,
                              TokenScalars& scalars) {
  constexpr int kRowWidth = 2 * Hk * Dk + Hv * Dv;
  const int hk = h / (Hv / Hk);
  const float* row = static_cast<const float*>(p.mixed_qkv) + static_cast<int64_t>(t) * kRowWidth;
  __syncthreads();  // the previous token is done with q_s, k_s and the scalars
  for (int i = threadIdx.x; i < Dk; i += kThreads) {
    q_s[i] = row[hk * Dk + i];
    k_s[i] = row[Hk * Dk + hk * Dk + i];
  }
  __syncthreads();
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  if (warp < 2) {
    const float* src = warp == 0 ? q_s : k_s;
    float squares = 0.0f;
    for (int i = lane; i < Dk; i += kWarpSize) squares = fmaf(src[i], src[i], squares);
    squares = warp_sum(squares);
    const float inv_norm = rsqrtf(squares + kL2Eps);
    if (lane == 0) {
      if (warp == 0) scalars.q_scale = inv_norm * rsqrtf(static_cast<float>(Dk));
      else scalars.k_scale = inv_norm;
    }
  } else if (warp == 2 && lane == 0) {
    const int64_t at = static_cast<int64_t>(t) * Hv + h;
    const float a = static_cast<const float*>(p.a)[at];
    const float b = static_cast<const float*>(p.b)[at];
    const float A_log = static_cast<const float*>(p.A_log)[h];
    const float dt_bias = static_cast<const float*>(p.dt_bias)[h];
    scalars.decay = expf(-expf(A_log) * softplus(a + dt_bias));
    scalars.beta = sigmoid(b);
  }
  __syncthreads();
}

template <int Hk, int Hv, int Dk, int Dv>
__device__ void gated_delta_rule(const GatedDeltaRuleParams& p) {
  static_assert(Hv % Hk == 0, "gated_delta_rule: Hv must be a multiple of Hk");
  static_assert(Dk % kKeyParts == 0, "gated_delta_rule: Dk must be a multiple of kKeyParts");
  static_assert(Dv % kColsPerBlock == 0, "gated_delta_rule: Dv must be a multiple of kColsPerBlock");
  constexpr int kRows = Dk / kKeyParts;
  constexpr int kRowWidth = 2 * Hk * Dk + Hv * Dv;
  if (p.num_k_heads != Hk || p.num_v_heads != Hv || p.k_head_dim != Dk || p.v_head_dim != Dv ||
      blockDim.x != kThreads)
    return;
  const int h = blockIdx.x;
  if (h >= Hv || blockIdx.y >= Dv / kColsPerBlock) return;

  __shared__ float q_s[Dk];
  __shared__ float k_s[Dk];
  __shared__ TokenScalars scalars;
  const int lane = threadIdx.x % kWarpSize;
  const int part = lane / kColsPerWarp;
  const int col = blockIdx.y * kColsPerBlock + (threadIdx.x / kWarpSize) * kColsPerWarp + lane % kColsPerWarp;

  float* state = static_cast<float*>(p.state) + static_cast<int64_t>(h) * Dk * Dv + col;
  float s[kRows];  // s[r] = S[part + kKeyParts * r][col]
#pragma unroll
  for (int r = 0; r < kRows; ++r) s[r] = state[(part + kKeyParts * r) * Dv];

  const float* mixed = static_cast<const float*>(p.mixed_qkv);
  float* out = static_cast<float*>(p.out);
  for (int t = 0; t < p.num_tokens; ++t) {
    prepare_token<Hk, Hv, Dk, Dv>(p, t, h, q_s, k_s, scalars);
    const float v = mixed[static_cast<int64_t>(t) * kRowWidth + 2 * Hk * Dk + h * Dv + col];
    const float decay = scalars.decay;
    const float k_scale = scalars.k_scale;
    float predicted = 0.0f;  // (S^T k)[col] with the decayed state
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      s[r] *= decay;
      predicted = fmaf(s[r], k_s[part + kKeyParts * r], predicted);
    }
    predicted = column_sum(predicted) * k_scale;
    const float delta = scalars.beta * (v - predicted) * k_scale;  // k_scale folded into k
    float o = 0.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      s[r] = fmaf(k_s[part + kKeyParts * r], delta, s[r]);
      o = fmaf(s[r], q_s[part + kKeyParts * r], o);
    }
    o = column_sum(o) * scalars.q_scale;
    if (part == 0) out[(static_cast<int64_t>(t) * Hv + h) * Dv + col] = o;
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) state[(part + kKeyParts * r) * Dv] = s[r];
}

}  // namespace atlas::delta_rule
