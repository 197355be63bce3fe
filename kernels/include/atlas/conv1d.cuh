// Depthwise causal conv1d with fused SiLU, for prefill (T > 1) and the one-step decode update.
// One thread per channel walks a chunk of tokens with the last K-1 inputs in registers; chunks of
// kTokensPerBlock tokens run in parallel (grid.y), each reading the K-1 inputs before its chunk
// from x (or from the state for the first chunk). Only chunk 0 touches the state: it reads the
// old state and writes the new one (the last K-1 inputs of [old state, x]), so chunks never race.
// When it is the only chunk (decode), its window after the walk is that new state, stored as it
// is instead of read back from x and the state behind this thread's own stores.
#pragma once

#include "atlas/common.cuh"

namespace atlas::conv1d {

constexpr int kThreads = 128;
constexpr int kTokensPerBlock = 64;

__device__ __forceinline__ float load_tap(const void* weight, int weight_bf16, int64_t index) {
  if (weight_bf16) return bf16_to_f32(static_cast<const uint16_t*>(weight)[index]);
  return static_cast<const float*>(weight)[index];
}

// silu(conv) of one token: `window` the K-1 inputs before it, oldest first. Shared with the fused
// DeltaNet decode kernel (delta_decode.cuh), so both compute the same bits.
template <int K>
__device__ __forceinline__ float conv_silu(const float (&taps)[K], const float (&window)[K - 1], float current) {
  float acc = current * taps[K - 1];
#pragma unroll
  for (int j = 0; j < K - 1; ++j) acc = fmaf(window[j], taps[j], acc);
  return silu(acc);
}

// Input `i` of the extended sequence [old state (K-1), x (T)], i counted from x[0] (i < 0: state).
template <int K>
__device__ __forceinline__ float input_at(const CausalConv1dParams& p, int c, int i) {
  if (i >= 0) return static_cast<const float*>(p.x)[static_cast<int64_t>(i) * p.channels + c];
  return static_cast<const float*>(p.state)[static_cast<int64_t>(c) * (K - 1) + (K - 1) + i];
}

template <int K>
__device__ void store_state(const CausalConv1dParams& p, int c, const float (&next)[K - 1]) {
  float* state = static_cast<float*>(p.state) + static_cast<int64_t>(c) * (K - 1);
#pragma unroll
  for (int j = 0; j < K - 1; ++j) state[j] = next[j];
}

template <int K>
__device__ void write_new_state(const CausalConv1dParams& p, int c) {
  float next[K - 1];
#pragma unroll
  for (int j = 0; j < K - 1; ++j) next[j] = input_at<K>(p, c, p.num_tokens - (K - 1) + j);
  store_state<K>(p, c, next);
}

template <int K>
__device__ void causal_conv1d(const CausalConv1dParams& p) {
  static_assert(K >= 2, "causal_conv1d: kernel width must be >= 2");
  if (p.kernel_width != K || blockDim.x != kThreads) return;
  const int c = blockIdx.x * kThreads + threadIdx.x;
  const int t_begin = blockIdx.y * kTokensPerBlock;
  if (c >= p.channels || t_begin >= p.num_tokens) return;
  const int t_end = min(t_begin + kTokensPerBlock, p.num_tokens);

  float taps[K];
#pragma unroll
  for (int j = 0; j < K; ++j) taps[j] = load_tap(p.weight, p.weight_bf16, static_cast<int64_t>(c) * K + j);
  float window[K - 1];  // inputs t-(K-1) .. t-1, oldest first
#pragma unroll
  for (int j = 0; j < K - 1; ++j) window[j] = input_at<K>(p, c, t_begin - (K - 1) + j);

  const float* x = static_cast<const float*>(p.x);
  float* out = static_cast<float*>(p.out);
  for (int t = t_begin; t < t_end; ++t) {
    const int64_t at = static_cast<int64_t>(t) * p.channels + c;
    const float current = x[at];
    out[at] = conv_silu<K>(taps, window, current);
#pragma unroll
    for (int j = 0; j < K - 2; ++j) window[j] = window[j + 1];
    window[K - 2] = current;
  }
  if (gridDim.y == 1) store_state<K>(p, c, window);
  else if (blockIdx.y == 0) write_new_state<K>(p, c);
}

}  // namespace atlas::conv1d
