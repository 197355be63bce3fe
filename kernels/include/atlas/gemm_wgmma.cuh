// Prefill linear on Hopper (sm_90a only): out[M, N] f32 = x[M, K] f32 @ W[N, K]^T bf16 through
// warpgroup MMA (wgmma.mma_async m64n128k16, bf16 in, f32 accumulate in registers).
// Block: 2 warpgroups (256 threads), tile 128 x 128 x 64; warpgroup g owns rows 64g..64g+63 and
// all 128 columns. The operands wgmma reads are [128][64] bf16 tiles, K-major, in the 128-byte
// swizzle layout the matrix descriptors name (swizzle mode 1): row r of a tile is 128 bytes at
// r * 128, its 16-byte chunk c stored at chunk c ^ (r % 8); tiles start on 1024-byte boundaries so
// the hardware's swizzle (address bits [4:6] ^= bits [7:9]) matches.
// W tiles arrive by cp.async 16 B (zero-filled past N / K) into a ring of kWgmmaStages tiles,
// kWgmmaStages - 1 k-steps ahead. x tiles are read as f32 float4 into registers one k-step ahead
// (x rows are re-read by every block column, mostly from L2) and converted to bf16 when stored into
// the other of two A tiles, while the current step's wgmma chain runs.
// Handles any M and N; K % 8 == 0 (checked by the op wrapper). Dynamic shared memory:
// kWgmmaSmemBytes (the op wrapper asks for it; the extra 1024 B realign the base).
#pragma once

#include "atlas/common.cuh"
#include "atlas/gemm.cuh"

namespace atlas {

constexpr int kWgmmaBM = 128;
constexpr int kWgmmaBN = 128;
constexpr int kWgmmaBK = 64;  // one 128-byte swizzle row of bf16
constexpr int kWgmmaK = 16;   // k per wgmma instruction
constexpr int kWgmmaThreads = 256;
constexpr int kWgmmaStages = 6;  // W tiles in the cp.async ring
constexpr int kWgmmaGroupRows = 64;  // rows per warpgroup (the m of m64n128k16)
constexpr int kWgmmaRowBytes = kWgmmaBK * 2;
constexpr int kWgmmaTileBytes = kWgmmaBM * kWgmmaRowBytes;  // bf16 A and B tiles alike: 16 KiB
constexpr int kWgmmaStagesOffset = 2 * kWgmmaTileBytes;       // the W ring follows the two A tiles
constexpr int kWgmmaSmemBytes = kWgmmaStagesOffset + kWgmmaStages * kWgmmaTileBytes + 1024;
constexpr int kWgmmaSwizzleAtom = 8 * kWgmmaRowBytes;  // 1024 B: 8 rows, the descriptor's stride offset
constexpr int kWgmmaALoads = kWgmmaBM * kWgmmaBK / 4 / kWgmmaThreads;  // 16-byte x chunks (4 f32) per thread: 8
constexpr int kWgmmaBLoads = kWgmmaBN * kWgmmaBK / 8 / kWgmmaThreads;  // 16-byte W chunks per thread: 4
constexpr int kWgmmaAccum = kWgmmaBN / 2;  // f32 accumulators per thread: 64
static_assert(kWgmmaBN == kWgmmaBM, "A and B tiles share one size");
static_assert(kWgmmaAccum == kWgmmaN128Accum, "wgmma_m64n128k16 (ptx.cuh) holds 64 accumulators");
static_assert(kWgmmaSmemBytes <= 227 * 1024, "over the sm_90 opt-in shared memory per block");

// Byte offset of element (row, col) of a [rows][64] bf16 tile in the 128-byte swizzle layout.
__device__ __forceinline__ int wgmma_swizzled(int row, int col) {
  return row * kWgmmaRowBytes + (((col / 8) ^ (row % 8)) * 16) + (col % 8) * 2;
}

// Shared-memory matrix descriptor: start address >> 4 in bits 0-13, leading byte offset >> 4 in
// 16-29 (unused by a K-major swizzled operand whose k16 fits in one 128-byte row: 1 by
// convention), stride byte offset >> 4 in 32-45 (1024: the next 8-row group), base offset 0
// (atoms 1024-aligned), swizzle mode 1 (128 B) in bits 62-63.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t smem_byte_addr) {
  const uint64_t start = (smem_byte_addr & 0x3FFFF) >> 4;
  const uint64_t leading = 16 >> 4;
  const uint64_t stride = kWgmmaSwizzleAtom >> 4;
  return start | (leading << 16) | (stride << 32) | (1ull << 62);
}

struct WgmmaTile {
  int m0, n0;
};

// x tile rows m0.., cols k0.. -> registers (zeros past M / K).
__device__ __forceinline__ void wgmma_load_a(const LinearParams& p, int m0, int k0, float4 (&regs)[kWgmmaALoads]) {
  const float* x = static_cast<const float*>(p.x);
#pragma unroll
  for (int j = 0; j < kWgmmaALoads; ++j) {
    const int f = threadIdx.x + j * kWgmmaThreads;
    const int row = f / (kWgmmaBK / 4);
    const int col = (f % (kWgmmaBK / 4)) * 4;
    const bool valid = m0 + row < p.tokens && k0 + col < p.k;
    regs[j] = valid ? *reinterpret_cast<const float4*>(x + static_cast<int64_t>(m0 + row) * p.k + k0 + col)
                    : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

__device__ __forceinline__ void wgmma_store_a(const float4 (&regs)[kWgmmaALoads], uint8_t* a_tile) {
#pragma unroll
  for (int j = 0; j < kWgmmaALoads; ++j) {
    const int f = threadIdx.x + j * kWgmmaThreads;
    const int row = f / (kWgmmaBK / 4);
    const int col = (f % (kWgmmaBK / 4)) * 4;
    *reinterpret_cast<uint2*>(a_tile + wgmma_swizzled(row, col)) =
        make_uint2(pack_bf16x2(regs[j].x, regs[j].y), pack_bf16x2(regs[j].z, regs[j].w));
  }
}

__device__ __forceinline__ void wgmma_issue_b(const LinearParams& p, int n0, int k0, uint8_t* b_tile) {
  const uint16_t* weight = static_cast<const uint16_t*>(p.weight);
#pragma unroll
  for (int j = 0; j < kWgmmaBLoads; ++j) {
    const int c = threadIdx.x + j * kWgmmaThreads;
    const int row = c / (kWgmmaBK / 8);
    const int col = (c % (kWgmmaBK / 8)) * 8;
    const bool valid = n0 + row < p.n && k0 + col < p.k;
    const uint16_t* src = valid ? weight + static_cast<int64_t>(n0 + row) * p.k + k0 + col : weight;
    cp_async_16(b_tile + wgmma_swizzled(row, col), src, valid);
  }
}

// One k-step of this warpgroup: 4 chained wgmma over the step's 64 k, committed as one group.
__device__ __forceinline__ void wgmma_compute(uint32_t a_tile, uint32_t b_tile, float (&acc)[kWgmmaAccum]) {
  const uint32_t a_base = a_tile + (threadIdx.x / 128) * kWgmmaGroupRows * kWgmmaRowBytes;
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kWgmmaBK / kWgmmaK; ++ks)
    wgmma_m64n128k16(acc, wgmma_desc(a_base + ks * kWgmmaK * 2), wgmma_desc(b_tile + ks * kWgmmaK * 2));
  wgmma_commit();
}

// Accumulator i of warp w (of the warpgroup), lane l: row 16w + l/4 + 8*((i%4)/2),
// col 8*(i/4) + 2*(l%4) + i%2 (the wgmma D fragment: the m16n8 C layout per 8 columns).
// Pairs i, i+1 are adjacent columns: one 8-byte store when both are in range and N is even.
__device__ __forceinline__ void wgmma_store_out(const LinearParams& p, const WgmmaTile& tile,
                                                const float (&acc)[kWgmmaAccum]) {
  float* out = static_cast<float*>(p.out);
  const int lane = threadIdx.x % kWarpSize;
  const int row0 = tile.m0 + (threadIdx.x / 128) * kWgmmaGroupRows + ((threadIdx.x / kWarpSize) % 4) * 16 + lane / 4;
  const bool pairs = p.n % 2 == 0;
#pragma unroll
  for (int i = 0; i < kWgmmaAccum; i += 2) {
    const int row = row0 + 8 * ((i % 4) / 2);
    const int col = tile.n0 + 8 * (i / 4) + 2 * (lane % 4);
    if (row >= p.tokens) continue;
    float* dst = out + static_cast<int64_t>(row) * p.n + col;
    if (pairs && col + 1 < p.n) {
      *reinterpret_cast<float2*>(dst) = make_float2(acc[i], acc[i + 1]);
    } else {
      if (col < p.n) dst[0] = acc[i];
      if (col + 1 < p.n) dst[1] = acc[i + 1];
    }
  }
}

// Shared memory from the 1024-aligned base: A tiles 0 and 1, then the ring of kWgmmaStages W tiles
// (all bf16, swizzled).
struct WgmmaSmem {
  uint8_t* base;
  uint32_t addr;  // shared address of base

  __device__ uint8_t* a(int i) const { return base + i * kWgmmaTileBytes; }
  __device__ uint8_t* w(int step) const { return base + kWgmmaStagesOffset + (step % kWgmmaStages) * kWgmmaTileBytes; }
  __device__ uint32_t shared(const uint8_t* ptr) const { return addr + static_cast<uint32_t>(ptr - base); }
};

__device__ __forceinline__ WgmmaSmem wgmma_smem_layout() {
  ATLAS_DYNAMIC_SMEM(uint8_t, wgmma_smem);
  const uint32_t raw = smem_addr(wgmma_smem);
  const uint32_t aligned = (raw + 1023u) & ~1023u;
  return WgmmaSmem{wgmma_smem + (aligned - raw), aligned};
}

__device__ void gemm_wgmma(const LinearParams& p) {
  const WgmmaSmem smem = wgmma_smem_layout();
  const WgmmaTile tile{static_cast<int>(blockIdx.y) * kWgmmaBM, static_cast<int>(blockIdx.x) * kWgmmaBN};
  if (tile.m0 >= p.tokens || tile.n0 >= p.n) return;

  float acc[kWgmmaAccum];
  fill(acc, 0.0f);

  const int steps = ceil_div(p.k, kWgmmaBK);
#pragma unroll
  for (int s = 0; s < kWgmmaStages - 1; ++s) {  // one group per W tile, empty past the last step
    if (s < steps) wgmma_issue_b(p, tile.n0, s * kWgmmaBK, smem.w(s));
    cp_async_commit();
  }
  float4 a_next[kWgmmaALoads];
  wgmma_load_a(p, tile.m0, 0, a_next);
  wgmma_store_a(a_next, smem.a(0));
  if (steps > 1) wgmma_load_a(p, tile.m0, kWgmmaBK, a_next);
  cp_async_wait<kWgmmaStages - 2>();  // step 0's W copies (this thread's) have landed
  for (int step = 0; step < steps; ++step) {
    fence_proxy_async();  // generic-proxy writes (cp.async, A stores) -> visible to wgmma's async proxy
    __syncthreads();      // ... and to the other threads: step's A and W tiles are complete
    const int ahead = step + kWgmmaStages - 1;  // refills the W tile step - 1 used (its wgmma has finished)
    if (ahead < steps) wgmma_issue_b(p, tile.n0, ahead * kWgmmaBK, smem.w(ahead));
    cp_async_commit();
    wgmma_compute(smem.shared(smem.a(step & 1)), smem.shared(smem.w(step)), acc);
    // A tile (step + 1) & 1 was last read by step - 1's wgmma, finished before this step's barrier.
    if (step + 1 < steps) wgmma_store_a(a_next, smem.a((step + 1) & 1));
    if (step + 2 < steps) wgmma_load_a(p, tile.m0, (step + 2) * kWgmmaBK, a_next);
    cp_async_wait<kWgmmaStages - 2>();  // step + 1's W copies (this thread's) have landed
    wgmma_wait_all();
    wgmma_fence_operands(acc);
  }
  wgmma_store_out(p, tile, acc);
}

}  // namespace atlas
