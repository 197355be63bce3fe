// Decode linear over quantized weights (tokens <= 8): out[t, n] = row_scale[n] *
// sum_k x[t, k] * W[n, k], W in fp8 block or nvfp4 (quant_common.cuh), dequantized in registers.
// Memory-bound on W: each warp owns R rows; a lane loads chunk c (16 weights, one scale) of each
// row for U chunk columns before any arithmetic, so R x U chunk loads are in flight per lane.
// Per chunk: 16 raw products summed in f32, then one FMA with the chunk scale.
// x is staged in shared memory as f32 in column blocks and reused by the warp's R rows; its
// float4 slots are XOR-swizzled so the 8 lanes of a quarter warp (chunks 64 bytes apart) hit
// distinct banks. Two shapes, as for bf16: wide (R 4, U 2) and narrow (R 1, U 4 or 2) for small N.
// Requires k % 16 == 0 (op wrapper).
#pragma once

#include "atlas/gemv.cuh"
#include "atlas/quant_common.cuh"

namespace atlas::quant {

constexpr int kQGemvThreads = 256;
constexpr int kQGemvWarps = kQGemvThreads / kWarpSize;
constexpr int kQGemvWideRows = 4;
constexpr int kQGemvWideUnroll = 2;
constexpr int kQGemvNarrowRows = 1;
// Narrow shape: 4 chunk loads in flight for T <= 4; 2 above, which keeps sm_121a free of spills
// (its ptxas caps registers to keep 3 blocks of 28-32 KiB smem resident).
__host__ __device__ constexpr int qgemv_narrow_unroll(int tokens) { return tokens <= 4 ? 4 : 2; }
constexpr int kQGemvSmemFloats = 8192;  // 32 KiB of staged x per block

template <int T>
__host__ __device__ constexpr int qgemv_cols() {
  return kQGemvSmemFloats / T / 512 * 512;  // whole chunk columns of every lane: 32 x 16
}

// Physical float4 slot of logical slot f = 4c + j (chunk c, quarter j) in a staged x row.
__device__ __forceinline__ int swizzled_slot(int f) {
  const int c = f >> 2;
  return (c << 2) | ((f & 3) ^ ((c >> 1) & 3));
}

// Stages one row of `vecs` float4 into shared memory (float4 i to slot(i)), each thread's two
// loads issued before either store: one round trip at K = 2048 where a strided loop waits one per
// float4. Not by cp.async (stage.cuh) here: with it sm_90a's ptxas held the nvfp4 MoE gate_up
// GEMV to 64 registers and spilled.
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

// Stages x's column block [col0, col0 + cols) of each of the T rows (row stride k) into xs,
// swizzled: T = 1 at once, more rows issued by cp.async (stage.cuh). stage_wait() completes it.
template <int T>
__device__ __forceinline__ void stage_x(const float* x, int k, int col0, int cols, float* xs) {
  constexpr int kCols = qgemv_cols<T>();
  if constexpr (T == 1) stage_row_pairs(xs, x + col0, cols / 4, [](int f) { return swizzled_slot(f); });
  else stage_async(xs, x + col0, cols, StageRows{T, kCols, k}, [](int f) { return swizzled_slot(f); });
}

// The 16 staged x values of chunk c for token row xs_row.
__device__ __forceinline__ void load_x_chunk(const float* xs_row, int c, float (&xv)[kChunk]) {
  const float4* row = reinterpret_cast<const float4*>(xs_row);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float4 v = row[swizzled_slot(4 * c + j)];
    xv[4 * j] = v.x; xv[4 * j + 1] = v.y; xv[4 * j + 2] = v.z; xv[4 * j + 3] = v.w;
  }
}

// One batch of a lane's chunks: chunk columns c0 + u * 32 (u < U) of each of its R rows, kept
// raw until used (Format::zero() past `chunks` and for absent rows, rows[r] < 0).
template <class Format, int R, int U>
__device__ __forceinline__ void load_chunk_batch(const QuantMatrix& m, const int64_t (&rows)[R], int chunk0, int c0,
                                                 int chunks, typename Format::Chunk (&w)[U][R]) {
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int c = c0 + u * kWarpSize;
      w[u][r] = c < chunks && rows[r] >= 0 ? Format::load(m, rows[r], chunk0 + c) : Format::zero();
    }
}

// acc[t][r] += x[t, chunk c] . W[rows[r], chunk c] over the batch's chunks c = c0 + u * 32 before
// `chunks`. kDiagonal (T == R): only acc[r][r], x row r against weight row r.
template <class Format, int T, int R, int U, bool kDiagonal>
__device__ __forceinline__ void accumulate_chunk_batch(const typename Format::Chunk (&w)[U][R], int c0, int chunks,
                                                       const float* xs, float (&acc)[T][R]) {
  constexpr int kCols = qgemv_cols<T>();
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = c0 + u * kWarpSize;
    if (c >= chunks) break;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float raw[kChunk];
      Format::decode(w[u][r], raw);
      const float s = Format::scale(w[u][r]);
#pragma unroll
      for (int t = 0; t < T; ++t) {
        if (kDiagonal && t != r) continue;
        float xv[kChunk];
        load_x_chunk(xs + t * kCols, c, xv);
        float partial = 0.0f;
#pragma unroll
        for (int e = 0; e < kChunk; ++e) partial = fmaf(raw[e], xv[e], partial);
        acc[t][r] = fmaf(s, partial, acc[t][r]);
      }
    }
  }
}

// acc[t][r] += x[t, block columns] . W[rows[r], block columns] over one block of `chunks` chunk
// columns from chunk0, for this lane's chunks; stage() issues the staging of the block's x rows
// into xs (stage.cuh). The lane's first batch of chunks is issued before stage(), so the weights'
// first round trip overlaps the staging's instead of following it; each later batch is loaded
// and used within its iteration. (gemv.cuh peels the first batch off the loop instead; here that
// form took more registers, e.g. 98 against 75 in the fp8 MoE gate_up GEMV on sm_90a.) Every
// thread of the block calls it (two barriers). kDiagonal: see accumulate_chunk_batch.
template <class Format, int T, int R, int U, bool kDiagonal = false, class Stage>
__device__ __forceinline__ void qgemv_block(const QuantMatrix& m, const int64_t (&rows)[R], int chunk0, int chunks,
                                            const float* xs, Stage stage, float (&acc)[T][R]) {
  static_assert(!kDiagonal || T == R, "a diagonal block pairs x row r with weight row r");
  const int lane = threadIdx.x % kWarpSize;
  typename Format::Chunk w[U][R];
  load_chunk_batch<Format, R, U>(m, rows, chunk0, lane, chunks, w);
  stage();
  stage_wait();
  for (int c0 = lane; c0 < chunks; c0 += U * kWarpSize) {
    if (c0 != lane) load_chunk_batch<Format, R, U>(m, rows, chunk0, c0, chunks, w);
    accumulate_chunk_batch<Format, T, R, U, kDiagonal>(w, c0, chunks, xs, acc);
  }
  __syncthreads();
}

// Enters through pdl_enter itself, once its first batch of chunks (weights and their scales,
// ld.global.nc) is issued: under programmatic launch those loads overlap the previous kernel. Safe
// before the wait because no kernel writes weights; x and the row scales are read after it, x by
// stage_chunk(xs, col0, cols) (stage_x's contract: swizzled slots, completed by stage_wait()).
template <class Format, int T, int R, int U, class StageChunk>
__device__ void gemv_quant_staged(const QuantLinearParams& p, StageChunk stage_chunk) {
  constexpr int kCols = qgemv_cols<T>();
  __shared__ __align__(16) float xs[T * kCols];  // [T, kCols], swizzled float4 slots
  if (p.tokens != T || p.k % kChunk != 0) return;
  const int warp = threadIdx.x / kWarpSize;
  const int row0 = (blockIdx.x * kQGemvWarps + warp) * R;
  const QuantMatrix m{static_cast<const uint8_t*>(p.weight), p.scale, p.k};
  int64_t rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) rows[r] = row0 + r < p.n ? row0 + r : -1;

  float acc[T][R];
  fill(acc, 0.0f);

  for (int col0 = 0; col0 < p.k; col0 += kCols) {
    const int cols = min(kCols, p.k - col0);  // a multiple of 16
    const auto stage = [&] {
      pdl_enter();  // after the block's first weight batch; past the first block it returns at once
      stage_chunk(xs, col0, cols);
    };
    qgemv_block<Format, T, R, U>(m, rows, col0 / kChunk, cols / kChunk, xs, stage, acc);
  }

  pdl_enter();  // returns at once after the loop's; waits here only when k == 0 skipped the loop
  gemv_store_rows(acc, static_cast<float*>(p.out), p.n, row0,
                  [&](int row) { return row_scale_at(p.row_scale, row); });
}

template <class Format, int T, int R, int U>
__device__ void gemv_quant(const QuantLinearParams& p) {
  gemv_quant_staged<Format, T, R, U>(p, [&p](float* xs, int col0, int cols) {
    stage_x<T>(static_cast<const float*>(p.x), p.k, col0, cols, xs);
  });
}

// One token's quantized GEMV of add_rms_norm's output, the norm taken in (ATLAS_NORM=fused), as
// gemv.cuh's gemv_norm: every block stages the normed row (swizzled), block 0 writes the norm's
// outputs; K == H, the model's hidden size (one column block).
template <class Format, int R, int U, int H>
__device__ void gemv_quant_norm(const QuantLinearNormParams& p) {
  static_assert(H <= qgemv_cols<1>(), "gemv_quant_norm: the row must fit one staged column block");
  if (p.norm.dim != H || p.linear.k != H || blockDim.x != kQGemvThreads) return;
  gemv_quant_staged<Format, 1, R, U>(p.linear, [&p](float* xs, int, int) {
    stage_add_rms_norm<H, kQGemvThreads>(p.norm, xs, blockIdx.x == 0, [](int f) { return swizzled_slot(f); });
  });
}

}  // namespace atlas::quant
