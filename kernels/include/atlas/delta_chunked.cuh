// Gated delta rule for prefill, chunked (WY / UT-transform form, chunks of kChunk = 64 tokens),
// the same math as the numpy reference's delta_rule_chunked; two launches:
//
// chunk_prep, grid (Hv, chunks), kPrepThreads: everything that does not need the running state,
//   all chunks in parallel. Per (head, chunk): q, k L2-normalised (q also scaled by Dk^-0.5),
//   g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), cum = prefix sum of g in the chunk
//   (padded tokens past T have q = k = v = 0, g = 0, beta = 0), and
//     A[i][j]   = beta_i (k_i . k_j) exp(cum_i - cum_j)   (j < i; the unit lower system I + A)
//     intra[i][j] = (q_i . k_j) exp(cum_i - cum_j)        (j <= i, zero above)
//     U = (I + A)^-1 (beta v),  W = (I + A)^-1 (beta k exp(cum))   by forward substitution,
//       one thread per column of [v | k] (the columns are independent);
//     q_decayed = q exp(cum), k_to_end = k exp(cum_last - cum), chunk_decay = exp(cum_last).
//   Decays are only ever exp of a difference cum_i - cum_j <= 0 or of cum <= 0: no overflow.
//   Dynamic smem: chunk_prep_smem_bytes(Dk) (above 48 KiB: the runtime raises the limit).
//
// chunk_scan, grid (Hv, Dv / kColsPerBlock), kThreads: walks the chunks in order with a block's
//   state columns in registers (the recurrent kernel's layout: column split over kKeyParts lanes).
//   Per chunk: v_new = U - W S;  out = q_decayed S + intra v_new  (S before the update);
//   S = S * chunk_decay + k_to_end^T v_new. Each operand tile is staged in shared memory in turn.
//
// Scratch (f32, per head and chunk, written by prep, read by scan): w [C, Dk], u [C, Dv],
// q_decayed [C, Dk], k_to_end [C, Dk], intra [C, C], chunk_decay [1]; index (h * chunks + n).
#pragma once

#include "atlas/common.cuh"
#include "atlas/delta_rule.cuh"

namespace atlas::delta_chunked {

using delta_rule::chain_sum;
using delta_rule::column_sum;
using delta_rule::kChains;
using delta_rule::kColsPerBlock;
using delta_rule::kColsPerWarp;
using delta_rule::kKeyParts;
using delta_rule::kL2Eps;
using delta_rule::kThreads;
using delta_rule::softplus;

constexpr int kChunk = 64;
constexpr int kPrepThreads = 256;
constexpr int kPrepWarps = kPrepThreads / kWarpSize;
constexpr int kPairsPerRow = kPrepThreads / kChunk;  // threads sharing one row i of A / intra
static_assert(kPairsPerRow * kChunk == kPrepThreads, "chunk_prep: threads must tile the chunk rows");

// Row strides (floats) padded by one so that rows read together fall in different banks.
__host__ __device__ constexpr int prep_row_stride(int dk) { return dk + 1; }
constexpr int kAStride = kChunk + 1;
__host__ __device__ constexpr int chunk_prep_smem_bytes(int dk) {
  return static_cast<int>(sizeof(float)) * (2 * kChunk * prep_row_stride(dk) + kChunk * kAStride + 2 * kChunk);
}

template <int Hk, int Hv, int Dk, int Dv>
__device__ __forceinline__ bool chunk_shape_matches(const GatedDeltaChunkParams& p) {
  return p.num_k_heads == Hk && p.num_v_heads == Hv && p.k_head_dim == Dk && p.v_head_dim == Dv &&
         p.num_chunks == ceil_div(p.num_tokens, kChunk);
}

__device__ __forceinline__ int64_t chunk_index(const GatedDeltaChunkParams& p, int h, int n) {
  return static_cast<int64_t>(h) * p.num_chunks + n;
}

struct PrepSmem {
  float* k;     // [C, Dk + 1] normalised k
  float* q;     // [C, Dk + 1] normalised, scaled q
  float* a;     // [C, C + 1] strictly lower system
  float* cum;   // [C] g, then its prefix sum
  float* beta;  // [C]
};

// Step 1: normalised q, k rows, g and beta of the chunk's tokens (zeros past T).
template <int Hk, int Hv, int Dk, int Dv>
__device__ __forceinline__ void prep_rows(const GatedDeltaChunkParams& p, int h, int t0, const PrepSmem& s) {
  static_assert(Dk % kWarpSize == 0, "chunk_prep: Dk must be a multiple of 32");
  constexpr int kPerLane = Dk / kWarpSize;
  constexpr int kRowWidth = 2 * Hk * Dk + Hv * Dv;
  constexpr int kS = prep_row_stride(Dk);
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int hk = h / (Hv / Hk);
  const float neg_A = -expf(static_cast<const float*>(p.A_log)[h]);
  const float dt_bias = static_cast<const float*>(p.dt_bias)[h];
  for (int i = warp; i < kChunk; i += kPrepWarps) {
    const int t = t0 + i;
    const bool valid = t < p.num_tokens;
    const float* row = static_cast<const float*>(p.mixed_qkv) + static_cast<int64_t>(valid ? t : 0) * kRowWidth;
    float qv[kPerLane];
    float kv[kPerLane];
    float qq = 0.0f;
    float kk = 0.0f;
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) {
      const int d = lane + kWarpSize * m;
      qv[m] = valid ? row[hk * Dk + d] : 0.0f;
      kv[m] = valid ? row[Hk * Dk + hk * Dk + d] : 0.0f;
      qq = fmaf(qv[m], qv[m], qq);
      kk = fmaf(kv[m], kv[m], kk);
    }
    const float q_scale = rsqrtf(warp_sum(qq) + kL2Eps) * rsqrtf(static_cast<float>(Dk));
    const float k_scale = rsqrtf(warp_sum(kk) + kL2Eps);
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) {
      s.q[i * kS + lane + kWarpSize * m] = qv[m] * q_scale;
      s.k[i * kS + lane + kWarpSize * m] = kv[m] * k_scale;
    }
    if (lane == 0) {
      const int64_t at = static_cast<int64_t>(valid ? t : 0) * Hv + h;
      s.cum[i] = valid ? neg_A * softplus(static_cast<const float*>(p.a)[at] + dt_bias) : 0.0f;
      s.beta[i] = valid ? sigmoid(static_cast<const float*>(p.b)[at]) : 0.0f;
    }
  }
}

// Step 2: A (to smem) and intra (to global), kPairsPerRow threads per row i.
template <int Dk>
__device__ __forceinline__ void prep_pairs(float* intra, const PrepSmem& s) {
  constexpr int kS = prep_row_stride(Dk);
  const int i = threadIdx.x / kPairsPerRow;
  for (int j = threadIdx.x % kPairsPerRow; j < kChunk; j += kPairsPerRow) {
    float a_ij = 0.0f;
    float intra_ij = 0.0f;
    if (j <= i) {
      float kdot = 0.0f;
      float qdot = 0.0f;
#pragma unroll 8
      for (int d = 0; d < Dk; ++d) {
        const float kj = s.k[j * kS + d];
        kdot = fmaf(s.k[i * kS + d], kj, kdot);
        qdot = fmaf(s.q[i * kS + d], kj, qdot);
      }
      const float decay = expf(s.cum[i] - s.cum[j]);
      a_ij = j < i ? s.beta[i] * kdot * decay : 0.0f;
      intra_ij = qdot * decay;
    }
    s.a[i * kAStride + j] = a_ij;
    intra[i * kChunk + j] = intra_ij;
  }
}

// Step 3: forward substitution (I + A) X = rhs for every column of [beta v | beta k exp(cum)].
template <int Hk, int Hv, int Dk, int Dv>
__device__ __forceinline__ void prep_solve(const GatedDeltaChunkParams& p, int h, int t0, float* u, float* w,
                                           const PrepSmem& s) {
  constexpr int kRowWidth = 2 * Hk * Dk + Hv * Dv;
  constexpr int kS = prep_row_stride(Dk);
  const float* mixed = static_cast<const float*>(p.mixed_qkv);
  for (int col = threadIdx.x; col < Dv + Dk; col += kPrepThreads) {
    const bool is_v = col < Dv;
    float x[kChunk];
#pragma unroll
    for (int r = 0; r < kChunk; ++r) {
      float rhs;
      if (is_v) {
        const int t = t0 + r;
        rhs = t < p.num_tokens ? mixed[static_cast<int64_t>(t) * kRowWidth + 2 * Hk * Dk + h * Dv + col] * s.beta[r] : 0.0f;
      } else {
        rhs = s.k[r * kS + col - Dv] * s.beta[r] * expf(s.cum[r]);
      }
#pragma unroll
      for (int j = 0; j < r; ++j) rhs = fmaf(-s.a[r * kAStride + j], x[j], rhs);
      x[r] = rhs;
    }
#pragma unroll
    for (int r = 0; r < kChunk; ++r) {
      if (is_v) u[r * Dv + col] = x[r];
      else w[r * Dk + col - Dv] = x[r];
    }
  }
}

template <int Hk, int Hv, int Dk, int Dv>
__device__ void chunk_prep(const GatedDeltaChunkParams& p) {
  if (!chunk_shape_matches<Hk, Hv, Dk, Dv>(p) || blockDim.x != kPrepThreads) return;
  const int h = blockIdx.x;
  const int n = blockIdx.y;
  if (h >= Hv || n >= p.num_chunks) return;
  ATLAS_DYNAMIC_SMEM(float, prep_s);
  constexpr int kS = prep_row_stride(Dk);
  const PrepSmem s{prep_s, prep_s + kChunk * kS, prep_s + 2 * kChunk * kS, prep_s + 2 * kChunk * kS + kChunk * kAStride,
                   prep_s + 2 * kChunk * kS + kChunk * kAStride + kChunk};
  const int t0 = n * kChunk;
  const int64_t chunk = chunk_index(p, h, n);

  prep_rows<Hk, Hv, Dk, Dv>(p, h, t0, s);
  __syncthreads();
  if (threadIdx.x == 0) {
    float running = 0.0f;  // sequential, like np.cumsum
    for (int i = 0; i < kChunk; ++i) s.cum[i] = running += s.cum[i];
  }
  __syncthreads();
  prep_pairs<Dk>(static_cast<float*>(p.intra) + chunk * kChunk * kChunk, s);
  __syncthreads();
  prep_solve<Hk, Hv, Dk, Dv>(p, h, t0, static_cast<float*>(p.u) + chunk * kChunk * Dv,
                             static_cast<float*>(p.w) + chunk * kChunk * Dk, s);

  float* q_decayed = static_cast<float*>(p.q_decayed) + chunk * kChunk * Dk;
  float* k_to_end = static_cast<float*>(p.k_to_end) + chunk * kChunk * Dk;
  const float last = s.cum[kChunk - 1];
  for (int idx = threadIdx.x; idx < kChunk * Dk; idx += kPrepThreads) {
    const int r = idx / Dk;
    const int d = idx - r * Dk;
    q_decayed[idx] = s.q[r * kS + d] * expf(s.cum[r]);
    k_to_end[idx] = s.k[r * kS + d] * expf(last - s.cum[r]);
  }
  if (threadIdx.x == 0) static_cast<float*>(p.chunk_decay)[chunk] = expf(last);
}

// Copies `count` floats (a multiple of 4, 16-byte aligned) into smem, between two barriers: the
// first lets every thread finish reading the previous tile, the second publishes this one.
__device__ __forceinline__ void stage(const float* src, float* dst, int count) {
  __syncthreads();
  for (int i = threadIdx.x; i < count / 4; i += blockDim.x)
    reinterpret_cast<float4*>(dst)[i] = reinterpret_cast<const float4*>(src)[i];
  __syncthreads();
}

// (tile^T-free) column dot: sum over this thread's rows i of S[i][col] * tile[t][i].
template <int kRows>
__device__ __forceinline__ float rows_dot(const float (&s)[kRows], const float* tile_row, int part) {
  float partial[kChains] = {};
#pragma unroll
  for (int r = 0; r < kRows; ++r)
    partial[r % kChains] = fmaf(s[r], tile_row[part + kKeyParts * r], partial[r % kChains]);
  return column_sum(chain_sum(partial));
}

template <int Hk, int Hv, int Dk, int Dv>
__device__ void chunk_scan(const GatedDeltaChunkParams& p) {
  static_assert(Dk % (kKeyParts * kChains) == 0, "chunk_scan: Dk must be a multiple of 16");
  static_assert(Dv % kColsPerBlock == 0, "chunk_scan: Dv must be a multiple of kColsPerBlock");
  constexpr int kRows = Dk / kKeyParts;
  constexpr int kTokensPerPart = kChunk / kKeyParts;
  if (!chunk_shape_matches<Hk, Hv, Dk, Dv>(p) || blockDim.x != kThreads) return;
  const int h = blockIdx.x;
  if (h >= Hv || blockIdx.y >= Dv / kColsPerBlock) return;

  __shared__ __align__(16) float stage_s[kChunk * (Dk > kChunk ? Dk : kChunk)];
  __shared__ float v_new_s[kChunk][kColsPerBlock];
  const int lane = threadIdx.x % kWarpSize;
  const int part = lane / kColsPerWarp;
  const int local_col = (threadIdx.x / kWarpSize) * kColsPerWarp + lane % kColsPerWarp;
  const int col = blockIdx.y * kColsPerBlock + local_col;

  float* state = static_cast<float*>(p.state) + static_cast<int64_t>(h) * Dk * Dv + col;
  float s[kRows];  // s[r] = S[part + kKeyParts * r][col]
#pragma unroll
  for (int r = 0; r < kRows; ++r) s[r] = state[(part + kKeyParts * r) * Dv];

  float* out = static_cast<float*>(p.out);
  for (int n = 0; n < p.num_chunks; ++n) {
    const int64_t chunk = chunk_index(p, h, n);
    const int t0 = n * kChunk;

    stage(static_cast<const float*>(p.w) + chunk * kChunk * Dk, stage_s, kChunk * Dk);
    const float* u = static_cast<const float*>(p.u) + chunk * kChunk * Dv;
    for (int t = 0; t < kChunk; ++t) {
      const float ws = rows_dot<kRows>(s, stage_s + t * Dk, part);
      if (part == 0) v_new_s[t][local_col] = u[t * Dv + col] - ws;
    }

    stage(static_cast<const float*>(p.q_decayed) + chunk * kChunk * Dk, stage_s, kChunk * Dk);
    float out_r[kTokensPerPart];  // this thread's tokens t = part + kKeyParts * i
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      const float qs = rows_dot<kRows>(s, stage_s + t * Dk, part);
      if (t % kKeyParts == part) out_r[t / kKeyParts] = qs;
    }

    stage(static_cast<const float*>(p.intra) + chunk * kChunk * kChunk, stage_s, kChunk * kChunk);
#pragma unroll
    for (int i = 0; i < kTokensPerPart; ++i) {
      const int t = part + kKeyParts * i;
      float acc[kChains] = {out_r[i], 0.0f, 0.0f, 0.0f};
#pragma unroll 8
      for (int j = 0; j < kChunk; ++j) acc[j % kChains] = fmaf(stage_s[t * kChunk + j], v_new_s[j][local_col], acc[j % kChains]);
      if (t0 + t < p.num_tokens) out[(static_cast<int64_t>(t0 + t) * Hv + h) * Dv + col] = chain_sum(acc);
    }

    stage(static_cast<const float*>(p.k_to_end) + chunk * kChunk * Dk, stage_s, kChunk * Dk);
    const float decay = static_cast<const float*>(p.chunk_decay)[chunk];
#pragma unroll
    for (int r = 0; r < kRows; ++r) s[r] *= decay;
    for (int t = 0; t < kChunk; ++t) {
      const float v = v_new_s[t][local_col];
#pragma unroll
      for (int r = 0; r < kRows; ++r) s[r] = fmaf(stage_s[t * Dk + part + kKeyParts * r], v, s[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) state[(part + kKeyParts * r) * Dv] = s[r];
}

}  // namespace atlas::delta_chunked
