// Dequantization primitives of the fp8 (block 128x128 e4m3) and nvfp4 (e2m1, group 16, e4m3 group
// scale, f32 per-tensor scale) weight formats, shared by the quantized GEMV, GEMM and MoE kernels.
//
// Both formats are read in chunks of 16 consecutive K elements of one weight row, each chunk under
// one scale: fp8 chunk = 16 bytes (the 128-column scale block holds 8 chunks); nvfp4 chunk = 8 bytes
// (16 nibbles, element 2i in the low nibble of byte i) and exactly one e4m3 group scale. A chunk
// decodes into 16 f32 `raw` values; raw * chunk scale = the weight without its row scale (the nvfp4
// per-tensor weight_scale_2, kept per row so stacked experts and fused tensors can differ), which
// the kernels apply to whole dot products.
//
// Device layout (written by backends/cuda/ops_quant.py): q [rows, k] (fp8) or [rows, k / 2]
// (nvfp4); scale f32 [rows, ceil(k / 128)] (fp8: the checkpoint's 128x128 block scales repeated
// per row, so any row slicing or expert stacking keeps its scales) or e4m3 [rows, k / 16] (nvfp4);
// row_scale f32 [rows] or NULL (= 1).
//
// Decoding goes through f16, whose exponent bias keeps every code exact:
//   e4m3: cvt.rn.f16x2.e4m3x2 on sm_89+; before that, the 7 magnitude bits placed at f16 bit 7
//         (exponent field 0eeee) give value * 2^-8 for normals and subnormals alike, then * 2^8;
//         e4m3 has no infinities, so magnitude 0x7f (which that reads as 480) is set to NaN apart.
//   e2m1: the 3 magnitude bits placed at f16 bit 9 give value * 2^-14 (subnormal for code 1);
//         chunk scales carry the 2^14 back, so raw values are e2m1 * 2^-14.
// No table lookups: a per-lane table index would serialise constant-memory reads or spill a
// register array to local memory.
#pragma once

#include <cuda_fp16.h>

#include "atlas/common.cuh"

namespace atlas::quant {

constexpr int kChunk = 16;           // K elements per chunk (one scale)
constexpr int kFp8Block = 128;       // fp8 scale block edge (rows and columns)
constexpr int kNvfp4Group = 16;      // nvfp4 elements per e4m3 group scale
constexpr float kE2m1RawScale = 16384.0f;  // 2^14: e2m1 raw values are value / 2^14

__device__ __forceinline__ void half2_to_f32(uint32_t h2, float& lo, float& hi) {
  const __half2 h = *reinterpret_cast<const __half2*>(&h2);
  lo = __low2float(h);
  hi = __high2float(h);
}

// Two e4m3 bytes (lo byte = first element) -> f16x2 of their exact values.
__device__ __forceinline__ uint32_t e4m3x2_to_half2(uint16_t pair) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t out;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(pair));
  return out;
#else
  const uint32_t w = static_cast<uint32_t>(pair & 0xffu) | (static_cast<uint32_t>(pair >> 8) << 16);
  const uint32_t bits = ((w & 0x007f007fu) << 7) | ((w & 0x00800080u) << 8);  // value * 2^-8
  const __half2 scaled = __hmul2(*reinterpret_cast<const __half2*>(&bits), __float2half2_rn(256.0f));
  const uint32_t nan_lo = (pair & 0x007fu) == 0x007fu ? 0x0000ffffu : 0u;  // f16 0xffff: NaN
  const uint32_t nan_hi = (pair & 0x7f00u) == 0x7f00u ? 0xffff0000u : 0u;
  return *reinterpret_cast<const uint32_t*>(&scaled) | nan_lo | nan_hi;
#endif
}

__device__ __forceinline__ float e4m3_to_f32(uint8_t code) {
  float lo;
  float hi;
  half2_to_f32(e4m3x2_to_half2(code), lo, hi);
  return lo;
}

// Four e4m3 (bytes of w, byte 0 first) -> f32.
__device__ __forceinline__ void e4m3x4_to_f32(uint32_t w, float* out) {
  half2_to_f32(e4m3x2_to_half2(static_cast<uint16_t>(w & 0xffffu)), out[0], out[1]);
  half2_to_f32(e4m3x2_to_half2(static_cast<uint16_t>(w >> 16)), out[2], out[3]);
}

// Eight e2m1 nibbles of w (nibble j = element j) -> raw f32 (value * 2^-14). f16 pair j holds
// nibbles j (low half) and j + 4 (high half): one shift lines both up.
__device__ __forceinline__ void e2m1x8_to_raw_f32(uint32_t w, float* out) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int mag_shift = 9 - 4 * j;   // nibble bits 4j..4j+2 -> f16 bits 9..11
    const int sign_shift = 12 - 4 * j;  // nibble bit 4j+3 -> f16 bit 15
    const uint32_t mag = mag_shift >= 0 ? w << mag_shift : w >> -mag_shift;
    const uint32_t bits = (mag & 0x0e000e00u) | ((w << sign_shift) & 0x80008000u);
    half2_to_f32(bits, out[j], out[j + 4]);
  }
}

// --- formats: where a chunk lives and how it decodes --------------------------------------------

// A weight matrix [rows, k] in one of the formats (rows = N, or E * N for stacked experts).
struct QuantMatrix {  // 16-byte aligned base pointers
  const uint8_t* q;      // fp8: [rows, k] bytes; nvfp4: [rows, k / 2]
  const void* scale;     // fp8: f32 [rows, ceil(k / 128)]; nvfp4: e4m3 [rows, k / 16]
  int k;
};

struct Fp8Chunk {
  uint4 q;
  float scale;
};

struct Nvfp4Chunk {
  uint2 q;
  uint32_t scale_code;
};

struct Fp8Format {
  using Chunk = Fp8Chunk;
  static constexpr int kBytesPerChunk = 16;

  // Chunk c (elements 16c .. 16c+15) of row `row`; k % 16 == 0.
  __device__ static __forceinline__ Chunk load(const QuantMatrix& m, int64_t row, int c) {
    const int64_t blocks_per_row = ceil_div(m.k, kFp8Block);
    const float* scale = static_cast<const float*>(m.scale);
    Chunk chunk;
    chunk.q = __ldg(reinterpret_cast<const uint4*>(m.q + row * m.k + static_cast<int64_t>(c) * kChunk));
    chunk.scale = __ldg(scale + row * blocks_per_row + c * kChunk / kFp8Block);
    return chunk;
  }

  __device__ static __forceinline__ Chunk zero() { return Chunk{make_uint4(0u, 0u, 0u, 0u), 0.0f}; }

  __device__ static __forceinline__ void decode(const Chunk& chunk, float (&raw)[kChunk]) {
    e4m3x4_to_f32(chunk.q.x, raw);
    e4m3x4_to_f32(chunk.q.y, raw + 4);
    e4m3x4_to_f32(chunk.q.z, raw + 8);
    e4m3x4_to_f32(chunk.q.w, raw + 12);
  }

  __device__ static __forceinline__ float scale(const Chunk& chunk) { return chunk.scale; }
};

struct Nvfp4Format {
  using Chunk = Nvfp4Chunk;
  static constexpr int kBytesPerChunk = 8;

  // Chunk c of row `row`; k % 16 == 0.
  __device__ static __forceinline__ Chunk load(const QuantMatrix& m, int64_t row, int c) {
    const uint8_t* scale = static_cast<const uint8_t*>(m.scale);
    Chunk chunk;
    chunk.q = __ldg(reinterpret_cast<const uint2*>(m.q + row * (m.k / 2) + static_cast<int64_t>(c) * kBytesPerChunk));
    chunk.scale_code = __ldg(scale + row * (m.k / kNvfp4Group) + c);
    return chunk;
  }

  __device__ static __forceinline__ Chunk zero() { return Chunk{make_uint2(0u, 0u), 0u}; }

  __device__ static __forceinline__ void decode(const Chunk& chunk, float (&raw)[kChunk]) {
    e2m1x8_to_raw_f32(chunk.q.x, raw);
    e2m1x8_to_raw_f32(chunk.q.y, raw + 8);
  }

  __device__ static __forceinline__ float scale(const Chunk& chunk) {
    return e4m3_to_f32(static_cast<uint8_t>(chunk.scale_code)) * kE2m1RawScale;
  }
};

// The chunk's 16 weights (without the per-tensor scale) as 8 bf16x2 words, in element order.
template <class Format>
__device__ __forceinline__ void dequant_bf16(const typename Format::Chunk& chunk, uint32_t (&out)[kChunk / 2]) {
  float raw[kChunk];
  Format::decode(chunk, raw);
  const float s = Format::scale(chunk);
#pragma unroll
  for (int i = 0; i < kChunk / 2; ++i) out[i] = pack_bf16x2(raw[2 * i] * s, raw[2 * i + 1] * s);
}

}  // namespace atlas::quant

namespace atlas::quant {

__device__ __forceinline__ float row_scale_at(const void* row_scale, int64_t row) {
  return row_scale == nullptr ? 1.0f : __ldg(static_cast<const float*>(row_scale) + row);
}

}  // namespace atlas::quant
