// Grouped expert GEMM over quantized experts (W8A16 fp8 block, W4A16 nvfp4): the prefill MoE of
// moe.cuh (same routing from atlas_moe_route, same grid (N tiles, M tiles, E), same 64x64x32 tile,
// mma.sync fragments, fused silu_mul epilogue of gate_up and per-slot weighted rows of down) with
// the B operand dequantized in registers: each thread loads one 16-weight chunk of the tile per K
// step (quant_common.cuh), one step ahead, and stores it to shared memory as bf16. The per-row
// scales (nvfp4 weight_scale_2 of the gate, up or down tensor of each expert) multiply the
// accumulators before the epilogue. Requires k_in % 16 == 0.
//
// Decode (few tokens) runs two GEMVs instead, on the gemv_quant.cuh block: moe_qgemv_gate_up, one
// warp per act column i of one slot (gate row i and up row i of the slot's expert, x staged once
// per block); moe_qgemv_down, one warp per output feature n of one token, loading the k experts'
// rows together, each against its own slot's act row, summed in slot order: no atomics.
#pragma once

#include "atlas/gemv_quant.cuh"
#include "atlas/moe.cuh"
#include "atlas/quant_common.cuh"

namespace atlas::quant {

constexpr int kMoeChunksPerRow = moe::kBK / kChunk;  // 2
static_assert(moe::kBN * kMoeChunksPerRow == moe::kGemmThreads, "one B chunk per thread");

template <class Format>
struct MoeStageRegs {
  float4 a[moe::kAChunks];
  typename Format::Chunk b;
};

// Weight row (in the stacked [E * rows_per_expert, k] matrix) behind B tile row r.
template <bool kGateUp>
__device__ __forceinline__ int64_t moe_weight_row(int n_out, int e, int n0, int r, int& col) {
  col = moe::b_tile_column<kGateUp>(n0, r);
  const bool up_half = kGateUp && (r % moe::kWarpTile) >= moe::kWarpTile / 2;
  const int64_t rows_per_expert = kGateUp ? 2 * static_cast<int64_t>(n_out) : n_out;
  return static_cast<int64_t>(e) * rows_per_expert + col + (up_half ? n_out : 0);
}

template <bool kGateUp, class Format>
__device__ __forceinline__ void moe_load_stage(const MoeQuantGemmParams& p, const QuantMatrix& m, const int* a_row_s,
                                               int e, int n0, int k0, MoeStageRegs<Format>& regs) {
  const float* a = static_cast<const float*>(p.a);
#pragma unroll
  for (int i = 0; i < moe::kAChunks; ++i) {
    const int idx = threadIdx.x + i * moe::kGemmThreads;
    const int r = idx / moe::kAChunksPerRow;
    const int k = k0 + (idx % moe::kAChunksPerRow) * 4;
    const int src = a_row_s[r];
    regs.a[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (src >= 0 && k + 4 <= p.k_in) regs.a[i] = *reinterpret_cast<const float4*>(a + static_cast<int64_t>(src) * p.k_in + k);
  }
  const int r = threadIdx.x / kMoeChunksPerRow;
  const int k = k0 + (threadIdx.x % kMoeChunksPerRow) * kChunk;
  int col;
  const int64_t w_row = moe_weight_row<kGateUp>(p.n_out, e, n0, r, col);
  regs.b = col < p.n_out && k < p.k_in ? Format::load(m, w_row, k / kChunk) : Format::zero();
}

template <class Format>
__device__ __forceinline__ void moe_store_stage(const MoeStageRegs<Format>& regs, moe::TileRow* a_s, moe::TileRow* b_s) {
#pragma unroll
  for (int i = 0; i < moe::kAChunks; ++i) {
    const int idx = threadIdx.x + i * moe::kGemmThreads;
    const float4 v = regs.a[i];
    *reinterpret_cast<uint2*>(&a_s[idx / moe::kAChunksPerRow][(idx % moe::kAChunksPerRow) * 4]) =
        make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
  }
  uint32_t words[kChunk / 2];
  dequant_bf16<Format>(regs.b, words);
  uint4* dst = reinterpret_cast<uint4*>(&b_s[threadIdx.x / kMoeChunksPerRow][(threadIdx.x % kMoeChunksPerRow) * kChunk]);
  dst[0] = make_uint4(words[0], words[1], words[2], words[3]);
  dst[1] = make_uint4(words[4], words[5], words[6], words[7]);
}

// acc[mi][nj][half * 2 + q] is B tile row (warp % 2) * 32 + nj * 8 + (lane % 4) * 2 + q (mma_tile).
template <bool kGateUp>
__device__ __forceinline__ void moe_apply_row_scale(const MoeQuantGemmParams& p, int e, int n0, float (&acc)[2][4][4]) {
  if (p.row_scale == nullptr) return;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
#pragma unroll
  for (int nj = 0; nj < 4; ++nj)
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int r = (warp % 2) * moe::kWarpTile + nj * 8 + (lane % 4) * 2 + q;
      int col;
      const int64_t w_row = moe_weight_row<kGateUp>(p.n_out, e, n0, r, col);
      const float s = col < p.n_out ? row_scale_at(p.row_scale, w_row) : 0.0f;
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        acc[mi][nj][q] *= s;
        acc[mi][nj][2 + q] *= s;
      }
    }
}

template <bool kGateUp, class Format>
__device__ void moe_quant_gemm(const MoeQuantGemmParams& p) {
  if (blockDim.x != moe::kGemmThreads || p.k_in % kChunk != 0 || p.top_k <= 0) return;
  const int e = blockIdx.z;
  if (e >= p.num_experts) return;
  const int count = static_cast<const int32_t*>(p.counts)[e];
  const int first = static_cast<const int32_t*>(p.offsets)[e];
  const int n0 = blockIdx.x * (kGateUp ? moe::kGateUpCols : moe::kBN);
  if (n0 >= p.n_out) return;

  __shared__ __align__(16) uint16_t a_s[moe::kBM][moe::kStride];
  __shared__ __align__(16) uint16_t b_s[moe::kBN][moe::kStride];
  __shared__ moe::TileRows rows;
  const QuantMatrix m{static_cast<const uint8_t*>(p.weight), p.scale, p.k_in};
  const MoeGroupedGemmParams out_params{p.a, p.weight, p.counts, p.offsets, p.perm, p.route_weights, p.out,
                                        p.num_slots, p.top_k, p.n_out, p.k_in, p.num_experts, 0};
  const int32_t* perm = static_cast<const int32_t*>(p.perm);
  for (int m0 = blockIdx.y * moe::kBM; m0 < count; m0 += gridDim.y * moe::kBM) {
    __syncthreads();  // the previous tile's epilogue is done with `rows`
    if (threadIdx.x < moe::kBM) {
      const int mm = m0 + threadIdx.x;
      const int slot = mm < count ? perm[first + mm] : -1;
      rows.slot[threadIdx.x] = slot;
      rows.a_row[threadIdx.x] = slot < 0 ? -1 : (kGateUp ? slot / p.top_k : first + mm);
    }
    __syncthreads();
    float acc[2][4][4] = {};
    MoeStageRegs<Format> regs;
    moe_load_stage<kGateUp, Format>(p, m, rows.a_row, e, n0, 0, regs);
    for (int k0 = 0; k0 < p.k_in; k0 += moe::kBK) {
      moe_store_stage<Format>(regs, a_s, b_s);
      __syncthreads();
      if (k0 + moe::kBK < p.k_in) moe_load_stage<kGateUp, Format>(p, m, rows.a_row, e, n0, k0 + moe::kBK, regs);
      moe::mma_tile(a_s, b_s, acc);
      __syncthreads();
    }
    moe_apply_row_scale<kGateUp>(p, e, n0, acc);
    moe::store_tile<kGateUp>(out_params, rows, first, m0, n0, acc);
  }
}

constexpr int kMoeGemvUnroll = 2;  // chunk columns in flight per lane in the gate_up GEMV
// In the down GEMV, one: its k rows' first batch is held while the k act rows are staged, and two
// columns of 8 rows raised down_k8 to 155-162 registers on sm_90a (one block per SM). At the
// models' I = 512 a lane holds a single chunk column per block of staged act anyway, so this
// costs no loads in flight there.
constexpr int kMoeDownUnroll = 1;

template <class Format>
__device__ void moe_qgemv_gate_up(const MoeQuantGemvParams& p) {
  __shared__ __align__(16) float xs[qgemv_cols<1>()];
  if (blockDim.x != kQGemvThreads || p.top_k <= 0 || p.hidden % kChunk != 0) return;
  const int slot = blockIdx.y;
  if (slot >= p.num_tokens * p.top_k) return;
  const int lane = threadIdx.x % kWarpSize;
  const int i = blockIdx.x * kQGemvWarps + threadIdx.x / kWarpSize;
  const int e = static_cast<const int32_t*>(p.ids)[slot];
  const bool valid = i < p.inter && moe::valid_expert(e, p.num_experts);
  const int64_t gate_row = static_cast<int64_t>(e) * 2 * p.inter + i;
  const int64_t rows[2] = {valid ? gate_row : -1, valid ? gate_row + p.inter : -1};
  const QuantMatrix m{static_cast<const uint8_t*>(p.weight), p.scale, p.hidden};
  const float* x = static_cast<const float*>(p.x) + static_cast<int64_t>(slot / p.top_k) * p.hidden;
  float acc[1][2] = {{0.0f, 0.0f}};
  for (int col0 = 0; col0 < p.hidden; col0 += qgemv_cols<1>()) {
    const int cols = min(qgemv_cols<1>(), p.hidden - col0);
    qgemv_block<Format, 1, 2, kMoeGemvUnroll>(m, rows, col0 / kChunk, cols / kChunk, xs,
                                              [&] { stage_x<1>(x, p.hidden, col0, cols, xs); }, acc);
  }
  const float g = warp_sum(acc[0][0]);
  const float u = warp_sum(acc[0][1]);
  if (lane != 0 || i >= p.inter) return;
  float value = 0.0f;
  if (valid) value = silu(row_scale_at(p.row_scale, rows[0]) * g) * (row_scale_at(p.row_scale, rows[1]) * u);
  static_cast<float*>(p.out)[static_cast<int64_t>(slot) * p.inter + i] = value;
}

template <class Format, int kTopK>
__device__ void moe_qgemv_down(const MoeQuantGemvParams& p) {
  constexpr int kCols = qgemv_cols<kTopK>();
  __shared__ __align__(16) float xs[kTopK * kCols];  // the token's k act rows
  if (blockDim.x != kQGemvThreads || p.top_k != kTopK || p.inter % kChunk != 0) return;
  const int t = blockIdx.y;
  if (t >= p.num_tokens) return;
  const int lane = threadIdx.x % kWarpSize;
  const int n = blockIdx.x * kQGemvWarps + threadIdx.x / kWarpSize;
  const int32_t* ids = static_cast<const int32_t*>(p.ids) + static_cast<int64_t>(t) * kTopK;
  const float* route = static_cast<const float*>(p.route_weights) + static_cast<int64_t>(t) * kTopK;
  int64_t rows[kTopK];
#pragma unroll
  for (int j = 0; j < kTopK; ++j) {
    const int e = ids[j];
    rows[j] = n < p.hidden && moe::valid_expert(e, p.num_experts) ? static_cast<int64_t>(e) * p.hidden + n : -1;
  }
  const QuantMatrix m{static_cast<const uint8_t*>(p.weight), p.scale, p.inter};
  const float* act = static_cast<const float*>(p.x) + static_cast<int64_t>(t) * kTopK * p.inter;
  float acc[kTopK][kTopK];
#pragma unroll
  for (int a = 0; a < kTopK; ++a)
#pragma unroll
    for (int b = 0; b < kTopK; ++b) acc[a][b] = 0.0f;
  for (int col0 = 0; col0 < p.inter; col0 += kCols) {
    const int cols = min(kCols, p.inter - col0);
    qgemv_block<Format, kTopK, kTopK, kMoeDownUnroll, true>(
        m, rows, col0 / kChunk, cols / kChunk, xs, [&] { stage_x<kTopK>(act, p.inter, col0, cols, xs); }, acc);
  }
  if (n >= p.hidden) return;
  float total = 0.0f;
#pragma unroll
  for (int j = 0; j < kTopK; ++j) {
    const float dot = warp_sum(acc[j][j]);
    if (rows[j] >= 0) total = fmaf(route[j] * row_scale_at(p.row_scale, rows[j]), dot, total);
  }
  if (lane == 0) static_cast<float*>(p.out)[static_cast<int64_t>(t) * p.hidden + n] = total;
}

}  // namespace atlas::quant
