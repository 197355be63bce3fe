// MoE router. router_logits: grid (T, ceil((E + s) / kWarps)), one warp per (token, expert),
// logits = x @ W^T (W [E + s, H] bf16, x staged in smem, the whole weight row loaded at once).
// router_top_k: one warp per token: softmax in f32, top-k by k argmax rounds (descending,
// ties -> lower expert index), optionally renormalised. Two launches so that decode (T = 1)
// spreads the 1 MB weight read over E / kWarps blocks instead of one.
// router_fused (decode, opt-in): router_logits' grid and work, then the block of each token that
// arrives last (a per-token counter in p.arrivals) runs router_top_k's warp on the logits the
// others left in global memory, and sets the counter back to 0 so a captured graph replays.
// One launch instead of two; the same logits and route_token code, so the same bits.
// Shared slot (p.shared_expert = 1): the weight has E + 1 rows, row E the shared expert's gate;
// logits are [T, E + 1], softmax and top-k cover the first E only, and slot k of ids / weights
// [T, k + 1] is (E, sigmoid(logit E)): the shared expert runs as one more routed slot.
// router_logits_norm / router_fused_norm (decode, opt-in ATLAS_NORM=fused): the same with x
// computed in each block as add_rms_norm's output (norm.cuh stage_add_rms_norm) instead of read.
#pragma once

#include "atlas/common.cuh"
#include "atlas/norm.cuh"
#include "atlas/row_dot.cuh"
#include "atlas/stage.cuh"

namespace atlas::router {

using gemv_row::RowChunks;
using gemv_row::dot_row;
using gemv_row::load_row;
using gemv_row::zero_row;

constexpr int kWarps = 8;
constexpr int kLogitsThreads = kWarps * kWarpSize;
constexpr int kTopKThreads = kWarpSize;

template <int H, int E>
__device__ bool shape_matches(const RouterParams& p) {
  return p.hidden == H && p.num_experts == E && p.top_k > 0 && p.top_k <= E &&
         (p.shared_expert == 0 || p.shared_expert == 1);
}

// Logit columns (E, plus the shared expert's) and id / weight slots per token.
template <int E>
__device__ __forceinline__ int logit_columns(const RouterParams& p) { return E + p.shared_expert; }
__device__ __forceinline__ int token_slots(const RouterParams& p) { return p.top_k + p.shared_expert; }

// Token t's x row into x_s [H] by cp.async, then a barrier.
template <int H>
struct StageTokenRow {
  const RouterParams& p;
  __device__ void operator()(float* x_s, int t) const {
    stage_async(x_s, static_cast<const float*>(p.x) + static_cast<int64_t>(t) * H, H);
    stage_wait();
  }
};

// One token's x as add_rms_norm's output, the norm taken in (stage_add_rms_norm); block (0, 0)
// writes the norm's outputs.
template <int H>
struct StageNormRow {
  const RmsNormParams& norm;
  __device__ void operator()(float* x_s, int) const {
    stage_add_rms_norm<H, kLogitsThreads>(norm, x_s, blockIdx.x == 0 && blockIdx.y == 0);
  }
};

// This block's logits of token t (rows blockIdx.y * kWarps + warp), x staged by stage(x_s, t).
// Every thread of the block must call it (barriers); true in the lanes that stored a logit. It
// enters through pdl_enter after issuing the weight row's loads (ld.global.nc): under
// programmatic launch they overlap the previous kernel, which cannot have written them (no kernel
// writes weights); x is read after.
template <int H, int E, class Stage>
__device__ bool store_block_logits(const RouterParams& p, int t, Stage stage) {
  const int lane = threadIdx.x % kWarpSize;
  const int e = blockIdx.y * kWarps + threadIdx.x / kWarpSize;
  const int columns = logit_columns<E>(p);
  RowChunks<H> row;  // weight loads issued before x is staged, to overlap the two
  if (e < columns) load_row<H>(static_cast<const uint16_t*>(p.weight) + static_cast<int64_t>(e) * H, lane, row);
  else zero_row<H>(row);
  pdl_enter();
  __shared__ __align__(16) float x_s[H];
  stage(x_s, t);
  if (e >= columns) return false;
  const float logit = warp_sum(dot_row<H>(row, x_s, lane));
  if (lane != 0) return false;
  static_cast<float*>(p.logits)[static_cast<int64_t>(t) * columns + e] = logit;
  return true;
}

template <int H, int E, class Stage>
__device__ void router_logits(const RouterParams& p, Stage stage) {
  if (!shape_matches<H, E>(p) || blockDim.x != kLogitsThreads) return;
  const int t = blockIdx.x;
  if (t >= p.num_tokens) return;
  store_block_logits<H, E>(p, t, stage);
}

template <int H, int E>
__device__ void router_logits(const RouterParams& p) { router_logits<H, E>(p, StageTokenRow<H>{p}); }

// probs_s holds the softmax on entry; selected entries are overwritten. The weights are stored
// once at the end, scaled, from picked_s: scaling them in place in global memory would read each
// back behind its own store, one round trip per slot.
template <int E>
__device__ void top_k_rounds(const RouterParams& p, float* probs_s, int t, int lane) {
  __shared__ float picked_s[E];
  int32_t* ids = static_cast<int32_t*>(p.ids) + static_cast<int64_t>(t) * token_slots(p);
  float* weights = static_cast<float*>(p.weights) + static_cast<int64_t>(t) * token_slots(p);
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
    const bool found = best_e < E;  // false only when the logits are NaN
    picked_sum += found ? best : 0.0f;
    if (lane == 0) {
      ids[j] = found ? best_e : -1;
      picked_s[j] = found ? best : 0.0f;
      if (found) probs_s[best_e] = -2.0f;  // below every probability and the -1 start value
    }
    __syncwarp();
  }
  const float inv_sum = 1.0f / picked_sum;
  for (int j = lane; j < p.top_k; j += kWarpSize) weights[j] = p.renormalize ? picked_s[j] * inv_sum : picked_s[j];
}

// One warp: softmax, top-k and the shared slot of token t from its logits in global memory.
// Loads go through L2 (__ldcg): in router_fused other blocks wrote them during this launch.
template <int E>
__device__ void route_token(const RouterParams& p, int t, int lane) {
  __shared__ float probs_s[E];
  const float* logits = static_cast<const float*>(p.logits) + static_cast<int64_t>(t) * logit_columns<E>(p);
  float peak = -INFINITY;
  for (int e = lane; e < E; e += kWarpSize) {
    probs_s[e] = __ldcg(logits + e);
    peak = fmaxf(peak, probs_s[e]);
  }
  peak = warp_max(peak);
  float total = 0.0f;
  for (int e = lane; e < E; e += kWarpSize) {
    probs_s[e] = expf(probs_s[e] - peak);
    total += probs_s[e];
  }
  const float inv_total = 1.0f / warp_sum(total);
  for (int e = lane; e < E; e += kWarpSize) probs_s[e] *= inv_total;
  __syncwarp();
  top_k_rounds<E>(p, probs_s, t, lane);
  if (p.shared_expert && lane == 0) {
    const int64_t slot = static_cast<int64_t>(t) * token_slots(p) + p.top_k;
    static_cast<int32_t*>(p.ids)[slot] = E;
    static_cast<float*>(p.weights)[slot] = sigmoid(__ldcg(logits + E));
  }
}

template <int H, int E>
__device__ void router_top_k(const RouterParams& p) {
  if (!shape_matches<H, E>(p) || blockDim.x != kTopKThreads) return;
  const int t = blockIdx.x;
  if (t >= p.num_tokens) return;
  route_token<E>(p, t, threadIdx.x);
}

// threadFenceReduction: each storing lane fences its logit to device scope before the block
// counts itself in, so the block that sees count gridDim.y - 1 observes every block's logits;
// its own fence after the atomic orders its loads after that observation. The counter is back
// at 0 before the launch ends (no other block of this token touches it after arriving).
template <int H, int E, class Stage>
__device__ void router_fused(const RouterParams& p, Stage stage) {
  const unsigned blocks = static_cast<unsigned>(ceil_div(logit_columns<E>(p), kWarps));
  if (!shape_matches<H, E>(p) || blockDim.x != kLogitsThreads || p.arrivals == nullptr || gridDim.y != blocks) return;
  const int t = blockIdx.x;
  if (t >= p.num_tokens) return;
  if (store_block_logits<H, E>(p, t, stage)) __threadfence();
  __shared__ bool last_s;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* arrivals = static_cast<unsigned*>(p.arrivals) + t;
    last_s = atomicAdd(arrivals, 1u) == blocks - 1;
    if (last_s) {
      atomicExch(arrivals, 0u);
      __threadfence();
    }
  }
  __syncthreads();
  if (last_s && threadIdx.x < kWarpSize) route_token<E>(p, t, threadIdx.x);
}

template <int H, int E>
__device__ void router_fused(const RouterParams& p) { router_fused<H, E>(p, StageTokenRow<H>{p}); }

// One token's router (logits, or logits and top-k) of add_rms_norm's output, the norm taken in
// (ATLAS_NORM=fused): the same launch and bits as atlas_add_rms_norm then the plain entry.
template <int H>
__device__ __forceinline__ bool norm_matches(const RouterNormParams& p) {
  return p.router.num_tokens == 1 && p.norm.dim == H;
}

template <int H, int E>
__device__ void router_logits_norm(const RouterNormParams& p) {
  if (norm_matches<H>(p)) router_logits<H, E>(p.router, StageNormRow<H>{p.norm});
}

template <int H, int E>
__device__ void router_fused_norm(const RouterNormParams& p) {
  if (norm_matches<H>(p)) router_fused<H, E>(p.router, StageNormRow<H>{p.norm});
}

}  // namespace atlas::router
