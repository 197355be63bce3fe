// Gated delta rule, recurrent form, with the prep fused (q/k/v split from mixed_qkv, per-head
// L2 norm of q and k, q scale Dk^-0.5, decay exp(g) with g = -exp(A_log) * softplus(a + dt_bias),
// beta = sigmoid(b), key head = value head / (Hv / Hk)).
//
// Grid (Hv, Dv / kColsPerBlock), kThreads threads. Value columns are independent given q and k,
// so a block owns kColsPerBlock columns of one head's state [Dk, Dv] and keeps them in registers
// for the whole call: each column is split over kKeyParts lanes (rows i = part + kKeyParts * r),
// whose partial dot products meet through two shuffles. Tokens are walked sequentially (decode is
// T = 1; prefill too by default: the chunked WY form in delta_chunked.cuh is opt-in for now),
// with the next token's inputs loaded while the current one is computed.
#pragma once

#include "atlas/common.cuh"

namespace atlas::delta_rule {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kColsPerWarp = 8;
constexpr int kKeyParts = kWarpSize / kColsPerWarp;  // lanes sharing one value column
constexpr int kColsPerBlock = kWarps * kColsPerWarp;
constexpr float kL2Eps = 1e-6f;
constexpr int kChains = 4;  // independent FMA chains per dot product (latency, not throughput, bound)

__device__ __forceinline__ float chain_sum(const float (&partial)[kChains]) {
  return (partial[0] + partial[1]) + (partial[2] + partial[3]);
}

__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Sum over the kKeyParts lanes of one column (lanes col, col + 8, col + 16, col + 24).
__device__ __forceinline__ float column_sum(float value) {
#pragma unroll
  for (int offset = kColsPerWarp; offset < kWarpSize; offset *= 2)
    value += __shfl_xor_sync(kFullMask, value, offset);
  return value;
}

// One token's inputs as this thread needs them: q, k element threadIdx.x of the key head
// (threads < Dk), v of the thread's column, a and b of the head.
struct TokenInputs {
  float q = 0.0f;
  float k = 0.0f;
  float v = 0.0f;
  float a = 0.0f;
  float b = 0.0f;
};

template <int Hk, int Hv, int Dk, int Dv>
__device__ __forceinline__ void load_inputs(const GatedDeltaRuleParams& p, int t, int h, int col, TokenInputs& in) {
  constexpr int kRowWidth = 2 * Hk * Dk + Hv * Dv;
  const int hk = h / (Hv / Hk);
  const float* row = static_cast<const float*>(p.mixed_qkv) + static_cast<int64_t>(t) * kRowWidth;
  if (threadIdx.x < Dk) {
    in.q = row[hk * Dk + threadIdx.x];
    in.k = row[Hk * Dk + hk * Dk + threadIdx.x];
  }
  in.v = row[2 * Hk * Dk + h * Dv + col];
  in.a = static_cast<const float*>(p.a)[static_cast<int64_t>(t) * Hv + h];
  in.b = static_cast<const float*>(p.b)[static_cast<int64_t>(t) * Hv + h];
}

// rsqrt(sum(x^2) + eps) of a Dk vector in smem, computed by every warp for itself.
template <int Dk>
__device__ __forceinline__ float inv_l2_norm(const float* x_s, int lane) {
  float squares = 0.0f;
#pragma unroll
  for (int i = lane; i < Dk; i += kWarpSize) squares = fmaf(x_s[i], x_s[i], squares);
  return rsqrtf(warp_sum(squares) + kL2Eps);
}

// One token as a column's lanes see it: q, k of the key head in smem (as loaded, unnormalised),
// the column's v, the decay exp(g), beta and the L2-norm scales (q's includes Dk^-0.5).
struct ColumnToken {
  const float* q;
  const float* k;
  float v;
  float decay;
  float beta;
  float q_scale;
  float k_scale;
};

// One token on this thread's rows of its column (s[r] = S[part + kKeyParts * r][col]): decay,
// delta update, then o[col] = (S^T q)[col], returned in every lane of the column. Shared by the
// recurrent kernel and the fused decode kernel (delta_decode.cuh), so both compute the same bits.
template <int Dk>
__device__ __forceinline__ float step_column(float (&s)[Dk / kKeyParts], const ColumnToken& t, int part) {
  constexpr int kRows = Dk / kKeyParts;
  float predicted[kChains] = {};  // (S^T k)[col] with the decayed state, in independent chains
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    s[r] *= t.decay;
    predicted[r % kChains] = fmaf(s[r], t.k[part + kKeyParts * r], predicted[r % kChains]);
  }
  const float kv = column_sum(chain_sum(predicted)) * t.k_scale;
  const float delta = t.beta * (t.v - kv) * t.k_scale;  // k_scale folded into k
  float o[kChains] = {};
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    s[r] = fmaf(t.k[part + kKeyParts * r], delta, s[r]);
    o[r % kChains] = fmaf(s[r], t.q[part + kKeyParts * r], o[r % kChains]);
  }
  return column_sum(chain_sum(o)) * t.q_scale;
}

template <int Hk, int Hv, int Dk, int Dv>
__device__ void gated_delta_rule(const GatedDeltaRuleParams& p) {
  static_assert(Hv % Hk == 0, "gated_delta_rule: Hv must be a multiple of Hk");
  static_assert(Dk % (kKeyParts * kChains) == 0 && Dk <= kThreads, "gated_delta_rule: Dk must be a multiple of 16 and <= kThreads");
  static_assert(Dv % kColsPerBlock == 0, "gated_delta_rule: Dv must be a multiple of kColsPerBlock");
  constexpr int kRows = Dk / kKeyParts;
  if (p.num_k_heads != Hk || p.num_v_heads != Hv || p.k_head_dim != Dk || p.v_head_dim != Dv ||
      blockDim.x != kThreads)
    return;
  const int h = blockIdx.x;
  if (h >= Hv || blockIdx.y >= Dv / kColsPerBlock) return;

  // Double-buffered by token parity: one barrier per token (the buffer written at token t was
  // last read at token t - 2, before every thread passed token t - 1's barrier).
  __shared__ float q_s[2][Dk];
  __shared__ float k_s[2][Dk];
  const int lane = threadIdx.x % kWarpSize;
  const int part = lane / kColsPerWarp;
  const int col = blockIdx.y * kColsPerBlock + (threadIdx.x / kWarpSize) * kColsPerWarp + lane % kColsPerWarp;
  const float neg_A = -expf(static_cast<const float*>(p.A_log)[h]);
  const float dt_bias = static_cast<const float*>(p.dt_bias)[h];

  float* state = static_cast<float*>(p.state) + static_cast<int64_t>(h) * Dk * Dv + col;
  float s[kRows];  // s[r] = S[part + kKeyParts * r][col]
#pragma unroll
  for (int r = 0; r < kRows; ++r) s[r] = state[(part + kKeyParts * r) * Dv];

  float* out = static_cast<float*>(p.out);
  TokenInputs current;
  if (p.num_tokens > 0) load_inputs<Hk, Hv, Dk, Dv>(p, 0, h, col, current);
  for (int t = 0; t < p.num_tokens; ++t) {
    const int buf = t & 1;
    if (threadIdx.x < Dk) {
      q_s[buf][threadIdx.x] = current.q;
      k_s[buf][threadIdx.x] = current.k;
    }
    TokenInputs next;
    if (t + 1 < p.num_tokens) load_inputs<Hk, Hv, Dk, Dv>(p, t + 1, h, col, next);
    __syncthreads();
    const float* q = q_s[buf];
    const float* k = k_s[buf];
    const float q_scale = inv_l2_norm<Dk>(q, lane) * rsqrtf(static_cast<float>(Dk));
    const float k_scale = inv_l2_norm<Dk>(k, lane);
    const ColumnToken token{q, k, current.v, expf(neg_A * softplus(current.a + dt_bias)), sigmoid(current.b),
                            q_scale, k_scale};
    const float out_value = step_column<Dk>(s, token, part);
    if (part == 0) out[(static_cast<int64_t>(t) * Hv + h) * Dv + col] = out_value;
    current = next;
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) state[(part + kKeyParts * r) * Dv] = s[r];
}

}  // namespace atlas::delta_rule
