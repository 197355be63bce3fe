// Causal GQA prefill attention on tensor cores (flash-attention-2 style) over a bf16 KV cache that
// kv_cache_write (attention.cuh) has already filled for this step's positions.
//   Grid (row tiles, kv_heads), 128 threads. A block owns kMmaAttnRows = 64 query rows of one kv
//   head (row = token * G + g, q head = kv_head * G + g, G = q_heads / kv_heads, as attention.cuh),
//   4 warps x 16 rows; row tiles run in reverse so the longest key ranges start first.
//   Q: the block's rows converted to bf16 once into shared memory (unscaled; the scale is applied
//   to the f32 scores). Keys [0, key_end), key_end = the block's largest position + 1 (clamped to
//   the cache), in tiles of 32 keys: K and V tiles arrive by cp.async into one buffer each; the
//   next K tile is in flight while this tile's P V runs, the next V tile while the next scores run.
//   (Kv, the kernel's tile source: MmaBf16Kv copies from the bf16 cache; kv_quant_mma.cuh decodes
//   a quantized level into the same tiles.)
//   S = Q K^T and O += P V by mma.sync m16n8k16 (bf16 in, f32 accumulate); fragments by ldmatrix
//   (ldmatrix.trans for V), smem rows padded by 16 bytes so the 8 row addresses of each ldmatrix
//   phase fall in distinct banks. Online softmax in f32 on the score fragments, in the log2 domain
//   (exp2 of score * scale * log2 e); the row max is reduced over the quad of lanes sharing a row,
//   the row sum stays per lane (of the bf16-rounded P that the mma uses) and is reduced at the end.
//   Each row is masked by its own position, read from device memory.
// head_dim 256: the O accumulator is 16 rows x 256 f32 per warp = 128 registers per thread, kept
// whole (one pass over the keys); ptxas reports zero spills (docs/kernels.md lists the registers).
#pragma once

#include "atlas/common.cuh"
#include "atlas/gemm.cuh"

namespace atlas {

constexpr int kMmaAttnRows = 64;
constexpr int kMmaAttnWarps = 4;
constexpr int kMmaAttnThreads = kMmaAttnWarps * kWarpSize;
constexpr int kMmaAttnKeys = 32;
constexpr int kMmaAttnPad = 8;  // bf16 per smem row
constexpr int kMmaAttnKeyTiles = kMmaAttnKeys / 8;  // n-tiles of the score fragment
constexpr float kLog2e = 1.4426950408889634f;

// Dynamic shared memory: 2 * (kMmaAttnRows + 2 * kMmaAttnKeys) * (D + kMmaAttnPad) bytes
// (D 256: 66 KiB, above the 48 KiB default; the wrapper opts in).
template <int D>
struct MmaAttnSmem {
  static constexpr int kStride = D + kMmaAttnPad;
  uint16_t q[kMmaAttnRows][kStride];
  uint16_t k[kMmaAttnKeys][kStride];
  uint16_t v[kMmaAttnKeys][kStride];
};

// One lane's part of its warp's 16 rows: rows lane/4 (half 0) and lane/4 + 8 (half 1).
template <int D>
struct MmaAttnRows {
  float o[D / 8][4];  // n-tile t: dims t*8 + 2*(lane%4) + {0,1}; [0,1] half 0, [2,3] half 1
  float m[2];         // running max of score * scale * log2 e (-inf: nothing visible yet)
  float l[2];         // this lane's share of the running sum
  int last_key[2];    // last visible key (-1: a row past the end)
};

struct MmaAttnRow {
  int token, head;
  bool valid;
};

// Block row r -> (token, q head); rows past tokens * G are not valid.
__device__ __forceinline__ MmaAttnRow mma_attn_row(const AttentionParams& p, int row) {
  const int group = p.q_heads / p.kv_heads;
  const bool valid = row < p.tokens * group;
  return {valid ? row / group : 0, static_cast<int>(blockIdx.y) * group + (valid ? row % group : 0), valid};
}

// The largest position + 1 of the block's rows (clamped to the cache) into *key_end (zeroed before).
__device__ __forceinline__ void mma_attn_key_end(const AttentionParams& p, int row0, int* key_end) {
  if (threadIdx.x < kMmaAttnRows) {
    const MmaAttnRow row = mma_attn_row(p, row0 + threadIdx.x);
    if (row.valid) {
      const int pos = static_cast<const int32_t*>(p.positions)[row.token];
      atomicMax(key_end, min(pos + 1, p.capacity));
    }
  }
}

// q rows row0.. -> bf16 smem (zeros past the end); mma_attn_key_end.
template <int D>
__device__ __forceinline__ void mma_attn_load_q(const AttentionParams& p, int row0, MmaAttnSmem<D>& s, int* key_end) {
  const float* q = static_cast<const float*>(p.q);
#pragma unroll 4
  for (int i = 0; i < kMmaAttnRows * D / 8 / kMmaAttnThreads; ++i) {
    const int c = threadIdx.x + i * kMmaAttnThreads;
    const int r = c / (D / 8);
    const int d = (c % (D / 8)) * 8;
    const MmaAttnRow row = mma_attn_row(p, row0 + r);
    float x[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = 0.0f;
    if (row.valid) load_f32<8>(q + (static_cast<int64_t>(row.token) * p.q_heads + row.head) * D + d, x);
    *reinterpret_cast<uint4*>(&s.q[r][d]) = make_uint4(pack_bf16x2(x[0], x[1]), pack_bf16x2(x[2], x[3]),
                                                        pack_bf16x2(x[4], x[5]), pack_bf16x2(x[6], x[7]));
  }
  mma_attn_key_end(p, row0, key_end);
}

// cp.async of cache keys key0 .. key0+31 of kv head hk (zero-filled from key_end on).
template <int D>
__device__ __forceinline__ void mma_attn_issue(const AttentionParams& p, const void* cache, int key0, int key_end,
                                               uint16_t (&tile)[kMmaAttnKeys][D + kMmaAttnPad]) {
  const uint16_t* base = static_cast<const uint16_t*>(cache);
#pragma unroll
  for (int i = 0; i < kMmaAttnKeys * D / 8 / kMmaAttnThreads; ++i) {
    const int c = threadIdx.x + i * kMmaAttnThreads;
    const int j = c / (D / 8);
    const int d = (c % (D / 8)) * 8;
    const bool valid = key0 + j < key_end;
    const uint16_t* src = valid ? base + (static_cast<int64_t>(key0 + j) * p.kv_heads + blockIdx.y) * D + d : base;
    cp_async_16(&tile[j][d], src, valid);
  }
}

// Where the K and V tiles come from: the bf16 cache, by cp.async (kv_quant_mma.cuh has the
// quantized levels). load_q fills the q tile and key_end, issue fills a K or V tile, leave runs on
// the stored output rows of each warp.
template <int D>
struct MmaBf16Kv {
  __device__ __forceinline__ void prepare() {}
  __device__ __forceinline__ void load_q(const AttentionParams& p, int row0, MmaAttnSmem<D>& s, int* key_end) const {
    mma_attn_load_q<D>(p, row0, s, key_end);
  }
  __device__ __forceinline__ void issue(const AttentionParams& p, const void* cache, int key0, int key_end,
                                        uint16_t (&tile)[kMmaAttnKeys][D + kMmaAttnPad]) const {
    mma_attn_issue<D>(p, cache, key0, key_end, tile);
  }
  __device__ __forceinline__ void leave(const AttentionParams&, int) const {}
};

template <int D>
__device__ __forceinline__ void mma_attn_init(const AttentionParams& p, int row0, int key_end, MmaAttnRows<D>& rows) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp_row = row0 + (threadIdx.x / kWarpSize) * 16 + lane / 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const MmaAttnRow row = mma_attn_row(p, warp_row + half * 8);
    const int pos = row.valid ? static_cast<const int32_t*>(p.positions)[row.token] : -1;
    rows.last_key[half] = min(pos, key_end - 1);
    rows.m[half] = -INFINITY;
    rows.l[half] = 0.0f;
  }
#pragma unroll
  for (int t = 0; t < D / 8; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) rows.o[t][e] = 0.0f;
}

// S [16 rows x 32 keys] of this warp = Q K^T; s[t][e]: row lane/4 + (e/2)*8, key t*8 + 2*(lane%4) + e%2.
template <int D>
__device__ __forceinline__ void mma_attn_scores(const MmaAttnSmem<D>& sm, float (&s)[kMmaAttnKeyTiles][4]) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
#pragma unroll
  for (int t = 0; t < kMmaAttnKeyTiles; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[t][e] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < D; ks += 16) {
    uint32_t a[4];
    ldmatrix_x4(a, &sm.q[warp * 16 + lane % 16][ks + (lane / 16) * 8]);
#pragma unroll
    for (int np = 0; np < kMmaAttnKeyTiles / 2; ++np) {
      uint32_t b[4];  // key tile 2np: {b[0], b[1]}, 2np+1: {b[2], b[3]}
      ldmatrix_x4(b, &sm.k[np * 16 + lane % 8 + (lane / 16) * 8][ks + ((lane / 8) % 2) * 8]);
      mma_bf16_16816(s[2 * np], a, b[0], b[1]);
      mma_bf16_16816(s[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// Online softmax of one tile's scores; leaves P (bf16) as the A fragments of the two 16-key steps.
template <int D>
__device__ __forceinline__ void mma_attn_softmax(float (&s)[kMmaAttnKeyTiles][4], int key0, float scale_log2,
                                                 MmaAttnRows<D>& rows, uint32_t (&pa)[kMmaAttnKeys / 16][4]) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mx = rows.m[half];
#pragma unroll
    for (int t = 0; t < kMmaAttnKeyTiles; ++t)
#pragma unroll
      for (int e = 2 * half; e < 2 * half + 2; ++e) {
        const int key = key0 + t * 8 + 2 * (lane % 4) + e % 2;
        s[t][e] = key <= rows.last_key[half] ? s[t][e] * scale_log2 : -INFINITY;
        mx = fmaxf(mx, s[t][e]);
      }
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
    const float base = mx == -INFINITY ? 0.0f : mx;  // no visible key yet: every term stays 0
    const float alpha = exp2f(rows.m[half] - base);
    rows.m[half] = mx;
    rows.l[half] *= alpha;
#pragma unroll
    for (int t = 0; t < D / 8; ++t) {
      rows.o[t][2 * half] *= alpha;
      rows.o[t][2 * half + 1] *= alpha;
    }
#pragma unroll
    for (int t = 0; t < kMmaAttnKeyTiles; ++t) {
      const uint32_t word = pack_bf16x2(exp2f(s[t][2 * half] - base), exp2f(s[t][2 * half + 1] - base));
      float lo, hi;
      unpack_bf16x2(word, lo, hi);
      rows.l[half] += lo + hi;
      pa[t / 2][(t % 2) * 2 + half] = word;  // A regs: {row g, k 0-7}, {g+8, 0-7}, {g, 8-15}, {g+8, 8-15}
    }
  }
}

// O [16 rows x D] += P [16 x 32] V [32 x D].
template <int D>
__device__ __forceinline__ void mma_attn_values(const MmaAttnSmem<D>& sm, const uint32_t (&pa)[kMmaAttnKeys / 16][4],
                                                MmaAttnRows<D>& rows) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int kk = 0; kk < kMmaAttnKeys / 16; ++kk)
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];  // dim tile 2dp: {b[0], b[1]}, 2dp+1: {b[2], b[3]}
      ldmatrix_x4_trans(b, &sm.v[kk * 16 + lane % 16][dp * 16 + (lane / 16) * 8]);
      mma_bf16_16816(rows.o[2 * dp], pa[kk], b[0], b[1]);
      mma_bf16_16816(rows.o[2 * dp + 1], pa[kk], b[2], b[3]);
    }
}

// Every valid row is written once: O / l (zeros when no key is visible).
template <int D>
__device__ __forceinline__ void mma_attn_store(const AttentionParams& p, int row0, MmaAttnRows<D>& rows) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp_row = row0 + (threadIdx.x / kWarpSize) * 16 + lane / 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float l = rows.l[half];
    l += __shfl_xor_sync(kFullMask, l, 1);
    l += __shfl_xor_sync(kFullMask, l, 2);
    const MmaAttnRow row = mma_attn_row(p, warp_row + half * 8);
    if (!row.valid) continue;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    float* out = static_cast<float*>(p.out) + (static_cast<int64_t>(row.token) * p.q_heads + row.head) * D + 2 * (lane % 4);
#pragma unroll
    for (int t = 0; t < D / 8; ++t)
      *reinterpret_cast<float2*>(out + t * 8) = make_float2(rows.o[t][2 * half] * inv, rows.o[t][2 * half + 1] * inv);
  }
}

template <int D, class Kv = MmaBf16Kv<D>>
__device__ void attention_prefill_mma(const AttentionParams& p) {
  static_assert(D % 32 == 0 && D <= 256, "attention_prefill_mma: head_dim must be a multiple of 32, at most 256");
  ATLAS_DYNAMIC_SMEM(uint8_t, attn_mma_smem);
  __shared__ int key_end_s;
  __shared__ Kv kv;
  MmaAttnSmem<D>& sm = *reinterpret_cast<MmaAttnSmem<D>*>(attn_mma_smem);
  if (p.head_dim != D || p.tokens <= 0 || p.ml != nullptr) return;
  const int row0 = (gridDim.x - 1 - blockIdx.x) * kMmaAttnRows;
  if (row0 >= p.tokens * (p.q_heads / p.kv_heads)) return;

  if (threadIdx.x == 0) key_end_s = 0;
  kv.prepare();
  __syncthreads();
  kv.load_q(p, row0, sm, &key_end_s);
  __syncthreads();
  const int key_end = key_end_s;
  kv.issue(p, p.k_cache, 0, key_end, sm.k);
  cp_async_commit();
  kv.issue(p, p.v_cache, 0, key_end, sm.v);
  cp_async_commit();

  MmaAttnRows<D> rows;
  mma_attn_init<D>(p, row0, key_end, rows);
  const float scale_log2 = p.scale * kLog2e;
  for (int key0 = 0; key0 < key_end; key0 += kMmaAttnKeys) {
    const int next = key0 + kMmaAttnKeys;
    cp_async_wait<1>();  // all but the newest group (this tile's V): this tile's K has landed
    __syncthreads();
    float s[kMmaAttnKeyTiles][4];
    mma_attn_scores<D>(sm, s);
    __syncthreads();  // every warp is done with this K tile
    if (next < key_end) kv.issue(p, p.k_cache, next, key_end, sm.k);
    cp_async_commit();
    uint32_t pa[kMmaAttnKeys / 16][4];
    mma_attn_softmax<D>(s, key0, scale_log2, rows, pa);
    cp_async_wait<1>();  // this tile's V has landed (the next K may still be in flight)
    __syncthreads();
    mma_attn_values<D>(sm, pa, rows);
    __syncthreads();  // every warp is done with this V tile
    if (next < key_end) kv.issue(p, p.v_cache, next, key_end, sm.v);
    cp_async_commit();
  }
  cp_async_wait<0>();
  mma_attn_store<D>(p, row0, rows);
  kv.leave(p, row0);
}

}  // namespace atlas
