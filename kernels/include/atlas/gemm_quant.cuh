// Prefill linear over quantized weights (tokens > 8): out[M, N] = x[M, K] @ dequant(W)[N, K]^T,
// scaled per output column by row_scale. The bf16 GEMM of gemm.cuh (tile 64x128x32, 4 warps,
// ldmatrix + mma.sync m16n8k16, A staged f32 -> bf16) with its B operand replaced: each thread
// loads two 16-weight chunks of the W tile (quant_common.cuh) one K step ahead into registers,
// dequantizes them there (scale applied, packed to bf16) and stores them to the same padded
// shared tile the bf16 path fills by cp.async. bf16 weights exist only in shared memory.
// nvfp4 weights are exact in bf16 (e2m1 x e4m3 has at most 6 significant bits); fp8 times its
// f32 block scale is rounded to bf16 like the bf16 checkpoint weights. Requires K % 16 == 0.
#pragma once

#include "atlas/gemm.cuh"
#include "atlas/quant_common.cuh"

namespace atlas::quant {

constexpr int kQGemmChunksPerRow = kGemmBK / kChunk;                       // 2
constexpr int kQGemmBChunks = kGemmBN * kQGemmChunksPerRow / kGemmThreads;  // 2 per thread
static_assert(kQGemmBChunks * kGemmThreads == kGemmBN * kQGemmChunksPerRow, "B chunks must split evenly");

template <class Format>
struct QGemmBRegs {
  typename Format::Chunk chunk[kQGemmBChunks];
};

template <class Format>
__device__ __forceinline__ void qgemm_load_b(const QuantMatrix& m, int n, int n0, int k0, QGemmBRegs<Format>& regs) {
#pragma unroll
  for (int j = 0; j < kQGemmBChunks; ++j) {
    const int idx = threadIdx.x + j * kGemmThreads;
    const int row = idx / kQGemmChunksPerRow;
    const int col = k0 + (idx % kQGemmChunksPerRow) * kChunk;
    const bool valid = n0 + row < n && col < m.k;
    regs.chunk[j] = valid ? Format::load(m, n0 + row, col / kChunk) : Format::zero();
  }
}

template <class Format>
__device__ __forceinline__ void qgemm_store_b(const QGemmBRegs<Format>& regs, uint16_t (&b)[kGemmBN][kGemmStride]) {
#pragma unroll
  for (int j = 0; j < kQGemmBChunks; ++j) {
    const int idx = threadIdx.x + j * kGemmThreads;
    uint32_t words[kChunk / 2];
    dequant_bf16<Format>(regs.chunk[j], words);
    uint4* dst = reinterpret_cast<uint4*>(&b[idx / kQGemmChunksPerRow][(idx % kQGemmChunksPerRow) * kChunk]);
    dst[0] = make_uint4(words[0], words[1], words[2], words[3]);
    dst[1] = make_uint4(words[4], words[5], words[6], words[7]);
  }
}

__device__ __forceinline__ void qgemm_apply_row_scale(const QuantLinearParams& p, const GemmTile& tile,
                                                      float (&acc)[kGemmMTiles][kGemmNTiles][4]) {
  if (p.row_scale == nullptr) return;
#pragma unroll
  for (int nt = 0; nt < kGemmNTiles; ++nt)
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int col = tile.n0 + tile.warp_n * kGemmWarpN + nt * 8 + (tile.lane % 4) * 2 + q;
      const float s = col < p.n ? row_scale_at(p.row_scale, col) : 0.0f;
#pragma unroll
      for (int mt = 0; mt < kGemmMTiles; ++mt) {
        acc[mt][nt][q] *= s;
        acc[mt][nt][2 + q] *= s;
      }
    }
}

template <class Format>
__device__ void gemm_quant(const QuantLinearParams& qp) {
  __shared__ __align__(128) GemmSmem smem;
  if (qp.k % kChunk != 0) return;
  const LinearParams p{qp.x, qp.weight, qp.out, qp.tokens, qp.n, qp.k};
  const QuantMatrix m{static_cast<const uint8_t*>(qp.weight), qp.scale, qp.k};
  const GemmTile tile = gemm_block_tile();
  if (tile.m0 >= p.tokens || tile.n0 >= p.n) return;

  float acc[kGemmMTiles][kGemmNTiles][4];
  fill(acc, 0.0f);

  const int steps = ceil_div(p.k, kGemmBK);
  float4 a_next[kGemmALoads];
  QGemmBRegs<Format> b_next;
  gemm_load_a(p, tile.m0, 0, a_next);
  qgemm_load_b<Format>(m, p.n, tile.n0, 0, b_next);
  gemm_store_a(a_next, smem.a[0]);
  qgemm_store_b<Format>(b_next, smem.b[0]);
  __syncthreads();
  for (int step = 0; step < steps; ++step) {
    const int cur = step & 1;
    const bool has_next = step + 1 < steps;
    if (has_next) {  // in flight while the tensor cores work on this step
      gemm_load_a(p, tile.m0, (step + 1) * kGemmBK, a_next);
      qgemm_load_b<Format>(m, p.n, tile.n0, (step + 1) * kGemmBK, b_next);
    }
    gemm_compute(tile, smem.a[cur], smem.b[cur], acc);
    if (has_next) {  // the other buffer was last read in the previous step, before its barrier
      gemm_store_a(a_next, smem.a[cur ^ 1]);
      qgemm_store_b<Format>(b_next, smem.b[cur ^ 1]);
    }
    __syncthreads();
  }
  qgemm_apply_row_scale(qp, tile, acc);
  gemm_store_out(p, tile, acc);
}

}  // namespace atlas::quant
