// kernels/include/atlas/ptx.cuh on the host (ATLAS_SIMT_HOST): the same calls, emulated per
// their PTX definitions. ldmatrix and mma.sync are warp collectives: every lane deposits its
// operands, then each lane computes its own part from all 32 deposits.
#pragma once

#include <cstdint>
#include <cstring>

namespace atlas {

__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  simt::async_copy(dst, src, valid ? 16 : 0);  // 0 source bytes: 16 zero bytes land
}
__device__ __forceinline__ void cp_async_commit() { simt::async_commit(); }
template <int Pending>
__device__ __forceinline__ void cp_async_wait() { simt::async_wait(Pending); }

namespace simt_detail {

inline uint16_t load_b16(const unsigned char* row, int column) {
  uint16_t value;
  std::memcpy(&value, row + 2 * column, 2);
  return value;
}

// Lane l supplies the row address of matrix l / 8, row l % 8. Without .trans lane l receives, of
// each matrix j, row l / 4, columns 2 (l % 4) and +1; with .trans, rows 2 (l % 4) and +1 of column l / 4.
inline void ldmatrix(uint32_t (&r)[4], const void* ptr, bool trans) {
  const unsigned char* all = simt::warp_exchange(0xffffffffu, &ptr, sizeof ptr);
  const int lane = static_cast<int>(simt::lane_id());
  for (int j = 0; j < 4; ++j) {
    const unsigned char* rows[8];
    for (int i = 0; i < 8; ++i) std::memcpy(&rows[i], all + (8 * j + i) * simt::kExchangeBytes, sizeof rows[i]);
    uint16_t lo, hi;
    if (trans) {
      lo = load_b16(rows[2 * (lane % 4)], lane / 4);
      hi = load_b16(rows[2 * (lane % 4) + 1], lane / 4);
    } else {
      lo = load_b16(rows[lane / 4], 2 * (lane % 4));
      hi = load_b16(rows[lane / 4], 2 * (lane % 4) + 1);
    }
    r[j] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
}

inline float bf16_half(uint32_t word, int half) {
  const uint32_t bits = half ? (word & 0xffff0000u) : (word << 16);
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

struct MmaOperands {
  uint32_t a[4];
  uint32_t b[2];
};

inline MmaOperands lane_operands(const unsigned char* all, int lane) {
  MmaOperands ops;
  std::memcpy(&ops, all + lane * simt::kExchangeBytes, sizeof ops);
  return ops;
}

// Row `row` of the 16x16 A tile: element k comes from lane (row % 8) * 4 + (k % 8) / 2, register
// (row / 8) + 2 (k / 8), half k % 2.
inline void a_row(const unsigned char* all, int row, float (&out)[16]) {
  for (int q = 0; q < 4; ++q) {
    const MmaOperands ops = lane_operands(all, (row % 8) * 4 + q);
    for (int high = 0; high < 2; ++high) {
      const uint32_t word = ops.a[row / 8 + 2 * high];
      out[8 * high + 2 * q] = bf16_half(word, 0);
      out[8 * high + 2 * q + 1] = bf16_half(word, 1);
    }
  }
}

// Column `n` of the 16x8 B tile: element k comes from lane n * 4 + (k % 8) / 2, register k / 8,
// half k % 2.
inline void b_column(const unsigned char* all, int n, float (&out)[16]) {
  for (int q = 0; q < 4; ++q) {
    const MmaOperands ops = lane_operands(all, n * 4 + q);
    for (int high = 0; high < 2; ++high) {
      out[8 * high + 2 * q] = bf16_half(ops.b[high], 0);
      out[8 * high + 2 * q + 1] = bf16_half(ops.b[high], 1);
    }
  }
}

}  // namespace simt_detail

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* ptr) { simt_detail::ldmatrix(r, ptr, false); }
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* ptr) {
  simt_detail::ldmatrix(r, ptr, true);
}

// d += a * b; lane l holds D elements (l / 4, 2 (l % 4) + {0, 1}) in d[0..1] and row + 8 in d[2..3].
// The lane's two A rows and two B columns are unpacked once; k is summed in order.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const simt_detail::MmaOperands mine{{a[0], a[1], a[2], a[3]}, {b0, b1}};
  const unsigned char* all = simt::warp_exchange(0xffffffffu, &mine, sizeof mine);
  const int lane = static_cast<int>(simt::lane_id());
  float rows[2][16], columns[2][16];
  for (int r = 0; r < 2; ++r) simt_detail::a_row(all, lane / 4 + 8 * r, rows[r]);
  for (int c = 0; c < 2; ++c) simt_detail::b_column(all, 2 * (lane % 4) + c, columns[c]);
  for (int i = 0; i < 4; ++i) {
    const float* row = rows[i / 2];
    const float* column = columns[i % 2];
    float sum = 0.0f;
    for (int k = 0; k < 16; ++k) sum += row[k] * column[k];
    d[i] += sum;
  }
}

}  // namespace atlas

namespace atlas {

// Shared-space addresses are offsets into the emulator's dynamic shared memory (the only shared
// memory the kernels take addresses of), so descriptors built from them decode back to pointers.
__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(static_cast<const unsigned char*>(ptr) -
                               static_cast<const unsigned char*>(simt::dynamic_smem()));
}

// ---- wgmma m64n128k16 (sm_90a), emulated per thread ----
// As on the GPU the operation is asynchronous: the operands are read at issue and again when the
// wait_group covering it performs it, and a difference fails the launch (shared memory a pending
// wgmma reads was written before its wait); the accumulators change only at that wait, so a read
// of them before it sees the old values.
__device__ __forceinline__ void wgmma_fence() { simt::mma_fence(); }
__device__ __forceinline__ void wgmma_commit() { simt::mma_commit(); }
__device__ __forceinline__ void wgmma_wait_all() { simt::mma_wait(0); }
__device__ __forceinline__ void fence_proxy_async() {}
__device__ __forceinline__ void wgmma_fence_operands(float (&)[kWgmmaN128Accum]) {}

namespace simt_detail {

// Element (row, k < 16) of a K-major bf16 operand named by a shared-memory matrix descriptor with
// the 128-byte swizzle: rows 128 bytes apart inside an 8-row group, groups `stride` bytes apart,
// then byte-address bits [4:6] ^= bits [7:9] (CUTLASS Swizzle<3, 4, 3>).
inline float wgmma_operand(uint64_t desc, int row, int k) {
  if ((desc >> 62) != 1) simt::fail("wgmma emulation: only the 128-byte swizzle (mode 1) is emulated");
  const uint32_t start = static_cast<uint32_t>(desc & 0x3fff) << 4;
  const uint32_t stride = static_cast<uint32_t>((desc >> 32) & 0x3fff) << 4;
  const uint32_t linear = start + (row / 8) * stride + (row % 8) * 128 + 2 * k;
  const uint32_t swizzled = linear ^ (((linear >> 7) & 7u) << 4);
  uint16_t bits;
  std::memcpy(&bits, static_cast<const unsigned char*>(simt::dynamic_smem()) + swizzled, 2);
  return bf16_half(bits, 0);
}

// The thread's 2 rows of A and 32 columns of B of one m64n128k16 (rows 16 w + lane / 4 (+ 8),
// columns 8 (c / 2) + 2 (lane % 4) + c % 2), k in order.
struct WgmmaOperands {
  float rows[2][16];
  float columns[kWgmmaN128Accum / 2][16];
};

inline WgmmaOperands wgmma_read(uint64_t desc_a, uint64_t desc_b, int warp, int lane) {
  WgmmaOperands ops;
  for (int k = 0; k < 16; ++k) {
    for (int r = 0; r < 2; ++r) ops.rows[r][k] = wgmma_operand(desc_a, 16 * warp + lane / 4 + 8 * r, k);
    for (int c = 0; c < kWgmmaN128Accum / 2; ++c)
      ops.columns[c][k] = wgmma_operand(desc_b, 8 * (c / 2) + 2 * (lane % 4) + c % 2, k);
  }
  return ops;
}

}  // namespace simt_detail

// d += A[64 x 16] @ B[128 x 16]^T. Warp w of the warpgroup holds D rows 16 w + lane / 4 (+ 8 for
// i % 4 >= 2), columns 8 (i / 4) + 2 (lane % 4) + i % 2 (the m16n8 C layout per 8 columns); k is
// summed in order.
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[kWgmmaN128Accum], uint64_t desc_a, uint64_t desc_b) {
  const int lane = static_cast<int>(simt::lane_id());
  const int warp = static_cast<int>(threadIdx.x / 32) % 4;
  const simt_detail::WgmmaOperands at_issue = simt_detail::wgmma_read(desc_a, desc_b, warp, lane);
  float* acc = d;
  simt::mma_issue([acc, desc_a, desc_b, warp, lane, at_issue]() {
    const simt_detail::WgmmaOperands ops = simt_detail::wgmma_read(desc_a, desc_b, warp, lane);
    if (std::memcmp(&ops, &at_issue, sizeof ops) != 0)
      simt::fail("shared memory a wgmma reads was written between its issue and its wgmma.wait_group");
    for (int i = 0; i < kWgmmaN128Accum; ++i) {
      const float* row = ops.rows[(i % 4) / 2];
      const float* column = ops.columns[2 * (i / 4) + i % 2];
      float sum = 0.0f;
      for (int k = 0; k < 16; ++k) sum += row[k] * column[k];
      acc[i] += sum;
    }
  });
}

}  // namespace atlas
