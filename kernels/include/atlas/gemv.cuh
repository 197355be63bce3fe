// Decode linear (tokens <= 8): out[t, n] = sum_k x[t, k] * W[n, k], W bf16 [N, K] row-major.
// Memory-bound on W: each warp owns R output rows and streams them with 16-byte loads, U column
// groups per row in flight (R x U = 8 x 16 B outstanding per lane); x is staged in shared memory
// as f32 in column chunks and reused by every row of the block; warp-shuffle reduction.
// Two shapes: wide (R 4, U 2: 32 rows per block) when N gives enough blocks to fill the GPU,
// narrow (R 1, U 8: 8 rows per block) for small N such as the k/v and o projections.
// Requires K % 8 == 0 and 16-byte aligned W rows (checked by the op wrapper).
#pragma once

#include "atlas/common.cuh"

namespace atlas {

constexpr int kGemvThreads = 256;
constexpr int kGemvWarps = kGemvThreads / kWarpSize;
constexpr int kGemvWideRows = 4;    // rows per warp, wide shape
constexpr int kGemvWideUnroll = 2;
constexpr int kGemvNarrowRows = 1;  // rows per warp, narrow shape
// Narrow shape: 8 loads in flight for T <= 4; 4 above, which keeps T = 8 free of spills.
__host__ __device__ constexpr int gemv_narrow_unroll(int tokens) { return tokens <= 4 ? 8 : 4; }
constexpr int kGemvSmemFloats = 8192;  // 32 KiB of staged x per block, whatever T

template <int T>
__host__ __device__ constexpr int gemv_chunk_cols() {
  return kGemvSmemFloats / T / 256 * 256;  // a multiple of 256 = 32 lanes x 8 columns
}

// Accumulates x[t, chunk] . W[row, chunk] for this lane's 8-column groups g (lane, lane + 32, ...).
template <int T, int R, int U>
__device__ __forceinline__ void gemv_chunk(const float* xs, const uint16_t* (&rows)[R], int groups,
                                           float (&acc)[T][R]) {
  constexpr int kCols = gemv_chunk_cols<T>();
  const int lane = threadIdx.x % kWarpSize;
  for (int g0 = lane; g0 < groups; g0 += U * kWarpSize) {
    float w[U][R][8];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int g = g0 + u * kWarpSize;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (g < groups && rows[r] != nullptr) {
          load_bf16<8>(rows[r] + g * 8, w[u][r]);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) w[u][r][e] = 0.0f;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int g = g0 + u * kWarpSize;
      if (g >= groups) break;
#pragma unroll
      for (int t = 0; t < T; ++t) {
        float xv[8];
        load_f32<8>(xs + t * kCols + g * 8, xv);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[t][r] = fmaf(xv[e], w[u][r][e], acc[t][r]);
      }
    }
  }
}

// Stages one row of `vecs` float4 into shared memory (float4 i to slot(i)), each thread's two
// loads issued before either store. The strided loop of T > 1 (trip count unknown, not unrolled)
// waits one memory round trip per float4 a thread stages: two at K = 2048, four at K = 4096,
// before the first weight load. Two, not more: the decode GEMVs' registers decide how many
// blocks an SM holds.
template <class Slot>
__device__ __forceinline__ void stage_row_pairs(float* xs, const float* x, int vecs, Slot slot) {
  const int step = static_cast<int>(blockDim.x);
  for (int i = threadIdx.x; i < vecs; i += 2 * step) {
    const float4 first = reinterpret_cast<const float4*>(x)[i];
    const bool second = i + step < vecs;
    float4 next = first;
    if (second) next = reinterpret_cast<const float4*>(x)[i + step];
    reinterpret_cast<float4*>(xs)[slot(i)] = first;
    if (second) reinterpret_cast<float4*>(xs)[slot(i + step)] = next;
  }
}

// The epilogue of the GEMVs: out[t, row0 + r] = scale(row0 + r) * (acc[t][r] summed over the warp's
// lanes), rows past n skipped.
template <int T, int R, class RowScale>
__device__ __forceinline__ void gemv_store_rows(const float (&acc)[T][R], float* out, int n, int row0, RowScale scale) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float total = warp_sum(acc[t][r]);
      if (lane == 0 && row0 + r < n) out[static_cast<int64_t>(t) * n + row0 + r] = scale(row0 + r) * total;
    }
}

// Before pdl_enter: the first p.prefetch_blocks blocks pull their weight rows into L2 (lane 0 of
// each warp, its R rows: one contiguous span), so under programmatic launch the weights stream in
// while the previous kernel still runs and the loads after the wait hit L2. Weights only: x is the
// previous kernel's output. The host sets prefetch_blocks (0 without programmatic launch).
template <int R>
__device__ __forceinline__ void gemv_prefetch(const LinearParams& p) {
  if (static_cast<int>(blockIdx.x) >= p.prefetch_blocks || threadIdx.x % kWarpSize != 0) return;
  const int row0 = (blockIdx.x * kGemvWarps + threadIdx.x / kWarpSize) * R;
  const int rows = min(R, p.n - row0);
  if (rows > 0) {
    const uint16_t* weight = static_cast<const uint16_t*>(p.weight) + static_cast<int64_t>(row0) * p.k;
    prefetch_l2(weight, static_cast<uint32_t>(rows) * static_cast<uint32_t>(p.k) * 2u);
  }
}

template <int T, int R, int U>
__device__ void gemv(const LinearParams& p) {
  constexpr int kCols = gemv_chunk_cols<T>();
  __shared__ __align__(16) float xs[T * kCols];  // [T, kCols]
  if (p.tokens != T) return;  // the wrapper picks the instance with T == tokens
  const int warp = threadIdx.x / kWarpSize;
  const int row0 = (blockIdx.x * kGemvWarps + warp) * R;
  const float* x = static_cast<const float*>(p.x);
  const uint16_t* weight = static_cast<const uint16_t*>(p.weight);

  float acc[T][R];
  fill(acc, 0.0f);

  for (int c0 = 0; c0 < p.k; c0 += kCols) {
    const int cols = min(kCols, p.k - c0);  // a multiple of 8
    if constexpr (T == 1) {
      stage_row_pairs(xs, x + c0, cols / 4, [](int i) { return i; });
    } else {
      for (int i = threadIdx.x; i < T * cols / 4; i += blockDim.x) {
        const int t = i / (cols / 4);
        const int c4 = i - t * (cols / 4);
        reinterpret_cast<float4*>(xs + t * kCols)[c4] =
            reinterpret_cast<const float4*>(x + static_cast<int64_t>(t) * p.k + c0)[c4];
      }
    }
    __syncthreads();
    const uint16_t* rows[R];
#pragma unroll
    for (int r = 0; r < R; ++r)
      rows[r] = row0 + r < p.n ? weight + static_cast<int64_t>(row0 + r) * p.k + c0 : nullptr;
    gemv_chunk<T, R, U>(xs, rows, cols / 8, acc);
    __syncthreads();
  }

  gemv_store_rows(acc, static_cast<float*>(p.out), p.n, row0, [](int) { return 1.0f; });
}

}  // namespace atlas
