// Prefill linear (tokens > 8): out[M, N] = x[M, K] (f32) @ W[N, K]^T (bf16), f32 accumulate/output.
// Tensor cores through mma.sync m16n8k16 (bf16 in, f32 accumulate; sm_80+). Block tile 64x128x32,
// 4 warps in a 2x2 layout, each warp 32x64 (2 x 8 mma tiles). Double-buffered shared memory:
// W tiles arrive by cp.async (16 B, zero-filled past N / K), x tiles are loaded as f32 into
// registers one step ahead and converted to bf16 when stored. Fragments come from ldmatrix;
// rows are padded by 8 bf16 (80-byte stride) so the 8 row addresses of ldmatrix hit distinct banks.
// Handles any M and N; K % 8 == 0 (checked by the op wrapper).
#pragma once

#include "atlas/common.cuh"
#include "atlas/ptx.cuh"

namespace atlas {

constexpr int kGemmBM = 64;
constexpr int kGemmBN = 128;
constexpr int kGemmBK = 32;
constexpr int kGemmPad = 8;
constexpr int kGemmStride = kGemmBK + kGemmPad;  // bf16 elements per smem row
constexpr int kGemmThreads = 128;
constexpr int kGemmWarpM = 32;
constexpr int kGemmWarpN = 64;
constexpr int kGemmMTiles = kGemmWarpM / 16;  // 2
constexpr int kGemmNTiles = kGemmWarpN / 8;   // 8
constexpr int kGemmALoads = kGemmBM * kGemmBK / 4 / kGemmThreads;  // float4 per thread: 4
constexpr int kGemmBLoads = kGemmBN * kGemmBK / 8 / kGemmThreads;  // 16-byte chunks per thread: 4

struct GemmSmem {
  uint16_t a[2][kGemmBM][kGemmStride];
  uint16_t b[2][kGemmBN][kGemmStride];
};

struct GemmTile {
  int m0, n0, warp_m, warp_n, lane;
};

// This block's output tile and this thread's warp (2 x 2 warps) and lane in it.
__device__ __forceinline__ GemmTile gemm_block_tile() {
  const int warp = threadIdx.x / kWarpSize;
  return GemmTile{static_cast<int>(blockIdx.y) * kGemmBM, static_cast<int>(blockIdx.x) * kGemmBN, warp / 2,
                  warp % 2, static_cast<int>(threadIdx.x % kWarpSize)};
}

// x tile rows m0.., cols k0.. -> registers (zeros past M / K).
__device__ __forceinline__ void gemm_load_a(const LinearParams& p, int m0, int k0, float4 (&regs)[kGemmALoads]) {
  const float* x = static_cast<const float*>(p.x);
#pragma unroll
  for (int j = 0; j < kGemmALoads; ++j) {
    const int f = threadIdx.x + j * kGemmThreads;
    const int row = f / (kGemmBK / 4);
    const int col = (f % (kGemmBK / 4)) * 4;
    const bool valid = m0 + row < p.tokens && k0 + col < p.k;
    regs[j] = valid ? *reinterpret_cast<const float4*>(x + static_cast<int64_t>(m0 + row) * p.k + k0 + col)
                    : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

__device__ __forceinline__ void gemm_store_a(const float4 (&regs)[kGemmALoads], uint16_t (&a)[kGemmBM][kGemmStride]) {
#pragma unroll
  for (int j = 0; j < kGemmALoads; ++j) {
    const int f = threadIdx.x + j * kGemmThreads;
    const int row = f / (kGemmBK / 4);
    const int col = (f % (kGemmBK / 4)) * 4;
    *reinterpret_cast<uint2*>(&a[row][col]) = make_uint2(pack_bf16x2(regs[j].x, regs[j].y), pack_bf16x2(regs[j].z, regs[j].w));
  }
}

__device__ __forceinline__ void gemm_issue_b(const LinearParams& p, int n0, int k0, uint16_t (&b)[kGemmBN][kGemmStride]) {
  const uint16_t* weight = static_cast<const uint16_t*>(p.weight);
#pragma unroll
  for (int j = 0; j < kGemmBLoads; ++j) {
    const int c = threadIdx.x + j * kGemmThreads;
    const int row = c / (kGemmBK / 8);
    const int col = (c % (kGemmBK / 8)) * 8;
    const bool valid = n0 + row < p.n && k0 + col < p.k;
    const uint16_t* src = valid ? weight + static_cast<int64_t>(n0 + row) * p.k + k0 + col : weight;
    cp_async_16(&b[row][col], src, valid);
  }
}

__device__ __forceinline__ void gemm_compute(const GemmTile& tile, const uint16_t (&a)[kGemmBM][kGemmStride],
                                             const uint16_t (&b)[kGemmBN][kGemmStride],
                                             float (&acc)[kGemmMTiles][kGemmNTiles][4]) {
  const int lane = tile.lane;
#pragma unroll
  for (int ks = 0; ks < kGemmBK; ks += 16) {
    uint32_t af[kGemmMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kGemmMTiles; ++mt)
      ldmatrix_x4(af[mt], &a[tile.warp_m * kGemmWarpM + mt * 16 + lane % 16][ks + (lane / 16) * 8]);
#pragma unroll
    for (int np = 0; np < kGemmNTiles / 2; ++np) {
      uint32_t bf[4];  // n-tile 2np: {bf[0], bf[1]}, n-tile 2np+1: {bf[2], bf[3]}
      ldmatrix_x4(bf, &b[tile.warp_n * kGemmWarpN + np * 16 + lane % 8 + (lane / 16) * 8][ks + ((lane / 8) % 2) * 8]);
#pragma unroll
      for (int mt = 0; mt < kGemmMTiles; ++mt) {
        mma_bf16_16816(acc[mt][2 * np], af[mt], bf[0], bf[1]);
        mma_bf16_16816(acc[mt][2 * np + 1], af[mt], bf[2], bf[3]);
      }
    }
  }
}

__device__ __forceinline__ void gemm_store_out(const LinearParams& p, const GemmTile& tile,
                                               const float (&acc)[kGemmMTiles][kGemmNTiles][4]) {
  float* out = static_cast<float*>(p.out);
#pragma unroll
  for (int mt = 0; mt < kGemmMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kGemmNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = tile.m0 + tile.warp_m * kGemmWarpM + mt * 16 + tile.lane / 4 + (e / 2) * 8;
        const int col = tile.n0 + tile.warp_n * kGemmWarpN + nt * 8 + (tile.lane % 4) * 2 + e % 2;
        if (row < p.tokens && col < p.n) out[static_cast<int64_t>(row) * p.n + col] = acc[mt][nt][e];
      }
}

__device__ void gemm_bf16(const LinearParams& p) {
  __shared__ __align__(128) GemmSmem smem;
  const GemmTile tile = gemm_block_tile();
  if (tile.m0 >= p.tokens || tile.n0 >= p.n) return;

  float acc[kGemmMTiles][kGemmNTiles][4];
  fill(acc, 0.0f);

  const int steps = ceil_div(p.k, kGemmBK);
  float4 a_next[kGemmALoads];
  gemm_load_a(p, tile.m0, 0, a_next);
  gemm_store_a(a_next, smem.a[0]);
  gemm_issue_b(p, tile.n0, 0, smem.b[0]);
  cp_async_commit();
  for (int step = 0; step < steps; ++step) {
    const int cur = step & 1;
    const bool has_next = step + 1 < steps;
    if (has_next) {
      gemm_load_a(p, tile.m0, (step + 1) * kGemmBK, a_next);
      gemm_issue_b(p, tile.n0, (step + 1) * kGemmBK, smem.b[cur ^ 1]);
    }
    cp_async_commit();
    cp_async_wait<1>();  // everything but the group just committed: this step's W tile has landed
    __syncthreads();
    gemm_compute(tile, smem.a[cur], smem.b[cur], acc);
    if (has_next) gemm_store_a(a_next, smem.a[cur ^ 1]);
    __syncthreads();
  }
  gemm_store_out(p, tile, acc);
}

}  // namespace atlas
