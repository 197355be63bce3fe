// Quantized KV cache levels on the GPU (python/atlas/kvcache: the numpy reference and the layouts).
//
// Cache buffer of one K or V cache, [S, Hkv] head vectors, bytes: the level's fields one after the
// other, each [S, Hkv, field bytes] (exactly numpy's field arrays, in layout order):
//   codes [S, Hkv, kCodeBytes] | group scales [S, Hkv, kGroupScaleBytes] | fp32 scale [S, Hkv, 4]
// so the bytes of a GPU cache equal the concatenated bytes of the numpy encoder's fields.
//   kv_quant_write<L, D>: one warp per (k or v, token, kv head) vector; lane owns dims
//     lane*D/32 ..; encodes with numpy's exact arithmetic (same f32 operation order, IEEE
//     division and sqrt, no fused multiply-adds) so the stored bytes match bit for bit.
//   KvqTile<L, D>: the attention tile of a quantized cache (attention_block's Tile): stages the raw
//     codes and scales of 32 keys in shared memory and dequantizes a lane's dims in registers.
//     Turbo levels store y = WHT(x * signs); attention rotates q the same way (an orthonormal map
//     keeps <q, k>), accumulates the values in the rotated basis and un-rotates the output once.
#pragma once

#include <type_traits>

#include "atlas/attention.cuh"

namespace atlas {

enum class KvLevel : int { fp8, nvfp4, turbo8, turbo4, turbo3 };

template <KvLevel L>
__host__ __device__ constexpr bool kv_rotated() {
  return L == KvLevel::turbo8 || L == KvLevel::turbo4 || L == KvLevel::turbo3;
}

template <KvLevel L>
__host__ __device__ constexpr int kv_book_size() {
  return L == KvLevel::turbo4 ? 16 : L == KvLevel::turbo3 ? 8 : 0;
}

constexpr int kTurboGroup = 32;   // turbo.py TURBO_GROUP
constexpr int kKvNvfp4Group = 16; // plain.py NVFP4_GROUP

// Bytes per head vector of each field (level.py layouts).
template <KvLevel L, int D>
struct KvLayout {
  static constexpr int kCodeBytes = L == KvLevel::fp8 || L == KvLevel::turbo8 ? D
                                    : L == KvLevel::turbo3                   ? D * 3 / 8
                                                                             : D / 2;
  static constexpr int kGroupScaleBytes = L == KvLevel::fp8     ? 0
                                          : L == KvLevel::nvfp4 ? D / kKvNvfp4Group
                                                                : 2 * (D / kTurboGroup);
  static constexpr int kVectorScaleBytes = kv_rotated<L>() ? 0 : 4;
  static constexpr int kAuxBytes = kGroupScaleBytes + kVectorScaleBytes;
  static constexpr int kBookSize = kv_book_size<L>();
  static_assert(kCodeBytes % 4 == 0 && kAuxBytes % 4 == 0, "kv cache fields must be whole words");
};

// codebooks.py LLOYD_MAX_4BIT / LLOYD_MAX_3BIT as float32 (tests/test_kv_abi.py checks the values).
static __constant__ float kLloydMax4[16] = {
    -2.732589571f, -2.069017227f, -1.618046386f, -1.256231197f, -0.942340456f, -0.656759119f,
    -0.388048299f, -0.128395030f, 0.128395030f,  0.388048299f,  0.656759119f,  0.942340456f,
    1.256231197f,  1.618046386f,  2.069017227f,  2.732589571f};
static __constant__ float kLloydMax3[8] = {-2.151945705f, -1.343909279f, -0.756005281f, -0.245094179f,
                                           0.245094179f,  0.756005281f,  1.343909279f,  2.151945705f};

template <KvLevel L>
__device__ __forceinline__ float kv_book(int index) {
  return L == KvLevel::turbo4 ? kLloydMax4[index] : kLloydMax3[index];
}

// ---- element codes (codes.py) ------------------------------------------------------------------
__device__ __forceinline__ float kv_e4m3_to_f32(uint32_t code) {
  const uint32_t exponent = (code >> 3) & 15u, mantissa = code & 7u;
  const float magnitude = exponent == 0 ? static_cast<float>(mantissa) * 0.001953125f  // m * 2^-9
                                        : __uint_as_float(((exponent + 120u) << 23) | (mantissa << 20));
  return (code & 0x80u) ? -magnitude : magnitude;
}

__device__ __forceinline__ float kv_e2m1_to_f32(uint32_t code) {
  const uint32_t exponent = (code >> 1) & 3u, mantissa = code & 1u;
  const float magnitude = exponent == 0 ? 0.5f * static_cast<float>(mantissa)
                                        : __uint_as_float(((exponent + 126u) << 23) | (mantissa << 22));
  return (code & 8u) ? -magnitude : magnitude;
}

// Round to nearest even, saturating at 448; the sign bit of x (also of -0) is kept.
__device__ __forceinline__ uint32_t kv_f32_to_e4m3(float x) {
  const uint32_t sign = (__float_as_uint(x) >> 24) & 0x80u;
  const float a = fminf(fabsf(x), 448.0f);
  uint32_t magnitude;
  if (a < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9 (8 rounds up into code 8 = 2^-6)
    magnitude = static_cast<uint32_t>(__float2int_rn(__fmul_rn(a, 512.0f)));
  } else {
    const uint32_t bits = __float_as_uint(a);
    magnitude = ((bits + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20) - (120u << 3);
  }
  return sign | magnitude;
}

// Nearest e2m1 magnitude, ties to the even code, saturating at 6.
__device__ __forceinline__ uint32_t kv_f32_to_e2m1(float x) {
  const uint32_t sign = (__float_as_uint(x) >> 28) & 8u;
  const float a = fabsf(x);
  const uint32_t magnitude = a <= 0.25f ? 0u : a < 0.75f ? 1u : a <= 1.25f ? 2u : a < 1.75f ? 3u
                             : a <= 2.5f ? 4u : a < 3.5f ? 5u : a <= 5.0f ? 6u : 7u;
  return sign | magnitude;
}

// codes.py encode_codebook: nearest level (ties to the even index), saturating, in float64 as numpy.
template <KvLevel L>
__device__ __forceinline__ uint32_t kv_codebook_index(float x) {
  constexpr int n = kv_book_size<L>();
  const double first = kv_book<L>(0);
  const double m = fmin(fmax(static_cast<double>(x) - first, 0.0), static_cast<double>(kv_book<L>(n - 1)) - first);
  int upper = 1;
  while (upper < n - 1 && static_cast<double>(kv_book<L>(upper)) - first < m) ++upper;
  const double lo = static_cast<double>(kv_book<L>(upper - 1)) - first;
  const double hi = static_cast<double>(kv_book<L>(upper)) - first;
  const double below = m - lo, above = hi - m;
  const bool take_upper = above < below || (above == below && upper % 2 == 0);
  return static_cast<uint32_t>(take_upper ? upper : upper - 1);
}

// ---- the WHT rotation (hadamard.py) ------------------------------------------------------------
__device__ __forceinline__ bool kv_sign_flipped(uint32_t i) {
  uint32_t h = i;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return (h & 1u) != 0;
}

template <int D>
__device__ __forceinline__ void kv_flip_signs(float (&v)[D / kWarpSize], int lane) {
#pragma unroll
  for (int e = 0; e < D / kWarpSize; ++e)
    if (kv_sign_flipped(static_cast<uint32_t>(lane * (D / kWarpSize) + e))) v[e] = -v[e];
}

// Normalised WHT of the warp's vector (lane owns dims lane*P .. lane*P+P-1): natural-order
// butterflies with stride 1, 2, 4, ... (a + b low, a - b high; in-lane strides first, then across
// lanes), then one multiply by 1/sqrt(D). The same float operations as numpy, in the same order.
template <int D>
__device__ __forceinline__ void kv_wht(float (&v)[D / kWarpSize], int lane) {
  constexpr int P = D / kWarpSize;
#pragma unroll
  for (int half = 1; half < P; half *= 2) {
#pragma unroll
    for (int e = 0; e < P; ++e) {
      if (e & half) continue;
      const float a = v[e], b = v[e + half];
      v[e] = __fadd_rn(a, b);
      v[e + half] = __fsub_rn(a, b);
    }
  }
#pragma unroll
  for (int lane_bit = 1; lane_bit < kWarpSize; lane_bit *= 2) {
    const bool high = (lane & lane_bit) != 0;
#pragma unroll
    for (int e = 0; e < P; ++e) {
      const float other = __shfl_xor_sync(kFullMask, v[e], lane_bit);
      v[e] = high ? __fsub_rn(other, v[e]) : __fadd_rn(v[e], other);
    }
  }
  const float norm = static_cast<float>(1.0 / sqrt(static_cast<double>(D)));
#pragma unroll
  for (int e = 0; e < P; ++e) v[e] = __fmul_rn(v[e], norm);
}

// ---- decoding ------------------------------------------------------------------------------------
// The scale of the group that holds dim `first` of a vector, from its fields (group_scales and
// vector_scale point at this vector's bytes of each).
template <KvLevel L, int D>
__device__ __forceinline__ float kv_group_scale(const uint8_t* group_scales, const uint8_t* vector_scale, int first) {
  if constexpr (L == KvLevel::fp8) {
    return *reinterpret_cast<const float*>(vector_scale);
  } else if constexpr (L == KvLevel::nvfp4) {
    return kv_e4m3_to_f32(group_scales[first / kKvNvfp4Group]) * *reinterpret_cast<const float*>(vector_scale);
  } else {
    return bf16_to_f32(reinterpret_cast<const uint16_t*>(group_scales)[first / kTurboGroup]);
  }
}

// Dims first .. first+N-1 of a vector (one scale group), as stored times `scale`. bytes(i) is the
// vector's code byte i (from shared memory, or from registers holding a run's bytes).
template <KvLevel L, int N, class Bytes>
__device__ __forceinline__ void kv_decode_run(Bytes bytes, int first, float scale, const float* book, float (&out)[N]) {
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const int i = first + e;
    float value;
    if constexpr (L == KvLevel::fp8 || L == KvLevel::turbo8) {
      value = kv_e4m3_to_f32(bytes(i));
    } else if constexpr (L == KvLevel::nvfp4) {
      value = kv_e2m1_to_f32((bytes(i / 2) >> (4 * (i & 1))) & 15u);
    } else if constexpr (L == KvLevel::turbo4) {
      value = book[(bytes(i / 2) >> (4 * (i & 1))) & 15u];
    } else {
      const int word = (i / 8) * 3;
      const uint32_t bits = bytes(word) | (bytes(word + 1) << 8) | (bytes(word + 2) << 16);
      value = book[(bits >> (3 * (i % 8))) & 7u];
    }
    out[e] = value * scale;
  }
}

// ---- the cache buffer ----------------------------------------------------------------------------
template <KvLevel L, int D>
struct KvRegions {
  using Layout = KvLayout<L, D>;
  uint8_t* codes;
  uint8_t* group_scales;
  uint8_t* vector_scale;
  __device__ KvRegions(void* cache, int capacity, int kv_heads) {
    const int64_t vectors = static_cast<int64_t>(capacity) * kv_heads;
    codes = static_cast<uint8_t*>(cache);
    group_scales = codes + vectors * Layout::kCodeBytes;
    vector_scale = group_scales + vectors * Layout::kGroupScaleBytes;
  }
};

// ---- the writer ----------------------------------------------------------------------------------
constexpr int kKvWriteWarps = 4;  // ops_kv.py KV_WRITE_THREADS = 32 * this

template <int D>
struct KvWriteScratch {
  float values[D];          // the (rotated) vector
  uint8_t codes[D];         // one code per element before packing
  float group_scale[D / 16];  // decoded scale of each group
};

// numpy's float32 sum of 32 values (pairwise_sum: 8 strided accumulators, then a fixed tree).
__device__ __forceinline__ float kv_numpy_sum32(const float* x) {
  float r[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) r[j] = x[j];
#pragma unroll
  for (int i = 8; i < 32; i += 8)
#pragma unroll
    for (int j = 0; j < 8; ++j) r[j] = __fadd_rn(r[j], x[i + j]);
  return __fadd_rn(__fadd_rn(__fadd_rn(r[0], r[1]), __fadd_rn(r[2], r[3])),
                   __fadd_rn(__fadd_rn(r[4], r[5]), __fadd_rn(r[6], r[7])));
}

// Max |x| over aligned groups of `Lanes` lanes (a power of two <= 32).
template <int Lanes>
__device__ __forceinline__ float kv_group_max(float value) {
#pragma unroll
  for (int offset = Lanes / 2; offset > 0; offset /= 2)
    value = fmaxf(value, __shfl_xor_sync(kFullMask, value, offset));
  return value;
}

__device__ __forceinline__ float kv_safe_divide(float x, float scale) {
  return scale != 0.0f ? __fdiv_rn(x, scale) : 0.0f;
}

// Writes each element's code into s.codes and the scale fields of vector `vec` (lane-parallel).
template <KvLevel L, int D>
__device__ __forceinline__ void kv_encode_plain(const float (&x)[D / kWarpSize], int lane, KvWriteScratch<D>& s,
                                                const KvRegions<L, D>& out, int64_t vec) {
  constexpr int P = D / kWarpSize;
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < P; ++e) amax = fmaxf(amax, fabsf(x[e]));
  if constexpr (L == KvLevel::fp8) {
    const float scale = __fdiv_rn(warp_max(amax), 448.0f);
#pragma unroll
    for (int e = 0; e < P; ++e) s.codes[lane * P + e] = static_cast<uint8_t>(kv_f32_to_e4m3(kv_safe_divide(x[e], scale)));
    if (lane == 0) reinterpret_cast<float*>(out.vector_scale)[vec] = scale;
  } else {
    static_assert(kKvNvfp4Group % P == 0, "an nvfp4 group spans whole lanes");
    const float scale = __fdiv_rn(warp_max(amax), 2688.0f);  // 6 * 448
    const float group_amax = kv_group_max<kKvNvfp4Group / P>(amax);
    const uint32_t group_code = kv_f32_to_e4m3(kv_safe_divide(__fdiv_rn(group_amax, 6.0f), scale));
    const float effective = __fmul_rn(kv_e4m3_to_f32(group_code), scale);
#pragma unroll
    for (int e = 0; e < P; ++e) s.codes[lane * P + e] = static_cast<uint8_t>(kv_f32_to_e2m1(kv_safe_divide(x[e], effective)));
    const int group = lane * P / kKvNvfp4Group;
    if ((lane * P) % kKvNvfp4Group == 0) out.group_scales[vec * (D / kKvNvfp4Group) + group] = static_cast<uint8_t>(group_code);
    if (lane == 0) reinterpret_cast<float*>(out.vector_scale)[vec] = scale;
  }
}

template <KvLevel L, int D>
__device__ __forceinline__ void kv_encode_turbo(float (&y)[D / kWarpSize], int lane, KvWriteScratch<D>& s,
                                                const KvRegions<L, D>& out, int64_t vec) {
  constexpr int P = D / kWarpSize;
  constexpr int kGroups = D / kTurboGroup;
  static_assert(kTurboGroup % P == 0, "a turbo group spans whole lanes");
  kv_flip_signs<D>(y, lane);
  kv_wht<D>(y, lane);
#pragma unroll
  for (int e = 0; e < P; ++e) s.values[lane * P + e] = y[e];
  __syncwarp();
  if (lane < kGroups) {
    const float* g = &s.values[lane * kTurboGroup];
    float statistic;
    if constexpr (L == KvLevel::turbo8) {
      statistic = 0.0f;
      for (int i = 0; i < kTurboGroup; ++i) statistic = fmaxf(statistic, fabsf(g[i]));
      statistic = __fdiv_rn(statistic, 448.0f);
    } else {
      float squares[kTurboGroup];
#pragma unroll
      for (int i = 0; i < kTurboGroup; ++i) squares[i] = __fmul_rn(g[i], g[i]);
      statistic = __fsqrt_rn(__fdiv_rn(kv_numpy_sum32(squares), 32.0f));
    }
    const uint16_t bits = f32_to_bf16(statistic);
    reinterpret_cast<uint16_t*>(out.group_scales)[vec * kGroups + lane] = bits;
    s.group_scale[lane] = bf16_to_f32(bits);
  }
  __syncwarp();
  const float scale = s.group_scale[lane * P / kTurboGroup];
#pragma unroll
  for (int e = 0; e < P; ++e) {
    const float normed = kv_safe_divide(y[e], scale);
    if constexpr (L == KvLevel::turbo8) {
      s.codes[lane * P + e] = static_cast<uint8_t>(kv_f32_to_e4m3(normed));
    } else {
      s.codes[lane * P + e] = static_cast<uint8_t>(kv_codebook_index<L>(normed));
    }
  }
}

// Packs s.codes into the level's code bytes (packing.py) and stores them.
template <KvLevel L, int D>
__device__ __forceinline__ void kv_store_codes(const KvWriteScratch<D>& s, int lane, uint8_t* dst) {
  constexpr int kBytes = KvLayout<L, D>::kCodeBytes;
  for (int b = lane; b < kBytes; b += kWarpSize) {
    uint32_t byte;
    if constexpr (L == KvLevel::fp8 || L == KvLevel::turbo8) {
      byte = s.codes[b];
    } else if constexpr (L == KvLevel::turbo3) {
      const int word = b / 3;
      uint32_t bits = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) bits |= static_cast<uint32_t>(s.codes[word * 8 + j]) << (3 * j);
      byte = (bits >> (8 * (b % 3))) & 0xFFu;
    } else {
      byte = s.codes[2 * b] | (static_cast<uint32_t>(s.codes[2 * b + 1]) << 4);
    }
    dst[b] = static_cast<uint8_t>(byte);
  }
}

template <KvLevel L, int D>
__device__ void kv_quant_write(const KvCacheWriteParams& p) {
  constexpr int P = D / kWarpSize;
  __shared__ KvWriteScratch<D> scratch[kKvWriteWarps];
  if (p.head_dim != D) return;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t per_cache = static_cast<int64_t>(p.tokens) * p.kv_heads;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * kKvWriteWarps + warp;  // [2, T, Hkv]
  if (index >= 2 * per_cache) return;
  const bool is_v = index >= per_cache;
  const int64_t row = is_v ? index - per_cache : index;
  const int token = static_cast<int>(row / p.kv_heads), head = static_cast<int>(row % p.kv_heads);
  const int pos = static_cast<const int32_t*>(p.positions)[token];
  if (pos < 0 || pos >= p.capacity) return;
  float x[P];
  load_f32<P>(static_cast<const float*>(is_v ? p.v : p.k) + row * D + lane * P, x);
  const KvRegions<L, D> out(is_v ? p.v_cache : p.k_cache, p.capacity, p.kv_heads);
  const int64_t vec = static_cast<int64_t>(pos) * p.kv_heads + head;
  KvWriteScratch<D>& s = scratch[warp];
  if constexpr (kv_rotated<L>()) {
    kv_encode_turbo<L, D>(x, lane, s, out, vec);
  } else {
    kv_encode_plain<L, D>(x, lane, s, out, vec);
  }
  __syncwarp();
  kv_store_codes<L, D>(s, lane, out.codes + vec * KvLayout<L, D>::kCodeBytes);
}

// ---- the attention tile --------------------------------------------------------------------------
// Copies one field of 32 keys into rows of `row_bytes` in shared memory (zeros past key_end), in
// 16-byte chunks when the field allows, else 4-byte words.
template <int FieldBytes, int RowBytes>
__device__ __forceinline__ void kv_stage_field(const uint8_t* region, int kv_heads, int hk, int key0, int key_end,
                                               uint8_t* dst) {
  using Chunk = std::conditional_t<FieldBytes % 16 == 0 && RowBytes % 16 == 0, uint4, uint32_t>;
  constexpr int kPerKey = FieldBytes / static_cast<int>(sizeof(Chunk));
  for (int c = threadIdx.x; c < kAttnKeys * kPerKey; c += blockDim.x) {
    const int j = c / kPerKey, w = c % kPerKey;
    const int key = key0 + j;
    Chunk value{};
    if (key < key_end) value = reinterpret_cast<const Chunk*>(region + (static_cast<int64_t>(key) * kv_heads + hk) * FieldBytes)[w];
    reinterpret_cast<Chunk*>(dst + j * RowBytes)[w] = value;
  }
}

template <KvLevel L, int D>
struct KvqSide {
  using Layout = KvLayout<L, D>;
  __align__(16) uint8_t codes[kAttnKeys][Layout::kCodeBytes];
  __align__(16) uint8_t aux[kAttnKeys][Layout::kAuxBytes];  // group scales, then the fp32 scale

  __device__ __forceinline__ void load(void* cache, const AttentionParams& p, int hk, int key0, int key_end) {
    const KvRegions<L, D> r(cache, p.capacity, p.kv_heads);
    kv_stage_field<Layout::kCodeBytes, Layout::kCodeBytes>(r.codes, p.kv_heads, hk, key0, key_end, &codes[0][0]);
    if constexpr (Layout::kGroupScaleBytes > 0)
      kv_stage_field<Layout::kGroupScaleBytes, Layout::kAuxBytes>(r.group_scales, p.kv_heads, hk, key0, key_end, &aux[0][0]);
    if constexpr (Layout::kVectorScaleBytes > 0)
      kv_stage_field<4, Layout::kAuxBytes>(r.vector_scale, p.kv_heads, hk, key0, key_end, &aux[0][Layout::kGroupScaleBytes]);
  }
};

template <KvLevel L, int D>
struct KvqTile {
  using Layout = KvLayout<L, D>;
  static constexpr int P = D / kWarpSize;
  KvqSide<L, D> k;
  KvqSide<L, D> v;
  float book[Layout::kBookSize > 0 ? Layout::kBookSize : 1];

  __device__ void load(const AttentionParams& p, int hk, int key0, int key_end) {
    k.load(p.k_cache, p, hk, key0, key_end);
    v.load(p.v_cache, p, hk, key0, key_end);
    if constexpr (Layout::kBookSize > 0)
      if (threadIdx.x < Layout::kBookSize) book[threadIdx.x] = kv_book<L>(threadIdx.x);
  }

  // Lane's dims of vector j as stored (the rotated basis for the turbo levels). A lane's D/32
  // dims lie in one scale group (groups of 16 or 32 values, D/32 <= 8), so one scale per lane.
  __device__ __forceinline__ void decode(const KvqSide<L, D>& side, int j, int lane, float (&out)[P]) const {
    static_assert(P <= kKvNvfp4Group, "a lane's dims must share one scale group");
    const uint8_t* codes = side.codes[j];
    const uint8_t* aux = side.aux[j];
    const int first = lane * P;
    const float scale = kv_group_scale<L, D>(aux, aux + Layout::kGroupScaleBytes, first);
    kv_decode_run<L, P>([codes](int i) -> uint32_t { return codes[i]; }, first, scale, book, out);
  }
  __device__ __forceinline__ void key(int j, int lane, float (&out)[P]) const { decode(k, j, lane, out); }
  __device__ __forceinline__ void value(int j, int lane, float (&out)[P]) const { decode(v, j, lane, out); }

  // q into the keys' basis: WHT(q * signs). Values were accumulated there: out = WHT(acc) * signs.
  template <int R>
  __device__ __forceinline__ static void enter(AttnRows<D, R>& rows) {
    if constexpr (kv_rotated<L>()) {
      const int lane = threadIdx.x % kWarpSize;
#pragma unroll
      for (int i = 0; i < R; ++i) {
        kv_flip_signs<D>(rows.q[i], lane);
        kv_wht<D>(rows.q[i], lane);
      }
    }
  }
  template <int R>
  __device__ __forceinline__ static void leave(AttnRows<D, R>& rows) {
    if constexpr (kv_rotated<L>()) {
      const int lane = threadIdx.x % kWarpSize;
#pragma unroll
      for (int i = 0; i < R; ++i) {
        kv_wht<D>(rows.acc[i], lane);
        kv_flip_signs<D>(rows.acc[i], lane);
      }
    }
  }
};

}  // namespace atlas
