// Elementwise f32 ops, grid-stride loops: add, silu(gate) * up, x * sigmoid(gate); and the count of
// NaN / infinite values in a vector (one block).
#pragma once

#include "atlas/common.cuh"

namespace atlas {

__device__ __forceinline__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }
__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ void add(const AddParams& p) {
  const float* x = static_cast<const float*>(p.x);
  const float* y = static_cast<const float*>(p.y);
  float* out = static_cast<float*>(p.out);
  for (int64_t i = global_thread(); i < p.n; i += grid_stride()) out[i] = x[i] + y[i];
}

__device__ void silu_mul(const SiluMulParams& p) {
  const float* gate_up = static_cast<const float*>(p.gate_up);
  float* out = static_cast<float*>(p.out);
  const int64_t n = static_cast<int64_t>(p.rows) * p.width;
  for (int64_t i = global_thread(); i < n; i += grid_stride()) {
    const int64_t row = i / p.width;
    const int64_t col = i - row * p.width;
    const float* source = gate_up + row * 2 * p.width;
    out[i] = silu(source[col]) * source[p.width + col];
  }
}

__device__ void sigmoid_mul(const SigmoidMulParams& p) {
  const float* x = static_cast<const float*>(p.x);
  const float* gate = static_cast<const float*>(p.gate);
  float* out = static_cast<float*>(p.out);
  for (int64_t i = global_thread(); i < p.n; i += grid_stride()) out[i] = x[i] * sigmoid(gate[i]);
}

// One block (a prompt's last hidden row, checked once a prompt): out[0] is written whole, so it
// needs no zeroing first, and only that one int comes back to the host.
__device__ void nonfinite_count(const NonfiniteCountParams& p) {
  __shared__ float scratch_s[kWarpSize];
  const float* x = static_cast<const float*>(p.x);
  float mine = 0.0f;  // exact: a block counts far fewer than 2^24
  for (int64_t i = threadIdx.x; i < p.n; i += blockDim.x) mine += isfinite(x[i]) ? 0.0f : 1.0f;
  const float total = block_sum(mine, scratch_s);
  if (threadIdx.x == 0) *static_cast<int32_t*>(p.out) = static_cast<int32_t>(total);
}

}  // namespace atlas
