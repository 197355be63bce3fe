// Causal GQA attention over a bf16 KV cache, one kernel for decode and prefill:
//   kv_cache_write: cache[positions[t]] = bf16(k[t]), bf16(v[t]) (run first, same stream).
//   attention_block<D, R, W>: grid (splits, kv_heads, row tiles). A block owns W*R query rows
//     (row = token * G + g, q head = kv_head * G + g, G = q_heads / kv_heads) and the cache keys
//     [split * span, min((split + 1) * span, last position of its rows + 1)), where
//     span = 32 * ceil(live / (32 * splits)) follows the live length read from device memory, so
//     a graph sized for the cache capacity still spreads a short context over all splits. Each
//     32-key tile of K and V is staged in shared memory (cp.async, 16-byte copies) and shared by
//     all rows. A warp owns R rows, a lane owns D/32 consecutive dims of q and of the output
//     accumulator. Scores: per key each lane computes a partial dot product; a butterfly
//     "transpose reduction" (31 shuffles for 32 keys) leaves lane j holding the full score of key
//     j. Online softmax in f32, masked by each row's own position (read from device memory:
//     graph-capture safe).
//   Decode (few tokens): many splits (flash-decoding) + attention_combine. Prefill: one split
//     (span >= live) writes the normalised output directly (ml == nullptr).
#pragma once

#include "atlas/common.cuh"
#include "atlas/ptx.cuh"

namespace atlas {

constexpr int kAttnKeys = 32;  // keys per shared-memory tile == warp size (lane j <-> key j)

__device__ void kv_cache_write(const KvCacheWriteParams& p) {
  const int64_t row_elems = static_cast<int64_t>(p.kv_heads) * p.head_dim;
  const int64_t n = p.tokens * row_elems;
  const int32_t* positions = static_cast<const int32_t*>(p.positions);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / row_elems;
    const int pos = positions[t];
    if (pos < 0 || pos >= p.capacity) continue;
    const int64_t dst = pos * row_elems + (i - t * row_elems);
    static_cast<uint16_t*>(p.k_cache)[dst] = f32_to_bf16(static_cast<const float*>(p.k)[i]);
    static_cast<uint16_t*>(p.v_cache)[dst] = f32_to_bf16(static_cast<const float*>(p.v)[i]);
  }
}

// One butterfly stage: lanes with bit `Width` set keep the upper half of their values, the others
// the lower half, and each adds its partner's copy of the half it keeps.
template <int Width>
__device__ __forceinline__ void transpose_reduce_stage(float (&part)[kAttnKeys], int lane) {
  const bool upper = (lane & Width) != 0;
#pragma unroll
  for (int v = 0; v < Width; ++v) {
    const float send = upper ? part[v] : part[v + Width];
    const float keep = upper ? part[v + Width] : part[v];
    part[v] = keep + __shfl_xor_sync(kFullMask, send, Width);
  }
}

// 32 per-key partial sums per lane -> lane j returns the warp-wide total of key j (31 shuffles).
__device__ __forceinline__ float transpose_reduce(float (&part)[kAttnKeys]) {
  const int lane = threadIdx.x % kWarpSize;
  transpose_reduce_stage<16>(part, lane);
  transpose_reduce_stage<8>(part, lane);
  transpose_reduce_stage<4>(part, lane);
  transpose_reduce_stage<2>(part, lane);
  transpose_reduce_stage<1>(part, lane);
  return part[0];
}

// A tile of 32 keys and values staged in shared memory. attention_block is generic over the tile
// type (kv_quant.cuh adds the quantized caches): load() stages keys key0.., key()/value() give a
// lane its D/32 dims of key j as f32, enter()/leave() map the rows into / out of the tile's basis.
template <int D>
struct AttnTile {
  uint16_t k[kAttnKeys][D];
  uint16_t v[kAttnKeys][D];
  __device__ void load(const AttentionParams& p, int hk, int key0, int key_end);
  __device__ __forceinline__ void key(int j, int lane, float (&out)[D / kWarpSize]) const {
    load_bf16<D / kWarpSize>(&k[j][lane * (D / kWarpSize)], out);
  }
  __device__ __forceinline__ void value(int j, int lane, float (&out)[D / kWarpSize]) const {
    load_bf16<D / kWarpSize>(&v[j][lane * (D / kWarpSize)], out);
  }
  template <class Rows>
  __device__ __forceinline__ static void enter(Rows&) {}
  template <class Rows>
  __device__ __forceinline__ static void leave(Rows&) {}
};

// Keys key0 .. key0+31 of kv head hk into the tile (zero-filled from key_end on) by cp.async,
// complete on return: every copy of a thread is issued at once. A loop of loads and stores (trip
// count kChunks / blockDim, unknown to the compiler) waited one round trip per iteration: 8 in
// the 128-thread decode kernel at head_dim 256.
template <int D>
__device__ __forceinline__ void attn_load_tile(const AttentionParams& p, int hk, int key0, int key_end,
                                               AttnTile<D>& tile) {
  constexpr int kChunks = kAttnKeys * D / 8;  // 16-byte chunks per matrix
  const uint16_t* k_cache = static_cast<const uint16_t*>(p.k_cache);
  const uint16_t* v_cache = static_cast<const uint16_t*>(p.v_cache);
  for (int c = threadIdx.x; c < kChunks; c += blockDim.x) {
    const int j = c / (D / 8);
    const int d = (c % (D / 8)) * 8;
    const bool valid = key0 + j < key_end;
    const int64_t src = valid ? (static_cast<int64_t>(key0 + j) * p.kv_heads + hk) * D + d : 0;
    cp_async_16(&tile.k[j][d], k_cache + src, valid);
    cp_async_16(&tile.v[j][d], v_cache + src, valid);
  }
  cp_async_commit();
  cp_async_wait<0>();
}

template <int D>
__device__ void AttnTile<D>::load(const AttentionParams& p, int hk, int key0, int key_end) {
  attn_load_tile<D>(p, hk, key0, key_end, *this);
}

template <int D, int R>
struct AttnRows {
  static constexpr int kPerLane = D / kWarpSize;
  float q[R][kPerLane];
  float acc[R][kPerLane];
  float m[R];
  float l[R];
  int pos[R];  // -1 for rows past the end (fully masked)
  int token[R];
  int head[R];
};

// Online-softmax update of the warp's R rows with one staged tile of keys key0 .. key0+31.
template <int D, int R, class Tile>
__device__ __forceinline__ void attn_tile_update(const Tile& tile, int key0, int key_end, AttnRows<D, R>& rows) {
  constexpr int kPerLane = D / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  float part[R][kAttnKeys];  // each smem K row is read once and used by all R rows
#pragma unroll
  for (int j = 0; j < kAttnKeys; ++j) {
    float kf[kPerLane];
    tile.key(j, lane, kf);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) dot = fmaf(rows.q[i][e], kf[e], dot);
      part[i][j] = dot;
    }
  }
  float prob[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const float dot = transpose_reduce(part[i]);
    const int key = key0 + lane;
    const float score = key < key_end && key <= rows.pos[i] ? dot : -INFINITY;
    const float m_new = fmaxf(rows.m[i], warp_max(score));
    const bool empty = m_new == -INFINITY;  // no visible key yet: keep the state as is
    prob[i] = empty ? 0.0f : expf(score - m_new);
    const float alpha = empty ? 1.0f : expf(rows.m[i] - m_new);
    rows.l[i] = rows.l[i] * alpha + warp_sum(prob[i]);
    rows.m[i] = m_new;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) rows.acc[i][e] *= alpha;
  }
#pragma unroll 4
  for (int j = 0; j < kAttnKeys; ++j) {
    float vf[kPerLane];
    tile.value(j, lane, vf);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const float pj = __shfl_sync(kFullMask, prob[i], j);
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) rows.acc[i][e] = fmaf(pj, vf[e], rows.acc[i][e]);
    }
  }
}

template <int D, int R>
__device__ __forceinline__ void attn_init_rows(const AttentionParams& p, int first_row, AttnRows<D, R>& rows) {
  constexpr int kPerLane = D / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int group = p.q_heads / p.kv_heads;
  const int32_t* positions = static_cast<const int32_t*>(p.positions);
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int row = first_row + i;
    const bool valid = row < p.tokens * group;
    rows.token[i] = valid ? row / group : 0;
    rows.head[i] = blockIdx.y * group + (valid ? row % group : 0);
    rows.pos[i] = valid ? positions[rows.token[i]] : -1;
    rows.m[i] = -INFINITY;
    rows.l[i] = 0.0f;
    float qf[kPerLane];
    if (valid) {
      load_f32<kPerLane>(static_cast<const float*>(p.q) + (static_cast<int64_t>(rows.token[i]) * p.q_heads + rows.head[i]) * D + lane * kPerLane, qf);
    }
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      rows.q[i][e] = valid ? qf[e] * p.scale : 0.0f;
      rows.acc[i][e] = 0.0f;
    }
  }
}

template <int D, int R>
__device__ __forceinline__ void attn_store_rows(const AttentionParams& p, const AttnRows<D, R>& rows) {
  constexpr int kPerLane = D / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t split_offset = p.ml == nullptr ? 0 : static_cast<int64_t>(blockIdx.x) * p.tokens * p.q_heads;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    if (rows.pos[i] < 0) continue;
    const int64_t out_row = split_offset + static_cast<int64_t>(rows.token[i]) * p.q_heads + rows.head[i];
    const float inv = rows.l[i] > 0.0f ? 1.0f / rows.l[i] : 0.0f;
    float* out = static_cast<float*>(p.out) + out_row * D + lane * kPerLane;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) out[e] = rows.acc[i][e] * inv;
    if (p.ml != nullptr && lane == 0) {
      static_cast<float*>(p.ml)[out_row * 2] = rows.m[i];
      static_cast<float*>(p.ml)[out_row * 2 + 1] = rows.l[i];
    }
  }
}

// Global live length: the last token's position + 1, clamped to the cache.
__device__ __forceinline__ int attn_live_length(const int32_t* positions, int tokens, int capacity) {
  return max(min(positions[tokens - 1] + 1, capacity), 0);
}

// Keys per split: the live keys spread over `splits`, in whole 32-key tiles. The attention and
// combine kernels both derive it from the same device data.
__device__ __forceinline__ int attn_span(int live, int splits) {
  return kAttnKeys * max(ceil_div(live, kAttnKeys * splits), 1);
}

template <int D, int R, int W, class Tile = AttnTile<D>>
__device__ void attention_block(const AttentionParams& p) {
  static_assert(D == 64 || D == 128 || D == 256, "attention: head_dim must be 64, 128 or 256");
  __shared__ __align__(16) Tile tile;
  if (p.head_dim != D || p.tokens <= 0) return;
  const int32_t* positions = static_cast<const int32_t*>(p.positions);
  const int live = attn_live_length(positions, p.tokens, p.capacity);
  const int span = attn_span(live, gridDim.x);
  const int key_begin = blockIdx.x * span;
  if (key_begin >= live) return;  // the combine kernel reads only splits below `live`

  const int warp = threadIdx.x / kWarpSize;
  const int block_row0 = blockIdx.z * (W * R);
  if (block_row0 >= p.tokens * (p.q_heads / p.kv_heads)) return;
  const int group = p.q_heads / p.kv_heads;
  const int last_token = min((block_row0 + W * R - 1) / group, p.tokens - 1);
  const int key_end = min(min(key_begin + span, positions[last_token] + 1), live);

  AttnRows<D, R> rows;
  attn_init_rows<D, R>(p, block_row0 + warp * R, rows);
  Tile::enter(rows);
  for (int key0 = key_begin; key0 < key_end; key0 += kAttnKeys) {
    __syncthreads();  // the previous tile is no longer read
    tile.load(p, blockIdx.y, key0, key_end);
    __syncthreads();
    attn_tile_update<D, R>(tile, key0, key_end, rows);
  }
  Tile::leave(rows);
  attn_store_rows<D, R>(p, rows);
}

// Splits whose (m, l) and partial a thread loads at once: the split loops have a runtime trip
// count, and rolled each load stalled the next one (one round trip per split, two loops).
constexpr int kCombineBatch = 8;

// One block per (token, q head), one thread per dim: merge the live splits' (m, l, o).
__device__ void attention_combine(const AttentionCombineParams& p) {
  const int row = blockIdx.x;  // token * q_heads + head
  const int d = threadIdx.x;
  if (row >= p.tokens * p.q_heads || d >= p.head_dim) return;
  const int32_t* positions = static_cast<const int32_t*>(p.positions);
  const int live = attn_live_length(positions, p.tokens, p.capacity);
  const int splits = min(ceil_div(live, attn_span(live, p.num_splits)), p.num_splits);
  const int64_t stride = static_cast<int64_t>(p.tokens) * p.q_heads;
  const float* ml = static_cast<const float*>(p.ml);
  const float* partial = static_cast<const float*>(p.partial);
  float m_max = -INFINITY;
  for (int s0 = 0; s0 < splits; s0 += kCombineBatch) {
    float m[kCombineBatch];
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) m[b] = s0 + b < splits ? ml[((s0 + b) * stride + row) * 2] : -INFINITY;
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) m_max = fmaxf(m_max, m[b]);
  }
  float numerator = 0.0f, denominator = 0.0f;
  if (m_max != -INFINITY) {
    for (int s0 = 0; s0 < splits; s0 += kCombineBatch) {
      float m[kCombineBatch], l[kCombineBatch], v[kCombineBatch];
#pragma unroll
      for (int b = 0; b < kCombineBatch; ++b) {  // loads first, then the sums in split order
        const int64_t at = (s0 + b) * stride + row;
        const bool live_split = s0 + b < splits;
        m[b] = live_split ? ml[at * 2] : -INFINITY;
        l[b] = live_split ? ml[at * 2 + 1] : 0.0f;
        v[b] = live_split ? partial[at * p.head_dim + d] : 0.0f;
      }
#pragma unroll
      for (int b = 0; b < kCombineBatch; ++b) {
        if (s0 + b >= splits) break;
        const float weight = m[b] == -INFINITY ? 0.0f : expf(m[b] - m_max) * l[b];
        numerator = fmaf(weight, v[b], numerator);
        denominator += weight;
      }
    }
  }
  const int64_t at = static_cast<int64_t>(row) * p.head_dim + d;
  const float value = denominator > 0.0f ? numerator / denominator : 0.0f;
  // x * sigmoid(gate), as sigmoid_mul computes it: the same bits as the separate kernel
  static_cast<float*>(p.out)[at] = p.gate == nullptr ? value : value * sigmoid(static_cast<const float*>(p.gate)[at]);
}

}  // namespace atlas
