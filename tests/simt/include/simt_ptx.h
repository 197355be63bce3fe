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

// A element (row, k) of the 16x16 tile: lane (row % 8) * 4 + (k % 8) / 2, register
// (row / 8) + 2 (k / 8), half k % 2.
inline float a_element(const unsigned char* all, int row, int k) {
  MmaOperands ops;
  std::memcpy(&ops, all + ((row % 8) * 4 + (k % 8) / 2) * simt::kExchangeBytes, sizeof ops);
  return bf16_half(ops.a[row / 8 + 2 * (k / 8)], k % 2);
}

// B element (k, n) of the 16x8 tile: lane n * 4 + (k % 8) / 2, register k / 8, half k % 2.
inline float b_element(const unsigned char* all, int k, int n) {
  MmaOperands ops;
  std::memcpy(&ops, all + (n * 4 + (k % 8) / 2) * simt::kExchangeBytes, sizeof ops);
  return bf16_half(ops.b[k / 8], k % 2);
}

}  // namespace simt_detail

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* ptr) { simt_detail::ldmatrix(r, ptr, false); }
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* ptr) {
  simt_detail::ldmatrix(r, ptr, true);
}

// d += a * b; lane l holds D elements (l / 4, 2 (l % 4) + {0, 1}) in d[0..1] and row + 8 in d[2..3].
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const simt_detail::MmaOperands mine{{a[0], a[1], a[2], a[3]}, {b0, b1}};
  const unsigned char* all = simt::warp_exchange(0xffffffffu, &mine, sizeof mine);
  const int lane = static_cast<int>(simt::lane_id());
  for (int i = 0; i < 4; ++i) {
    const int row = lane / 4 + 8 * (i / 2);
    const int col = 2 * (lane % 4) + i % 2;
    float sum = 0.0f;
    for (int k = 0; k < 16; ++k) sum += simt_detail::a_element(all, row, k) * simt_detail::b_element(all, k, col);
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
// Every read happens at issue, so the fences and the commit / wait pair have nothing to order.
__device__ __forceinline__ void wgmma_fence() {}
__device__ __forceinline__ void wgmma_commit() {}
__device__ __forceinline__ void wgmma_wait_all() {}
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

}  // namespace simt_detail

// d += A[64 x 16] @ B[128 x 16]^T. Warp w of the warpgroup holds D rows 16 w + lane / 4 (+ 8 for
// i % 4 >= 2), columns 8 (i / 4) + 2 (lane % 4) + i % 2 (the m16n8 C layout per 8 columns).
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[kWgmmaN128Accum], uint64_t desc_a, uint64_t desc_b) {
  const int lane = static_cast<int>(simt::lane_id());
  const int warp = static_cast<int>(threadIdx.x / 32) % 4;
  for (int i = 0; i < kWgmmaN128Accum; ++i) {
    const int row = 16 * warp + lane / 4 + 8 * ((i % 4) / 2);
    const int col = 8 * (i / 4) + 2 * (lane % 4) + i % 2;
    float sum = 0.0f;
    for (int k = 0; k < 16; ++k)
      sum += simt_detail::wgmma_operand(desc_a, row, k) * simt_detail::wgmma_operand(desc_b, col, k);
    d[i] += sum;
  }
}

}  // namespace atlas
