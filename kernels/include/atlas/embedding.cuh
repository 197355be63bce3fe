// Embedding lookup: out[t, :] = table[ids[t], :] as f32. Grid (tokens), any block size (x32).
// The id is read from device memory so the decode graph's greedy chain (argmax -> ids) stays valid.
#pragma once

#include "atlas/common.cuh"

namespace atlas {

template <typename Elem>
__device__ __forceinline__ float to_f32(Elem value);
template <>
__device__ __forceinline__ float to_f32<uint16_t>(uint16_t value) { return bf16_to_f32(value); }
template <>
__device__ __forceinline__ float to_f32<float>(float value) { return value; }

// Elem = uint16_t (bf16 bits) or float. Rows whose id is outside [0, vocab) come out as zeros.
template <typename Elem>
__device__ void embedding(const EmbeddingParams& p) {
  const int t = blockIdx.x;
  if (t >= p.tokens) return;
  const int id = static_cast<const int32_t*>(p.ids)[t];
  const bool valid = id >= 0 && id < p.vocab;
  const Elem* row = static_cast<const Elem*>(p.table) + static_cast<int64_t>(valid ? id : 0) * p.hidden;
  float* out = static_cast<float*>(p.out) + static_cast<int64_t>(t) * p.hidden;
  constexpr int kVec = 4;  // 4 elements: 8 (bf16) or 16 (f32) bytes per load, 16-byte stores
  const bool vectorised = p.hidden % kVec == 0;
  if (vectorised) {
    for (int c = threadIdx.x; c < p.hidden / kVec; c += blockDim.x) {
      float v[kVec];
      if constexpr (sizeof(Elem) == 2) {
        load_bf16<kVec>(reinterpret_cast<const uint16_t*>(row) + c * kVec, v);
      } else {
        load_f32<kVec>(reinterpret_cast<const float*>(row) + c * kVec, v);
      }
      const float4 packed = valid ? make_float4(v[0], v[1], v[2], v[3]) : make_float4(0.f, 0.f, 0.f, 0.f);
      reinterpret_cast<float4*>(out)[c] = packed;
    }
  } else {
    for (int c = threadIdx.x; c < p.hidden; c += blockDim.x)
      out[c] = valid ? to_f32<Elem>(row[c]) : 0.0f;
  }
}

}  // namespace atlas
