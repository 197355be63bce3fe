// MoE router: per token, logits = x @ W^T (W [E, H] bf16), softmax in f32, top-k (descending,
// ties -> lower expert index), optionally renormalised. One block per token: x staged in smem,
// one warp per expert row (16-byte weight loads), then warp 0 does softmax and k argmax rounds.
#pragma once

#include "atlas/common.cuh"
#include "atlas/row_dot.cuh"

namespace atlas::router {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;

// Dynamic smem: hidden + num_experts floats.
__host__ __device__ constexpr int smem_bytes(int hidden, int num_experts) {
  return (hidden + num_experts) * static_cast<int>(sizeof(float));
}

// Warp 0: probs_s holds logits on entry, probabilities (selected ones overwritten) on exit.
__device__ void softmax_top_k(const RouterParams& p, float* probs_s, int t, int lane) {
  const int E = p.num_experts;
  float peak = -INFINITY;
  for (int e = lane; e < E; e += kWarpSize) peak = fmaxf(peak, probs_s[e]);
  peak = warp_max(peak);
  float total = 0.0f;
  for (int e = lane; e < E; e += kWarpSize) {
    probs_s[e] = expf(probs_s[e] - peak);
    total += probs_s[e];
  }
  const float inv_total = 1.0f / warp_sum(total);
  for (int e = lane; e < E; e += kWarpSize) probs_s[e] *= inv_total;
  __syncwarp();

  int32_t* ids = static_cast<int32_t*>(p.ids) + static_cast<int64_t>(t) * p.top_k;
  float* weights = static_cast<float*>(p.weights) + static_cast<int64_t>(t) * p.top_k;
  float picked_sum = 0.0f;
  for (int j = 0; j < p.top_k; ++j) {
    float best = -1.0f;
    int best_e = E;
    for (int e = lane; e < E; e += kWarpSize) {
      const float v = probs_s[e];
      if (v > best) { best = v; best_e = e; }  // e ascends per lane: ties keep the lower index
    }
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(kFullMask, best, offset);
      const int other_e = __shfl_xor_sync(kFullMask, best_e, offset);
      if (other > best || (other == best && other_e < best_e)) { best = other; best_e = other_e; }
    }
    picked_sum += best_e < E ? best : 0.0f;
    if (lane == 0) {
      const bool found = best_e < E;  // false only when the logits are NaN
      ids[j] = found ? best_e : -1;
      weights[j] = found ? best : 0.0f;
      if (found) probs_s[best_e] = -2.0f;  // below every probability and the -1 start value
    }
    __syncwarp();
  }
  if (p.renormalize && lane == 0) {
    const float inv_sum = 1.0f / picked_sum;
    for (int j = 0; j < p.top_k; ++j) weights[j] *= inv_sum;
  }
}

__device__ void router(const RouterParams& p) {
  if (blockDim.x != kThreads || p.top_k > p.num_experts || p.hidden % 8 != 0) return;
  const int t = blockIdx.x;
  if (t >= p.num_tokens) return;
  extern __shared__ float router_smem[];
  float* x_s = router_smem;
  float* probs_s = router_smem + p.hidden;
  const float* x = static_cast<const float*>(p.x) + static_cast<int64_t>(t) * p.hidden;
  for (int i = threadIdx.x; i < p.hidden; i += kThreads) x_s[i] = x[i];
  __syncthreads();

  const int lane = threadIdx.x % kWarpSize;
  const uint16_t* weight = static_cast<const uint16_t*>(p.weight);
  for (int e = threadIdx.x / kWarpSize; e < p.num_experts; e += kWarps) {
    const float logit = warp_sum(row_dot_partial(weight + static_cast<int64_t>(e) * p.hidden, x_s, p.hidden, lane));
    if (lane == 0) probs_s[e] = logit;
  }
  __syncthreads();
  if (threadIdx.x < kWarpSize) softmax_top_k(p, probs_s, t, lane);
}

}  // namespace atlas::router
