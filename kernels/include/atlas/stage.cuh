// Staging activations from global into shared memory (the one-token bf16 GEMVs' x, the router's x,
// the MoE down GEMV's act rows, the quantized GEMVs' x rows above one token). A strided loop of
// loads and stores waits one memory round trip per iteration (its trip count is unknown to the
// compiler, so it stays rolled); cp.async issues all of a thread's 16-byte copies at once, without
// passing them through registers, so the staging costs one round trip however long.
#pragma once

#include "atlas/common.cuh"
#include "atlas/ptx.cuh"

namespace atlas {

struct IdentitySlot {
  __device__ __forceinline__ int operator()(int i) const { return i; }
};

// Rows of a staged block: `rows` source rows src_stride floats apart land dst_stride apart.
struct StageRows {
  int rows = 1;
  int dst_stride = 0;
  int64_t src_stride = 0;
};

// Issues the copy of n floats of each row: float4 i of a row to float4 slot(i) of its dst_s row
// (element e to 4 * slot(e / 4) + e % 4). By cp.async when src and src_stride allow 16-byte copies
// and n % 4 == 0 (dst_s and dst_stride must); otherwise element by element, done on return.
// Complete it with stage_wait() before any thread reads dst_s. One flat loop over all rows: a
// loop per row, unrolled over the rows, spilled in the 6-token GEMV on sm_121a.
template <class Slot = IdentitySlot>
__device__ __forceinline__ void stage_async(float* dst_s, const float* src, int n, StageRows shape = {},
                                            Slot slot = Slot{}) {
  if (n % 4 == 0 && shape.src_stride % 4 == 0 && (reinterpret_cast<uintptr_t>(src) & 15u) == 0) {
    const int vecs = n / 4;
#pragma unroll 1  // nothing to gain: a cp.async does not wait for its data
    for (int i = threadIdx.x; i < shape.rows * vecs; i += blockDim.x) {
      const int r = i / vecs;
      const int j = i - r * vecs;
      cp_async_16(reinterpret_cast<float4*>(dst_s + r * shape.dst_stride) + slot(j),
                  reinterpret_cast<const float4*>(src + r * shape.src_stride) + j, true);
    }
    return;
  }
  for (int i = threadIdx.x; i < shape.rows * n; i += blockDim.x) {
    const int r = i / n;
    const int e = i - r * n;
    dst_s[r * shape.dst_stride + 4 * slot(e / 4) + e % 4] = src[r * shape.src_stride + e];
  }
}

// Waits for this thread's staged copies, then for the block's (every thread calls it).
__device__ __forceinline__ void stage_wait() {
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
}

}  // namespace atlas
