// Shared device helpers of the atlas kernels: bf16 <-> f32 vector loads, warp/block reductions.
// Every kernel header includes this one; it pulls in the two generated headers of the tuple
// (model constants and the params structs rendered from python/atlas/kernel_params).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "atlas_params.cuh"
#include "atlas_tuple.cuh"

namespace atlas {

// The block's dynamic shared memory as `type name[]`, 16-byte aligned (tests/simt's host build
// defines its own).
#ifndef ATLAS_DYNAMIC_SMEM
#define ATLAS_DYNAMIC_SMEM(type, name) extern __shared__ __align__(16) type name[]
#endif

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// The first statement of every entry, except in the decode GEMVs and the router's logits, which
// issue weight loads first (gemv.cuh, gemv_quant.cuh, router.cuh: no kernel writes weights), and
// the bf16 MoE down GEMV, which also reads its routing first (moe.cuh says why that is safe). Under
// programmatic dependent launch (ATLAS_LAUNCH=pdl, sm_90+) a kernel may start while the previous
// one in the stream still runs: wait until that one has finished and its writes are visible, then
// let the next kernel launch early in turn. Without the launch attribute both instructions return
// at once.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Pulls [ptr, ptr + bytes) from memory into L2 (sm_90+: one bulk prefetch; nothing before). Safe
// before pdl_enter on any memory: L2 is where global memory is coherent, so a line brought in
// early is never stale, whatever the previous kernel writes, and under programmatic launch the
// fetch overlaps that kernel. ptr 16-byte aligned, bytes a multiple of 16.
__device__ __forceinline__ void prefetch_l2(const void* ptr, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(ptr), "r"(bytes) : "memory");
#elif defined(ATLAS_SIMT_HOST)
  // The host emulator reads the span's first and last byte, so a span past its allocation faults
  // on the guard page there instead of prefetching someone else's memory on the GPU.
  if (bytes > 0) {
    const volatile unsigned char* span = static_cast<const volatile unsigned char*>(ptr);
    (void)span[0];
    (void)span[bytes - 1];
  }
#endif
}

__device__ __forceinline__ float bf16_to_f32(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

// Round-to-nearest-even, NaN kept quiet: the same rounding as __float2bfloat16_rn.
__device__ __forceinline__ uint16_t f32_to_bf16(float value) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(value));
}

// Two f32 -> one .b32 holding (lo, hi) bf16, the operand packing mma.sync expects.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  return static_cast<uint32_t>(f32_to_bf16(lo)) | (static_cast<uint32_t>(f32_to_bf16(hi)) << 16);
}

__device__ __forceinline__ void unpack_bf16x2(uint32_t word, float& lo, float& hi) {
  lo = __uint_as_float(word << 16);
  hi = __uint_as_float(word & 0xffff0000u);
}

// Loads N consecutive bf16 (N in {2, 4, 8}; src aligned to 2N bytes) as f32, one vector load.
template <int N>
__device__ __forceinline__ void load_bf16(const uint16_t* src, float (&out)[N]) {
  static_assert(N == 2 || N == 4 || N == 8, "load_bf16: N must be 2, 4 or 8");
  if constexpr (N == 8) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
    unpack_bf16x2(raw.x, out[0], out[1]);
    unpack_bf16x2(raw.y, out[2], out[3]);
    unpack_bf16x2(raw.z, out[4], out[5]);
    unpack_bf16x2(raw.w, out[6], out[7]);
  } else if constexpr (N == 4) {
    const uint2 raw = *reinterpret_cast<const uint2*>(src);
    unpack_bf16x2(raw.x, out[0], out[1]);
    unpack_bf16x2(raw.y, out[2], out[3]);
  } else {
    unpack_bf16x2(*reinterpret_cast<const uint32_t*>(src), out[0], out[1]);
  }
}

// Loads N consecutive f32 (N in {2, 4, 8}; src aligned to min(4N, 16) bytes).
template <int N>
__device__ __forceinline__ void load_f32(const float* src, float (&out)[N]) {
  static_assert(N == 2 || N == 4 || N == 8, "load_f32: N must be 2, 4 or 8");
  if constexpr (N == 2) {
    const float2 v = *reinterpret_cast<const float2*>(src);
    out[0] = v.x; out[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 v = *reinterpret_cast<const float4*>(src + i);
      out[i] = v.x; out[i + 1] = v.y; out[i + 2] = v.z; out[i + 3] = v.w;
    }
  }
}

// Sets every element of a (nested) register array, unrolled: fill(acc, 0.0f) for float acc[A][B][C].
__device__ __forceinline__ void fill(float& element, float value) { element = value; }
template <class T, int N>
__device__ __forceinline__ void fill(T (&array)[N], float value) {
#pragma unroll
  for (int i = 0; i < N; ++i) fill(array[i], value);
}

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    value += __shfl_xor_sync(kFullMask, value, offset);
  return value;
}

__device__ __forceinline__ float warp_max(float value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    value = fmaxf(value, __shfl_xor_sync(kFullMask, value, offset));
  return value;
}

// Block-wide sum, result in every thread. `scratch` holds >= 32 floats; blockDim.x % 32 == 0.
// Ends with a barrier so the scratch can be reused by the next call.
__device__ __forceinline__ float block_sum(float value, float* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  value = warp_sum(value);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  float total = lane < warps ? scratch[lane] : 0.0f;
  total = warp_sum(total);
  __syncthreads();
  return total;
}

__device__ __forceinline__ float block_max(float value, float* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  value = warp_max(value);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  float best = lane < warps ? scratch[lane] : -INFINITY;
  best = warp_max(best);
  __syncthreads();
  return best;
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

}  // namespace atlas
