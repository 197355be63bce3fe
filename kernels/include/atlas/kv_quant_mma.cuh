// Tensor-core prefill attention over a quantized KV cache (ATLAS_PREFILL_ATTENTION=mma with
// --kv-cache-dtype fp8 | nvfp4 | turbo8 | turbo4 | turbo3): attention_prefill_mma's pipeline and
// fragments (attention_mma.cuh) with KvqMmaKv as the source of its K and V tiles.
//   issue: each thread decodes runs of 8 dims of the tile's keys straight from the cache fields
//     (codes and the run's scale, kv_quant.cuh's decoding) and stores them as bf16, so the tile
//     the mma reads is the decoded cache rounded to bf16; keys from key_end on are zeros. The
//     stores are plain: the loop's barriers, placed for cp.async, also order them.
//   Turbo levels hold the rotated vectors y = WHT(x * signs): load_q rotates each q row the same
//     way (a warp per row, in f32, then bf16), the values accumulate in the rotated basis, and
//     leave un-rotates each stored output row (a warp per row of its own: WHT, then the signs).
#pragma once

#include "atlas/attention_mma.cuh"
#include "atlas/kv_quant.cuh"

namespace atlas {

constexpr int kKvqMmaRun = 8;  // dims decoded per step; a run lies in one scale group

// A run's code bytes in 32-bit words, read from the cache: aligned words where the run's bytes
// are whole aligned words (fp8, turbo8, nvfp4, turbo4), else byte by byte (turbo3: 3 bytes).
template <int Bytes>
struct KvqRunCodes {
  static constexpr int kWords = (Bytes + 3) / 4;
  uint32_t w[kWords];
  __device__ __forceinline__ void read(const uint8_t* src) {
    if constexpr (Bytes % 8 == 0) {
#pragma unroll
      for (int i = 0; i < kWords; i += 2) {
        const uint2 pair = reinterpret_cast<const uint2*>(src)[i / 2];
        w[i] = pair.x;
        w[i + 1] = pair.y;
      }
    } else if constexpr (Bytes % 4 == 0) {
#pragma unroll
      for (int i = 0; i < kWords; ++i) w[i] = reinterpret_cast<const uint32_t*>(src)[i];
    } else {
#pragma unroll
      for (int i = 0; i < kWords; ++i) w[i] = 0u;
#pragma unroll
      for (int b = 0; b < Bytes; ++b) w[b / 4] |= static_cast<uint32_t>(src[b]) << (8 * (b % 4));
    }
  }
  __device__ __forceinline__ uint32_t byte(int i) const { return (w[i / 4] >> (8 * (i % 4))) & 0xffu; }
};

template <KvLevel L, int D>
struct KvqMmaKv {
  using Layout = KvLayout<L, D>;
  static constexpr int P = D / kWarpSize;
  static constexpr int kRunBytes = Layout::kCodeBytes * kKvqMmaRun / D;
  static_assert(D == 64 || D == 128 || D == 256, "KvqMmaKv: head_dim must be 64, 128 or 256 (kv_wht's lanes)");
  float book[Layout::kBookSize > 0 ? Layout::kBookSize : 1];

  // Visible after the kernel's first barrier.
  __device__ __forceinline__ void prepare() {
    if constexpr (Layout::kBookSize > 0)
      if (threadIdx.x < Layout::kBookSize) book[threadIdx.x] = kv_book<L>(threadIdx.x);
  }

  __device__ __forceinline__ void load_q(const AttentionParams& p, int row0, MmaAttnSmem<D>& s, int* key_end) const {
    if constexpr (kv_rotated<L>()) {
      load_q_rotated(p, row0, s);
      mma_attn_key_end(p, row0, key_end);
    } else {
      mma_attn_load_q<D>(p, row0, s, key_end);
    }
  }

  // Keys key0 .. key0+31 of kv head blockIdx.y, decoded, as bf16 rows of `tile`.
  __device__ __forceinline__ void issue(const AttentionParams& p, const void* cache, int key0, int key_end,
                                        uint16_t (&tile)[kMmaAttnKeys][D + kMmaAttnPad]) const {
    constexpr int kRuns = kMmaAttnKeys * D / kKvqMmaRun;
    const KvRegions<L, D> r(const_cast<void*>(cache), p.capacity, p.kv_heads);
#pragma unroll 2
    for (int i = 0; i < kRuns / kMmaAttnThreads; ++i) {
      const int c = threadIdx.x + i * kMmaAttnThreads;
      const int j = c / (D / kKvqMmaRun);
      const int d = (c % (D / kKvqMmaRun)) * kKvqMmaRun;
      float x[kKvqMmaRun];
#pragma unroll
      for (int e = 0; e < kKvqMmaRun; ++e) x[e] = 0.0f;
      if (key0 + j < key_end) decode_run(r, (static_cast<int64_t>(key0 + j) * p.kv_heads + blockIdx.y), d, x);
      *reinterpret_cast<uint4*>(&tile[j][d]) = make_uint4(pack_bf16x2(x[0], x[1]), pack_bf16x2(x[2], x[3]),
                                                          pack_bf16x2(x[4], x[5]), pack_bf16x2(x[6], x[7]));
    }
  }

  // Each warp's stored rows (mma_attn_store: rows row0 + warp * 16 ..) back to the original basis.
  __device__ __forceinline__ void leave(const AttentionParams& p, int row0) const {
    if constexpr (kv_rotated<L>()) {
      __syncwarp();  // the warp's stores of its rows are visible to all its lanes
      const int lane = threadIdx.x % kWarpSize;
      const int first = row0 + (threadIdx.x / kWarpSize) * 16;
      for (int i = 0; i < 16; ++i) {
        const MmaAttnRow row = mma_attn_row(p, first + i);
        if (!row.valid) continue;  // warp-uniform
        float* out = static_cast<float*>(p.out) + (static_cast<int64_t>(row.token) * p.q_heads + row.head) * D + lane * P;
        float v[P];
        load_f32<P>(out, v);
        kv_wht<D>(v, lane);
        kv_flip_signs<D>(v, lane);
#pragma unroll
        for (int e = 0; e < P; e += 2) *reinterpret_cast<float2*>(out + e) = make_float2(v[e], v[e + 1]);
      }
    }
  }

 private:
  // Dims d .. d+7 of cache vector `vec` (key * kv_heads + head).
  __device__ __forceinline__ void decode_run(const KvRegions<L, D>& r, int64_t vec, int d, float (&x)[kKvqMmaRun]) const {
    KvqRunCodes<kRunBytes> codes;
    codes.read(r.codes + vec * Layout::kCodeBytes + d * Layout::kCodeBytes / D);
    const float scale = kv_group_scale<L, D>(r.group_scales + vec * Layout::kGroupScaleBytes,
                                             r.vector_scale + vec * Layout::kVectorScaleBytes, d);
    kv_decode_run<L, kKvqMmaRun>([&codes](int i) { return codes.byte(i); }, 0, scale, book, x);
  }

  // q rows row0.. rotated into the keys' basis, WHT(q * signs) in f32, then bf16 (zeros past the end).
  __device__ __forceinline__ static void load_q_rotated(const AttentionParams& p, int row0, MmaAttnSmem<D>& s) {
    const int lane = threadIdx.x % kWarpSize;
    for (int r = threadIdx.x / kWarpSize; r < kMmaAttnRows; r += kMmaAttnWarps) {
      const MmaAttnRow row = mma_attn_row(p, row0 + r);
      float x[P];
#pragma unroll
      for (int e = 0; e < P; ++e) x[e] = 0.0f;
      if (row.valid) load_f32<P>(static_cast<const float*>(p.q) + (static_cast<int64_t>(row.token) * p.q_heads + row.head) * D + lane * P, x);
      kv_flip_signs<D>(x, lane);
      kv_wht<D>(x, lane);
#pragma unroll
      for (int e = 0; e < P; e += 2) *reinterpret_cast<uint32_t*>(&s.q[r][lane * P + e]) = pack_bf16x2(x[e], x[e + 1]);
    }
  }
};

}  // namespace atlas
