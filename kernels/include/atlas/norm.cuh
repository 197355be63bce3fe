// RMSNorm over the last dim, optionally fused with the residual add. One block per row.
//   rms_norm:      out = x * rsqrt(mean(x^2) + eps) * weight
//   add_rms_norm:  sum_out = x + residual; out = rms_norm(sum_out) * weight
// Decode runs one row per launch on the critical path between two GEMVs, so the row's latency is
// what counts: when dim % 4 == 0, every pointer is 16-byte aligned and the row fits in
// kNormVecs float4 per thread, each thread issues all its loads at once and keeps its slice in
// registers for the second pass. A loop of load-then-store over the row would wait one memory
// round trip per iteration: the compiler may not move a load above a store to a pointer it might
// alias. Other rows take that loop. stage_add_rms_norm: the same row code run inside a decode
// GEMV or router block that takes the norm in (ATLAS_NORM=fused), its output staged for the block.
#pragma once

#include "atlas/common.cuh"

namespace atlas {

constexpr int kNormVecs = 4;  // float4 per thread in registers: rows up to 16 x blockDim floats
// 512, not 1024: the registers held (two float4 arrays) spill at 64 per thread on sm_121a.
constexpr int kNormMaxThreads = 512;

__device__ __forceinline__ bool norm_fits_registers(const RmsNormParams& p) {
  const uintptr_t pointers = reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.residual) |
                             reinterpret_cast<uintptr_t>(p.sum_out) | reinterpret_cast<uintptr_t>(p.weight) |
                             reinterpret_cast<uintptr_t>(p.out);
  return p.dim % 4 == 0 && (pointers & 15u) == 0 && p.dim <= 4 * kNormVecs * static_cast<int>(blockDim.x);
}

__device__ __forceinline__ float4 load_vec(const void* base, int64_t vec) {
  return static_cast<const float4*>(base)[vec];
}

__device__ __forceinline__ void store_vec(void* base, int64_t vec, float4 value) {
  static_cast<float4*>(base)[vec] = value;
}

__device__ __forceinline__ float4 add4(float4 a, float4 b) { return {a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w}; }

__device__ __forceinline__ float squares4(float4 a) { return a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w; }

__device__ __forceinline__ float4 normed4(float4 a, float4 g, float inv_rms) {
  return {a.x * inv_rms * g.x, a.y * inv_rms * g.y, a.z * inv_rms * g.z, a.w * inv_rms * g.w};
}

// The row starting at float4 vec0 in registers, as thread threadIdx.x holds it: v[j] = x (+ residual)
// and w[j] = weight at float4 threadIdx.x + j * blockDim.x (stored to sum_out when store_sum).
// Returns the row's inv_rms. Every thread of the block calls it (block_sum's barriers). kVecs:
// kNormVecs in the norm kernel; fewer where the row's length is known, the same bits (the float4
// past the row are skipped either way).
template <bool kAddResidual, int kVecs>
__device__ __forceinline__ float load_norm_row(const RmsNormParams& p, int64_t vec0, float4 (&v)[kVecs],
                                               float4 (&w)[kVecs], bool store_sum, float* scratch) {
  const int vecs = p.dim / 4;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {  // loads only: all in flight together
    const int i = threadIdx.x + j * blockDim.x;
    if (i >= vecs) continue;
    v[j] = load_vec(p.x, vec0 + i);
    if constexpr (kAddResidual) v[j] = add4(v[j], load_vec(p.residual, vec0 + i));
    w[j] = load_vec(p.weight, i);
  }
  float squares = 0.0f;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i >= vecs) continue;
    if (kAddResidual && store_sum) store_vec(p.sum_out, vec0 + i, v[j]);
    squares += squares4(v[j]);
  }
  return rsqrtf(block_sum(squares, scratch) / static_cast<float>(p.dim) + p.eps);
}

template <bool kAddResidual>
__device__ void rms_norm_row_in_registers(const RmsNormParams& p, int64_t base, float* scratch) {
  const int64_t vec0 = base / 4;
  float4 v[kNormVecs];
  float4 w[kNormVecs];
  const float inv_rms = load_norm_row<kAddResidual, kNormVecs>(p, vec0, v, w, true, scratch);
#pragma unroll
  for (int j = 0; j < kNormVecs; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < p.dim / 4) store_vec(p.out, vec0 + i, normed4(v[j], w[j], inv_rms));
  }
}

// Two passes over the row: the second re-reads what this same thread read/wrote in the first
// (the same index set), so no extra barrier is needed between them.
template <bool kAddResidual>
__device__ void rms_norm_row_looped(const RmsNormParams& p, int64_t base, float* scratch) {
  const float* x = static_cast<const float*>(p.x) + base;
  const float* residual = static_cast<const float*>(p.residual) + base;
  float* sum_out = static_cast<float*>(p.sum_out) + base;
  const float* weight = static_cast<const float*>(p.weight);
  float* out = static_cast<float*>(p.out) + base;

  float squares = 0.0f;
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x) {
    float v = x[i];
    if constexpr (kAddResidual) {
      v += residual[i];
      sum_out[i] = v;
    }
    squares += v * v;
  }
  const float inv_rms = rsqrtf(block_sum(squares, scratch) / static_cast<float>(p.dim) + p.eps);
  const float* source = kAddResidual ? static_cast<const float*>(sum_out) : x;
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x)
    out[i] = source[i] * inv_rms * weight[i];
}

template <bool kAddResidual>
__device__ void rms_norm_rows(const RmsNormParams& p) {
  __shared__ float scratch[kWarpSize];
  const int row = blockIdx.x;
  if (row >= p.rows) return;
  const int64_t base = static_cast<int64_t>(row) * p.dim;
  if (norm_fits_registers(p)) rms_norm_row_in_registers<kAddResidual>(p, base, scratch);
  else rms_norm_row_looped<kAddResidual>(p, base, scratch);
}

// A decode GEMV's staged x as atlas_add_rms_norm writes it, for a consumer that takes the norm
// in (ATLAS_NORM=fused): xs[i] = rms_norm(x + residual)[i] * weight[i] over row 0 of p, computed
// by every block with the norm kernel's own code and thread layout (the caller's blockDim.x is
// norm_threads(dim), checked by the host), so the same bits; the block with `writes` also stores
// what the norm kernel would have, out and sum_out, for the later readers of either. H: the row's
// length (p.dim) and kThreads the block's (blockDim.x), both checked by the caller; they size the
// registers. slot(i): where float4 i goes in xs (the quantized GEMVs' swizzle). Ends with a
// barrier: xs is complete.
struct SameSlot {
  __device__ int operator()(int i) const { return i; }
};

template <int H, int kThreads, class Slot = SameSlot>
__device__ __forceinline__ void stage_add_rms_norm(const RmsNormParams& p, float* xs, bool writes, Slot slot = {}) {
  static_assert(H % 4 == 0, "stage_add_rms_norm: the row is read as float4");
  constexpr int kVecs = (H / 4 + kThreads - 1) / kThreads;
  __shared__ float scratch[kWarpSize];
  float4 v[kVecs];
  float4 w[kVecs];
  const float inv_rms = load_norm_row<true, kVecs>(p, 0, v, w, writes, scratch);
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i >= H / 4) continue;
    const float4 value = normed4(v[j], w[j], inv_rms);
    reinterpret_cast<float4*>(xs)[slot(i)] = value;
    if (writes) store_vec(p.out, i, value);
  }
  __syncthreads();
}

}  // namespace atlas
