// Mixture-of-experts kernels.
//
// Decode (few tokens): two GEMV launches over the (token, slot) pairs, dims compile-time so each
// warp issues all its weight loads at once. moe_gate_up_gemv: one warp per intermediate row i of
// one slot, act[s, i] = silu(gate[e][i] . x) * (up[e][i] . x). moe_down_gemv: one warp per output
// feature n of one token, loading the k experts' rows together and summing the slots in slot
// order inside the warp (weight * row dot): deterministic without atomics.
//
// Prefill: moe_route builds per-expert slot lists on the device (counts, offsets, perm), then the
// grouped GEMM runs all experts in one launch, grid (N tiles, M tiles sized for T, E): a block
// serves M tiles blockIdx.y, blockIdx.y + gridDim.y, ... of its expert and exits at once when its
// first tile starts past the expert's count. A rows are gathered (x rows by token, or the
// expert-major act rows) and converted f32 -> bf16 while staged; mma.sync m16n8k16 bf16 with f32
// accumulators. The gate_up pass fuses silu_mul (each warp holds matching gate and up columns);
// the down pass writes per-slot rows y[s] scaled by the routing weight (y zero-initialised by the
// caller), and moe_combine sums each token's k slot rows in slot order: deterministic. The next K
// step's global loads are held in registers while the current step runs (register double buffer).
#pragma once

#include "atlas/common.cuh"
#include "atlas/ptx.cuh"
#include "atlas/row_dot.cuh"
#include "atlas/stage.cuh"

namespace atlas::moe {

using gemv_row::RowChunks;
using gemv_row::dot_row;
using gemv_row::load_row;
using gemv_row::zero_row;

constexpr int kGemvWarps = 8;
constexpr int kGemvThreads = kGemvWarps * kWarpSize;
constexpr int kRouteThreads = 1024;
constexpr int kElementwiseThreads = 256;

// Grouped GEMM tile: 64 x 64 outputs (gate_up: 32 act columns = 32 gate + 32 up weight rows),
// K step 32, 4 warps in 2 x 2, each 32 x 32 (2 m16 x 4 n8 mma tiles).
constexpr int kBM = 64;
constexpr int kBN = 64;
constexpr int kBK = 32;
constexpr int kStride = kBK + 8;  // bf16 per smem row: the pad makes fragment loads conflict-free
constexpr int kGemmThreads = 128;
constexpr int kWarpTile = 32;
constexpr int kGateUpCols = kBN / 2;  // act columns per gate_up block

__device__ __forceinline__ bool valid_expert(int e, int num_experts) { return e >= 0 && e < num_experts; }

// With p.prefetch_down: block (x, slot) pulls its share of the slot's expert's down rows into L2,
// rows [x * ceil(H / gridDim.x), ...), one contiguous span, after its own weight loads are issued:
// the down GEMV launched next then streams from L2 instead of starting from DRAM.
template <int H, int I>
__device__ __forceinline__ void prefetch_down_share(const MoeGateUpGemvParams& p, int e) {
  if (!p.prefetch_down || threadIdx.x != 0 || !valid_expert(e, p.num_experts)) return;
  const int rows = ceil_div(H, static_cast<int>(gridDim.x));
  const int row0 = static_cast<int>(blockIdx.x) * rows;
  const int count = min(rows, H - row0);
  if (count <= 0) return;
  const uint16_t* down = static_cast<const uint16_t*>(p.down) + (static_cast<int64_t>(e) * H + row0) * I;
  prefetch_l2(down, static_cast<uint32_t>(count) * I * 2u);
}

template <int H, int I>
__device__ void moe_gate_up_gemv(const MoeGateUpGemvParams& p) {
  if (blockDim.x != kGemvThreads || p.hidden != H || p.inter != I || p.top_k <= 0) return;
  const int slot = blockIdx.y;
  if (slot >= p.num_slots) return;
  const int lane = threadIdx.x % kWarpSize;
  const int row = blockIdx.x * kGemvWarps + threadIdx.x / kWarpSize;
  const int e = static_cast<const int32_t*>(p.ids)[slot];
  const bool valid = row < I && valid_expert(e, p.num_experts);
  RowChunks<H> gate;  // weight loads issued before x is staged, to overlap the two
  RowChunks<H> up;
  if (valid) {
    const uint16_t* gate_row = static_cast<const uint16_t*>(p.gate_up) + (static_cast<int64_t>(e) * 2 * I + row) * H;
    load_row<H>(gate_row, lane, gate);
    load_row<H>(gate_row + static_cast<int64_t>(I) * H, lane, up);
  } else {
    zero_row<H>(gate);
    zero_row<H>(up);
  }
  prefetch_down_share<H, I>(p, e);
  __shared__ __align__(16) float x_s[H];
  const float* x = static_cast<const float*>(p.x) + static_cast<int64_t>(slot / p.top_k) * H;
  // A plain loop, not stage_async: its two round trips go to L2 (the RMSNorm just wrote x) while
  // the rows come from DRAM, and cp.async took 86 registers on sm_90a (2 blocks per SM, not 3).
  for (int i = threadIdx.x; i < H; i += kGemvThreads) x_s[i] = x[i];
  __syncthreads();
  if (row >= I) return;
  const float g = warp_sum(dot_row<H>(gate, x_s, lane));
  const float u = warp_sum(dot_row<H>(up, x_s, lane));
  if (lane == 0) static_cast<float*>(p.act)[static_cast<int64_t>(slot) * I + row] = valid ? silu(g) * u : 0.0f;
}

// Enters through pdl_enter itself, after its ids, routing weights and weight rows are loaded:
// under programmatic launch those loads overlap the gate_up kernel before it. The ids and routing
// weights are safe to read before the wait although a kernel wrote them: that kernel ran before
// gate_up (which reads the ids too), and gate_up's blocks let this one launch only after their
// own wait, so it had finished before this launch. act, gate_up's output, is read after the wait.
template <int H, int I, int kTopK>
__device__ void moe_down_gemv(const MoeDownGemvParams& p) {
  if (blockDim.x != kGemvThreads || p.hidden != H || p.inter != I || p.top_k != kTopK) return;
  const int t = blockIdx.y;
  if (t >= p.num_tokens) return;
  const int lane = threadIdx.x % kWarpSize;
  const int n = blockIdx.x * kGemvWarps + threadIdx.x / kWarpSize;
  const int32_t* ids = static_cast<const int32_t*>(p.ids) + static_cast<int64_t>(t) * kTopK;
  const float* weights = static_cast<const float*>(p.weights) + static_cast<int64_t>(t) * kTopK;
  int experts[kTopK];
  float routed[kTopK];
#pragma unroll
  for (int j = 0; j < kTopK; ++j) {  // every slot's id at once: each slot's row loads branch on its id
    experts[j] = ids[j];
    routed[j] = weights[j];
  }
  RowChunks<I> rows[kTopK];  // weight loads issued before act is staged, to overlap the two
  float slot_weight[kTopK];
#pragma unroll
  for (int j = 0; j < kTopK; ++j) {
    const int e = experts[j];
    const bool valid = n < H && valid_expert(e, p.num_experts);
    slot_weight[j] = valid ? routed[j] : 0.0f;
    if (valid) load_row<I>(static_cast<const uint16_t*>(p.down) + (static_cast<int64_t>(e) * H + n) * I, lane, rows[j]);
    else zero_row<I>(rows[j]);
  }
  pdl_enter();
  __shared__ __align__(16) float act_s[kTopK * I];
  const float* act = static_cast<const float*>(p.act) + static_cast<int64_t>(t) * kTopK * I;
  stage_async(act_s, act, kTopK * I);
  stage_wait();
  if (n >= H) return;
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < kTopK; ++j) acc = fmaf(slot_weight[j], dot_row<I>(rows[j], act_s + j * I, lane), acc);
  acc = warp_sum(acc);
  if (lane == 0) static_cast<float*>(p.out)[static_cast<int64_t>(t) * H + n] = acc;
}

// One block. Dynamic smem: 2 * num_experts ints. Slots with an invalid id are left out of every
// list; the order inside a list is arbitrary (atomics) and does not change any result, since each
// output row is computed on its own.
__device__ void moe_route(const MoeRouteParams& p) {
  if (blockDim.x != kRouteThreads || blockIdx.x != 0) return;
  ATLAS_DYNAMIC_SMEM(int, route_s);
  const int E = p.num_experts;
  int* count_s = route_s;
  int* cursor_s = route_s + E;
  const int32_t* ids = static_cast<const int32_t*>(p.ids);
  for (int e = threadIdx.x; e < E; e += kRouteThreads) count_s[e] = 0;
  __syncthreads();
  for (int s = threadIdx.x; s < p.num_slots; s += kRouteThreads) {
    const int e = ids[s];
    if (valid_expert(e, E)) atomicAdd(&count_s[e], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t* counts = static_cast<int32_t*>(p.counts);
    int32_t* offsets = static_cast<int32_t*>(p.offsets);
    int running = 0;
    for (int e = 0; e < E; ++e) {
      cursor_s[e] = running;
      offsets[e] = running;
      counts[e] = count_s[e];
      running += count_s[e];
    }
    offsets[E] = running;
  }
  __syncthreads();
  int32_t* perm = static_cast<int32_t*>(p.perm);
  for (int s = threadIdx.x; s < p.num_slots; s += kRouteThreads) {
    const int e = ids[s];
    if (valid_expert(e, E)) perm[atomicAdd(&cursor_s[e], 1)] = s;
  }
}

using TileRow = uint16_t[kStride];

// Output column and weight row (within the expert) of B smem row r. gate_up: each warp's 32 rows
// are 16 gate rows then the 16 up rows of the same act columns.
template <bool kGateUp>
__device__ __forceinline__ int b_tile_column(int n0, int r) {
  if constexpr (kGateUp) return n0 + (r / kWarpTile) * (kWarpTile / 2) + r % (kWarpTile / 2);
  return n0 + r;
}

// One K step of A and B held in registers between the global load and the smem store, so the next
// step's loads are in flight while the current one runs on the tensor cores.
constexpr int kAChunksPerRow = kBK / 4;  // float4 per A row
constexpr int kBChunksPerRow = kBK / 8;  // 8 bf16 per B row
constexpr int kAChunks = kBM * kAChunksPerRow / kGemmThreads;
constexpr int kBChunks = kBN * kBChunksPerRow / kGemmThreads;
static_assert(kAChunks * kGemmThreads == kBM * kAChunksPerRow, "A tile must split evenly over the threads");
static_assert(kBChunks * kGemmThreads == kBN * kBChunksPerRow, "B tile must split evenly over the threads");

struct StageRegs {
  float4 a[kAChunks];
  uint4 b[kBChunks];
};

// A rows a_row_s[r] (-1: zero row) of f32; B rows of the expert's bf16 weight. Zero past K / N.
template <bool kGateUp>
__device__ __forceinline__ void load_stage(const MoeGroupedGemmParams& p, const int* a_row_s, int e, int n0, int k0,
                                           StageRegs& regs) {
  const float* a = static_cast<const float*>(p.a);
#pragma unroll
  for (int i = 0; i < kAChunks; ++i) {
    const int idx = threadIdx.x + i * kGemmThreads;
    const int r = idx / kAChunksPerRow;
    const int k = k0 + (idx % kAChunksPerRow) * 4;
    const int src = a_row_s[r];
    regs.a[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (src >= 0 && k + 4 <= p.k_in) regs.a[i] = *reinterpret_cast<const float4*>(a + static_cast<int64_t>(src) * p.k_in + k);
  }
  const uint16_t* w = static_cast<const uint16_t*>(p.weight);
  const int64_t rows_per_expert = kGateUp ? 2 * static_cast<int64_t>(p.n_out) : p.n_out;
#pragma unroll
  for (int i = 0; i < kBChunks; ++i) {
    const int idx = threadIdx.x + i * kGemmThreads;
    const int r = idx / kBChunksPerRow;
    const int k = k0 + (idx % kBChunksPerRow) * 8;
    const int col = b_tile_column<kGateUp>(n0, r);
    const bool up_half = kGateUp && (r % kWarpTile) >= kWarpTile / 2;
    const int64_t w_row = static_cast<int64_t>(e) * rows_per_expert + col + (up_half ? p.n_out : 0);
    regs.b[i] = make_uint4(0u, 0u, 0u, 0u);
    if (col < p.n_out && k + 8 <= p.k_in) regs.b[i] = __ldg(reinterpret_cast<const uint4*>(w + w_row * p.k_in + k));
  }
}

// A converted f32 -> bf16 here.
__device__ __forceinline__ void store_stage(const StageRegs& regs, TileRow* a_s, TileRow* b_s) {
#pragma unroll
  for (int i = 0; i < kAChunks; ++i) {
    const int idx = threadIdx.x + i * kGemmThreads;
    const float4 v = regs.a[i];
    *reinterpret_cast<uint2*>(&a_s[idx / kAChunksPerRow][(idx % kAChunksPerRow) * 4]) =
        make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
  }
#pragma unroll
  for (int i = 0; i < kBChunks; ++i) {
    const int idx = threadIdx.x + i * kGemmThreads;
    *reinterpret_cast<uint4*>(&b_s[idx / kBChunksPerRow][(idx % kBChunksPerRow) * 8]) = regs.b[i];
  }
}

__device__ __forceinline__ uint32_t smem_word(const TileRow* tile, int row, int col) {
  return *reinterpret_cast<const uint32_t*>(&tile[row][col]);
}

// acc[mi][nj]: the warp's m16 tile mi x n8 tile nj (fragment layout of mma.m16n8k16).
__device__ __forceinline__ void mma_tile(const TileRow* a_s, const TileRow* b_s, float (&acc)[2][4][4]) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int row0 = (warp / 2) * kWarpTile + lane / 4;
  const int col0 = (warp % 2) * kWarpTile + lane / 4;
  const int k_lane = (lane % 4) * 2;
#pragma unroll
  for (int kk = 0; kk < kBK; kk += 16) {
    uint32_t a[2][4];
    uint32_t b[4][2];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      const int r = row0 + mi * 16;
      a[mi][0] = smem_word(a_s, r, kk + k_lane);
      a[mi][1] = smem_word(a_s, r + 8, kk + k_lane);
      a[mi][2] = smem_word(a_s, r, kk + k_lane + 8);
      a[mi][3] = smem_word(a_s, r + 8, kk + k_lane + 8);
    }
#pragma unroll
    for (int nj = 0; nj < 4; ++nj) {
      b[nj][0] = smem_word(b_s, col0 + nj * 8, kk + k_lane);
      b[nj][1] = smem_word(b_s, col0 + nj * 8, kk + k_lane + 8);
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int nj = 0; nj < 4; ++nj) mma_bf16_16816(acc[mi][nj], a[mi], b[nj][0], b[nj][1]);
  }
}

struct TileRows {
  int a_row[kBM];  // source row of A per tile row, -1 past the expert's count
  int slot[kBM];   // slot per tile row, -1 past the count
};

template <bool kGateUp>
__device__ void store_tile(const MoeGroupedGemmParams& p, const TileRows& rows, int first, int m0, int n0,
                           const float (&acc)[2][4][4]) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  float* out = static_cast<float*>(p.out);
  const float* route_weights = static_cast<const float*>(p.route_weights);
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = (warp / 2) * kWarpTile + mi * 16 + half * 8 + lane / 4;
      const int slot = rows.slot[r];
      if (slot < 0) continue;
      if constexpr (kGateUp) {
        float* out_row = out + static_cast<int64_t>(first + m0 + r) * p.n_out;
#pragma unroll
        for (int nj = 0; nj < 2; ++nj)
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            const int col = n0 + (warp % 2) * (kWarpTile / 2) + nj * 8 + (lane % 4) * 2 + q;
            if (col < p.n_out) out_row[col] = silu(acc[mi][nj][half * 2 + q]) * acc[mi][nj + 2][half * 2 + q];
          }
      } else {
        float* out_row = out + static_cast<int64_t>(slot) * p.n_out;
        const float weight = route_weights[slot];
#pragma unroll
        for (int nj = 0; nj < 4; ++nj)
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            const int col = n0 + (warp % 2) * kWarpTile + nj * 8 + (lane % 4) * 2 + q;
            if (col < p.n_out) out_row[col] = weight * acc[mi][nj][half * 2 + q];
          }
      }
    }
}

template <bool kGateUp>
__device__ void moe_grouped_gemm(const MoeGroupedGemmParams& p) {
  if (blockDim.x != kGemmThreads || p.k_in % 8 != 0 || p.top_k <= 0) return;
  const int e = blockIdx.z;
  if (e >= p.num_experts) return;
  const int count = static_cast<const int32_t*>(p.counts)[e];
  const int first = static_cast<const int32_t*>(p.offsets)[e];
  const int n0 = blockIdx.x * (kGateUp ? kGateUpCols : kBN);
  if (n0 >= p.n_out) return;

  __shared__ __align__(16) uint16_t a_s[kBM][kStride];
  __shared__ __align__(16) uint16_t b_s[kBN][kStride];
  __shared__ TileRows rows;
  const int32_t* perm = static_cast<const int32_t*>(p.perm);
  for (int m0 = blockIdx.y * kBM; m0 < count; m0 += gridDim.y * kBM) {
    __syncthreads();  // the previous tile's epilogue is done with `rows`
    if (threadIdx.x < kBM) {
      const int m = m0 + threadIdx.x;
      const int slot = m < count ? perm[first + m] : -1;
      rows.slot[threadIdx.x] = slot;
      rows.a_row[threadIdx.x] = slot < 0 ? -1 : (kGateUp ? slot / p.top_k : first + m);
    }
    __syncthreads();
    float acc[2][4][4] = {};
    StageRegs regs;
    load_stage<kGateUp>(p, rows.a_row, e, n0, 0, regs);
    for (int k0 = 0; k0 < p.k_in; k0 += kBK) {
      store_stage(regs, a_s, b_s);
      __syncthreads();
      if (k0 + kBK < p.k_in) load_stage<kGateUp>(p, rows.a_row, e, n0, k0 + kBK, regs);
      mma_tile(a_s, b_s, acc);
      __syncthreads();
    }
    store_tile<kGateUp>(p, rows, first, m0, n0, acc);
  }
}

// out[t, n] = sum_j y[t*k + j, n] in slot order; hidden % 4 == 0.
__device__ void moe_combine(const MoeCombineParams& p) {
  if (p.hidden % 4 != 0) return;
  const int64_t quad = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (quad * 4 >= static_cast<int64_t>(p.num_tokens) * p.hidden) return;
  const int64_t t = quad * 4 / p.hidden;
  const int64_t n = quad * 4 % p.hidden;
  const float* y = static_cast<const float*>(p.y);
  float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int j = 0; j < p.top_k; ++j) {
    const float4 v = *reinterpret_cast<const float4*>(y + (t * p.top_k + j) * p.hidden + n);
    sum.x += v.x; sum.y += v.y; sum.z += v.z; sum.w += v.w;
  }
  *reinterpret_cast<float4*>(static_cast<float*>(p.out) + t * p.hidden + n) = sum;
}

// Shared expert: out = x + sigmoid(gate_logit[t]) * y; hidden % 4 == 0.
__device__ void add_sigmoid_scaled(const AddSigmoidScaledParams& p) {
  if (p.hidden % 4 != 0) return;
  const int64_t quad = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (quad * 4 >= static_cast<int64_t>(p.num_tokens) * p.hidden) return;
  const int64_t at = quad * 4;
  const float gate = sigmoid(static_cast<const float*>(p.gate_logit)[at / p.hidden]);
  const float4 x = *reinterpret_cast<const float4*>(static_cast<const float*>(p.x) + at);
  const float4 y = *reinterpret_cast<const float4*>(static_cast<const float*>(p.y) + at);
  *reinterpret_cast<float4*>(static_cast<float*>(p.out) + at) =
      make_float4(fmaf(gate, y.x, x.x), fmaf(gate, y.y, x.y), fmaf(gate, y.z, x.z), fmaf(gate, y.w, x.w));
}

}  // namespace atlas::moe
