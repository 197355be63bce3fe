// Fused Gated DeltaNet decode (T == 1): causal conv1d + SiLU, the gated delta rule and the gated
// RMSNorm in one launch instead of three (atlas_causal_conv1d, atlas_gated_delta_rule,
// atlas_gated_rms_norm), with the same per-element code (conv_silu, step_column, norm_row), so
// the same bits.
//
// Grid (Hv, Dv / kColsPerBlock) and block as atlas_gated_delta_rule: a block owns kColsPerBlock
// value columns of head h, their state columns held in registers, read and written once.
// Conv: a block computes the channels it reads: all 2*Dk q and k channels of its key head
// hk = h / (Hv / Hk), shared by the kGroupBlocks blocks of that key head (recomputed, not
// communicated), and its own kColsPerBlock v channels.
// Conv state: a block's v channels are its own (read and written by that block alone). The q/k
// channels of key head hk are read by every block of the group, so they are written by the
// group's last block to arrive (counter hk in p.arrivals): every other block counted itself in
// after its reads, so no block reads a q/k state entry after it is overwritten.
// Norm: each block writes its columns' o un-normalised to out; the group's last block then runs
// gated_norm's row code over the group's Hv / Hk heads, reading o back through L2, and resets
// the counter to 0 so a captured graph replays.
#pragma once

#include "atlas/common.cuh"
#include "atlas/conv1d.cuh"
#include "atlas/delta_rule.cuh"
#include "atlas/gated_norm.cuh"

namespace atlas::delta_decode {

using delta_rule::kColsPerBlock;
using delta_rule::kColsPerWarp;
using delta_rule::kKeyParts;
using delta_rule::kThreads;
using delta_rule::kWarps;

// Conv channel of element i of the key head's [q; k] (i < Dk: q, else k).
template <int Hk, int Dk>
__device__ __forceinline__ int qk_channel(int hk, int i) {
  return i < Dk ? hk * Dk + i : Hk * Dk + hk * Dk + (i - Dk);
}

// silu(conv) of channel c for this token, from the old conv state.
template <int K>
__device__ __forceinline__ float conv_channel(const DeltaNetDecodeParams& p, int c) {
  float taps[K];
#pragma unroll
  for (int j = 0; j < K; ++j) taps[j] = conv1d::load_tap(p.conv_weight, p.weight_bf16, static_cast<int64_t>(c) * K + j);
  const float* state = static_cast<const float*>(p.conv_state) + static_cast<int64_t>(c) * (K - 1);
  float window[K - 1];
#pragma unroll
  for (int j = 0; j < K - 1; ++j) window[j] = state[j];
  return conv1d::conv_silu<K>(taps, window, static_cast<const float*>(p.mixed)[c]);
}

// Conv state of channel c after this token: the old state shifted by one, then this input.
template <int K>
__device__ __forceinline__ void advance_conv_state(const DeltaNetDecodeParams& p, int c) {
  float* state = static_cast<float*>(p.conv_state) + static_cast<int64_t>(c) * (K - 1);
  float next[K - 1];
#pragma unroll
  for (int j = 0; j < K - 2; ++j) next[j] = state[j + 1];
  next[K - 2] = static_cast<const float*>(p.mixed)[c];
#pragma unroll
  for (int j = 0; j < K - 1; ++j) state[j] = next[j];
}

// threadFenceReduction, as router_fused: every thread fences its stores (o, state) to device
// scope before the block counts itself in, so the block that sees count kBlocks - 1 observes
// every block's o; its fence after the atomic orders its loads and q/k state writes after that.
template <int kBlocks>
__device__ __forceinline__ bool arrive_last(const DeltaNetDecodeParams& p, int hk) {
  __shared__ bool last_s;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* arrivals = static_cast<unsigned*>(p.arrivals) + hk;
    last_s = atomicAdd(arrivals, 1u) == static_cast<unsigned>(kBlocks - 1);
    if (last_s) atomicExch(arrivals, 0u);
  }
  __syncthreads();
  if (last_s) __threadfence();
  return last_s;
}

// The last block of key head hk: the group's q/k conv state, then the gated norm of its heads.
template <int K, int Hk, int Hv, int Dk, int Dv>
__device__ void finish_group(const DeltaNetDecodeParams& p, int hk) {
  constexpr int kGroup = Hv / Hk;
  for (int i = threadIdx.x; i < 2 * Dk; i += kThreads) advance_conv_state<K>(p, qk_channel<Hk, Dk>(hk, i));
  const int lane = threadIdx.x % kWarpSize;
  float* out = static_cast<float*>(p.out);
  const float* z = static_cast<const float*>(p.z);
  for (int g = threadIdx.x / kWarpSize; g < kGroup; g += kWarps) {
    const int64_t row = static_cast<int64_t>(hk * kGroup + g) * Dv;
    gated_norm::norm_row<Dv>(out + row, z + row, static_cast<const float*>(p.norm_weight), out + row, p.eps, lane);
  }
}

template <int K, int Hk, int Hv, int Dk, int Dv>
__device__ __forceinline__ bool shape_matches(const DeltaNetDecodeParams& p) {
  return p.kernel_width == K && p.num_k_heads == Hk && p.num_v_heads == Hv && p.k_head_dim == Dk &&
         p.v_head_dim == Dv && p.arrivals != nullptr && blockDim.x == kThreads && gridDim.x == Hv &&
         gridDim.y == Dv / kColsPerBlock;
}

template <int K, int Hk, int Hv, int Dk, int Dv>
__device__ void delta_net_decode(const DeltaNetDecodeParams& p) {
  static_assert(K >= 2, "delta_net_decode: conv width must be >= 2");
  static_assert(Hv % Hk == 0, "delta_net_decode: Hv must be a multiple of Hk");
  static_assert(Dk % (kKeyParts * delta_rule::kChains) == 0 && Dk <= kThreads, "delta_net_decode: Dk must be a multiple of 16 and <= kThreads");
  static_assert(Dv % kColsPerBlock == 0, "delta_net_decode: Dv must be a multiple of kColsPerBlock");
  constexpr int kRows = Dk / kKeyParts;
  constexpr int kGroupBlocks = (Hv / Hk) * (Dv / kColsPerBlock);
  if (!shape_matches<K, Hk, Hv, Dk, Dv>(p)) return;
  const int h = blockIdx.x;
  const int hk = h / (Hv / Hk);

  const int lane = threadIdx.x % kWarpSize;
  const int part = lane / kColsPerWarp;
  const int col = blockIdx.y * kColsPerBlock + (threadIdx.x / kWarpSize) * kColsPerWarp + lane % kColsPerWarp;
  // The state columns first: the block's one large read is in flight while the conv runs.
  float* state = static_cast<float*>(p.state) + static_cast<int64_t>(h) * Dk * Dv + col;
  float s[kRows];  // s[r] = S[part + kKeyParts * r][col]
#pragma unroll
  for (int r = 0; r < kRows; ++r) s[r] = state[(part + kKeyParts * r) * Dv];

  __shared__ float q_s[Dk];
  __shared__ float k_s[Dk];
  for (int i = threadIdx.x; i < 2 * Dk; i += kThreads) {
    const float value = conv_channel<K>(p, qk_channel<Hk, Dk>(hk, i));
    if (i < Dk) q_s[i] = value;
    else k_s[i - Dk] = value;
  }
  const int v_channel = 2 * Hk * Dk + h * Dv + col;
  const float v = conv_channel<K>(p, v_channel);
  const float neg_A = -expf(static_cast<const float*>(p.A_log)[h]);
  const float dt_bias = static_cast<const float*>(p.dt_bias)[h];
  const float a = static_cast<const float*>(p.a)[h];
  const float b = static_cast<const float*>(p.b)[h];

  __syncthreads();  // q_s / k_s complete; every lane of a column has read its v channel's state
  if (part == 0) advance_conv_state<K>(p, v_channel);

  const float q_scale = delta_rule::inv_l2_norm<Dk>(q_s, lane) * rsqrtf(static_cast<float>(Dk));
  const float k_scale = delta_rule::inv_l2_norm<Dk>(k_s, lane);
  const delta_rule::ColumnToken token{q_s, k_s, v, expf(neg_A * delta_rule::softplus(a + dt_bias)), sigmoid(b),
                                      q_scale, k_scale};
  const float out_value = delta_rule::step_column<Dk>(s, token, part);
#pragma unroll
  for (int r = 0; r < kRows; ++r) state[(part + kKeyParts * r) * Dv] = s[r];
  if (part == 0) static_cast<float*>(p.out)[static_cast<int64_t>(h) * Dv + col] = out_value;
  if (arrive_last<kGroupBlocks>(p, hk)) finish_group<K, Hk, Hv, Dk, Dv>(p, hk);
}

}  // namespace atlas::delta_decode
