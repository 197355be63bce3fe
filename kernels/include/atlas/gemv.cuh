// Decode linear (tokens <= 8): out[t, n] = sum_k x[t, k] * W[n, k], W bf16 [N, K] row-major.
// Memory-bound on W: each warp owns R output rows and streams them with 16-byte loads, U column
// groups per row in flight (R x U = 8 x 16 B outstanding per lane); x is staged in shared memory
// as f32 in column chunks (by cp.async, stage.cuh) and reused by every row of the block, with the
// lanes' first weight batch already in flight (issued before the staging, kept packed until
// used); warp-shuffle reduction.
// Two shapes: wide (R 4, U 2: 32 rows per block) when N gives enough blocks to fill the GPU,
// narrow (R 1, U 8: 8 rows per block) for small N such as the k/v and o projections.
// Requires K % 8 == 0 and 16-byte aligned W rows (checked by the op wrapper).
#pragma once

#include "atlas/common.cuh"
#include "atlas/norm.cuh"
#include "atlas/stage.cuh"

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

// One batch of a lane's weights: column groups g0 + u * 32 (u < U) of each of its R rows, 8 bf16
// each, kept packed until used (zero bits, i.e. +0.0, past `groups` and for absent rows). Packed,
// because a batch loaded ahead of a barrier is unpacked after it: unpacking at the load would make
// the warp wait for the weights before the barrier.
template <int R, int U>
__device__ __forceinline__ void load_weight_batch(const uint16_t* (&rows)[R], int g0, int groups, uint4 (&w)[U][R]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int g = g0 + u * kWarpSize;
#pragma unroll
    for (int r = 0; r < R; ++r)
      w[u][r] = g < groups && rows[r] != nullptr ? __ldg(reinterpret_cast<const uint4*>(rows[r] + g * 8)) : make_uint4(0, 0, 0, 0);
  }
}

// acc[t][r] += x[t, group g0 + u * 32] . w[u][r] over the batch's groups before `groups`.
template <int T, int R, int U>
__device__ __forceinline__ void accumulate_batch(const float* xs, int g0, int groups, const uint4 (&w)[U][R],
                                                 float (&acc)[T][R]) {
  constexpr int kCols = gemv_chunk_cols<T>();
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int g = g0 + u * kWarpSize;
    if (g >= groups) break;
    float wf[R][8];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint32_t words[4] = {w[u][r].x, w[u][r].y, w[u][r].z, w[u][r].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) unpack_bf16x2(words[i], wf[r][2 * i], wf[r][2 * i + 1]);
    }
#pragma unroll
    for (int t = 0; t < T; ++t) {
      float xv[8];
      load_f32<8>(xs + t * kCols + g * 8, xv);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[t][r] = fmaf(xv[e], wf[r][e], acc[t][r]);
    }
  }
}

// Accumulates x[t, chunk] . W[row, chunk] for this lane's 8-column groups g (lane, lane + 32, ...).
// `first` holds the first batch (g0 = lane): the caller issues it before staging x, so the
// weights' first round trip overlaps the staging's instead of following it. Each later batch is
// loaded and used within its iteration (one batch of registers live, not two).
template <int T, int R, int U>
__device__ __forceinline__ void gemv_chunk(const float* xs, const uint16_t* (&rows)[R], int groups,
                                           const uint4 (&first)[U][R], float (&acc)[T][R]) {
  const int lane = threadIdx.x % kWarpSize;
  accumulate_batch<T, R, U>(xs, lane, groups, first, acc);
  for (int g0 = lane + U * kWarpSize; g0 < groups; g0 += U * kWarpSize) {
    uint4 w[U][R];
    load_weight_batch<R, U>(rows, g0, groups, w);
    accumulate_batch<T, R, U>(xs, g0, groups, w, acc);
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

// The weight rows of column chunk c0 (nullptr past n).
template <int R>
__device__ __forceinline__ void chunk_rows(const LinearParams& p, int row0, int c0, const uint16_t* (&rows)[R]) {
  const uint16_t* weight = static_cast<const uint16_t*>(p.weight);
#pragma unroll
  for (int r = 0; r < R; ++r) rows[r] = row0 + r < p.n ? weight + static_cast<int64_t>(row0 + r) * p.k + c0 : nullptr;
}

// x[:, c0 : c0 + cols] of every token into xs [T, kCols], then a barrier.
template <int T>
__device__ __forceinline__ void stage_x_chunk(const LinearParams& p, float* xs, int c0, int cols) {
  const float* x = static_cast<const float*>(p.x);
  if constexpr (T == 1) {
    stage_async(xs, x + c0, cols);
    stage_wait();
  } else {  // a plain loop: by cp.async, sm_90a's ptxas held narrow_t5 to 48 registers and spilled
    constexpr int kCols = gemv_chunk_cols<T>();
    for (int i = threadIdx.x; i < T * cols / 4; i += blockDim.x) {
      const int t = i / (cols / 4);
      const int c4 = i - t * (cols / 4);
      reinterpret_cast<float4*>(xs + t * kCols)[c4] = reinterpret_cast<const float4*>(x + static_cast<int64_t>(t) * p.k + c0)[c4];
    }
    __syncthreads();
  }
}

// Enters through pdl_enter itself, after issuing its first weight batch: under programmatic
// launch those loads overlap the previous kernel. Safe before the wait because no kernel writes
// weights (they are uploaded before any launch), so no load can see a stale value; x, the
// previous kernel's output, is read after it, by stage(xs, c0, cols) (stage_x_chunk's contract).
// The batch is the only __ldg in this file, so tests/test_pdl_ptx.py can hold every load before
// the wait to ld.global.nc.
template <int T, int R, int U, class StageChunk>
__device__ void gemv_staged(const LinearParams& p, StageChunk stage) {
  constexpr int kCols = gemv_chunk_cols<T>();
  __shared__ __align__(16) float xs[T * kCols];  // [T, kCols]
  if (p.tokens != T) return;  // the wrapper picks the instance with T == tokens
  const int lane = threadIdx.x % kWarpSize;
  const int row0 = (blockIdx.x * kGemvWarps + threadIdx.x / kWarpSize) * R;
  float acc[T][R];
  fill(acc, 0.0f);

  for (int c0 = 0; c0 < p.k; c0 += kCols) {
    const int cols = min(kCols, p.k - c0);  // a multiple of 8
    const uint16_t* rows[R];
    chunk_rows<R>(p, row0, c0, rows);
    uint4 w[U][R];
    load_weight_batch<R, U>(rows, lane, cols / 8, w);
    pdl_enter();  // the first chunk's waits; a later chunk's returns at once
    stage(xs, c0, cols);
    gemv_chunk<T, R, U>(xs, rows, cols / 8, w, acc);
    __syncthreads();
  }

  pdl_enter();  // returns at once after the loop's; waits here only when k == 0 skipped the loop
  gemv_store_rows(acc, static_cast<float*>(p.out), p.n, row0, [](int) { return 1.0f; });
}

template <int T, int R, int U>
__device__ void gemv(const LinearParams& p) {
  gemv_staged<T, R, U>(p, [&p](float* xs, int c0, int cols) { stage_x_chunk<T>(p, xs, c0, cols); });
}

// One token's GEMV of add_rms_norm's output, the norm taken in (ATLAS_NORM=fused): each block
// stages norm(x + residual) * weight itself (stage_add_rms_norm; p.linear.x is unused) and block
// 0 also writes the norm's two outputs, so this one launch leaves what atlas_add_rms_norm followed
// by atlas_gemv_t1 would. K == H, the model's hidden size (the row fits one chunk).
template <int R, int U, int H>
__device__ void gemv_norm(const LinearNormParams& p) {
  static_assert(H <= gemv_chunk_cols<1>(), "gemv_norm: the row must fit one staged chunk");
  if (p.norm.dim != H || p.linear.k != H || blockDim.x != kGemvThreads) return;
  gemv_staged<1, R, U>(p.linear, [&p](float* xs, int, int) {
    stage_add_rms_norm<H, kGemvThreads>(p.norm, xs, blockIdx.x == 0);
  });
}

}  // namespace atlas
