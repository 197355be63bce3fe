// RMSNorm over the last dim, optionally fused with the residual add. One block per row.
//   rms_norm:      out = x * rsqrt(mean(x^2) + eps) * weight
//   add_rms_norm:  sum_out = x + residual; out = rms_norm(sum_out) * weight
// Two passes over the row: the second re-reads what this same thread read/wrote in the first
// (the same index set), so no extra barrier is needed between them.
#pragma once

#include "atlas/common.cuh"

namespace atlas {

template <bool kAddResidual>
__device__ void rms_norm_rows(const RmsNormParams& p) {
  __shared__ float scratch[kWarpSize];
  const int row = blockIdx.x;
  if (row >= p.rows) return;
  const int64_t base = static_cast<int64_t>(row) * p.dim;
  const float* x = static_cast<const float*>(p.x) + base;
  const float* residual = static_cast<const float*>(p.residual) + base;
  float* sum_out = static_cast<float*>(p.sum_out) + base;
  const float* weight = static_cast<const float*>(p.weight);
  float* out = static_cast<float*>(p.out) + base;

  float squares = 0.0f;
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x) {
    float v = x[i];
    if constexpr (kAddResidual) {
      v += residual[i];
      sum_out[i] = v;
    }
    squares += v * v;
  }
  const float total = block_sum(squares, scratch);
  const float inv_rms = rsqrtf(total / static_cast<float>(p.dim) + p.eps);
  const float* source = kAddResidual ? static_cast<const float*>(sum_out) : x;
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x)
    out[i] = source[i] * inv_rms * weight[i];
}

}  // namespace atlas
