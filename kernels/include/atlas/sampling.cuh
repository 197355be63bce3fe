// Token choice on the device.
//   argmax: pass 1 (grid chunks x rows) reduces each chunk of a row to (value, index); pass 2
//     (grid rows) reduces the partials. Ties and the reduction order: the larger value wins, on
//     equal values the lower index, so the result is the lowest index of the maximum.
//   sample: one block of kSampleThreads, base.py's sort-free rule. p = softmax(logits / T) is
//     written once to a scratch row; the top_k-th largest p and the top_p threshold are found by
//     bisection over the bit patterns of non-negative floats (their order is the integer order),
//     counting / summing over the row per step; masses are summed in double like the reference.
//     The final draw is a block-wide prefix sum in index order. min_p raises the keep threshold
//     to min_p * the largest p before top_p sees the kept mass. With top_k, min_p or top_p the
//     thresholds are usually found over the few thousand largest p alone (the fast path below).
//   penalize: one thread per vocabulary entry, atlas.sampling.penalize_row's float32 steps in its
//     order (logit_bias, the ending ids before min_tokens, repetition, presence + frequency), with
//     explicit round-to-nearest intrinsics so no multiply-add is contracted into an FMA the
//     reference does not do. count_token adds the pick just made to the counts, so the history
//     stays on the device and only the token id crosses to the host.
#pragma once

#include <cfloat>
#include <climits>

#include "atlas/common.cuh"

namespace atlas {

constexpr int kArgmaxThreads = 256;
constexpr int kSampleThreads = 1024;

struct ArgBest {
  float value;
  int index;
};

__device__ __forceinline__ ArgBest better(ArgBest a, ArgBest b) {
  if (b.value > a.value || (b.value == a.value && b.index < a.index)) return b;
  return a;
}

__device__ __forceinline__ ArgBest warp_best(ArgBest best) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const ArgBest other{__shfl_xor_sync(kFullMask, best.value, offset), __shfl_xor_sync(kFullMask, best.index, offset)};
    best = better(best, other);
  }
  return best;
}

// Block-wide best; valid in every thread. blockDim.x % 32 == 0.
__device__ __forceinline__ ArgBest block_best(ArgBest best) {
  __shared__ float values[kWarpSize];
  __shared__ int indices[kWarpSize];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  best = warp_best(best);
  if (lane == 0) {
    values[warp] = best.value;
    indices[warp] = best.index;
  }
  __syncthreads();
  ArgBest total{-INFINITY, INT_MAX};
  if (lane < static_cast<int>(blockDim.x / kWarpSize)) total = ArgBest{values[lane], indices[lane]};
  total = warp_best(total);
  __syncthreads();
  return total;
}

// Logits a thread of argmax_partial loads at once (a chunk of 2048 over 256 threads in one
// batch): rolled, its loop (runtime trip count) stalled on each load.
constexpr int kArgmaxBatch = 8;

__device__ void argmax_partial(const ArgmaxParams& p) {
  const int chunk = blockIdx.x;
  const int row = blockIdx.y;
  if (row >= p.rows || chunk >= p.chunks) return;
  const float* logits = static_cast<const float*>(p.logits) + static_cast<int64_t>(row) * p.vocab;
  const int begin = chunk * p.chunk;
  const int end = min(begin + p.chunk, p.vocab);
  ArgBest best{-INFINITY, INT_MAX};
  const int step = static_cast<int>(blockDim.x);
  for (int i0 = begin + threadIdx.x; i0 < end; i0 += kArgmaxBatch * step) {
    float values[kArgmaxBatch];
#pragma unroll
    for (int b = 0; b < kArgmaxBatch; ++b) values[b] = i0 + b * step < end ? logits[i0 + b * step] : -INFINITY;
#pragma unroll
    for (int b = 0; b < kArgmaxBatch; ++b)
      if (i0 + b * step < end) best = better(best, ArgBest{values[b], i0 + b * step});
  }
  best = block_best(best);
  if (threadIdx.x == 0) {
    static_cast<float*>(p.partial_value)[row * p.chunks + chunk] = best.value;
    static_cast<int32_t*>(p.partial_index)[row * p.chunks + chunk] = best.index;
  }
}

__device__ void argmax_final(const ArgmaxParams& p) {
  const int row = blockIdx.x;
  if (row >= p.rows) return;
  const float* values = static_cast<const float*>(p.partial_value) + row * p.chunks;
  const int32_t* indices = static_cast<const int32_t*>(p.partial_index) + row * p.chunks;
  ArgBest best{-INFINITY, INT_MAX};
  for (int c = threadIdx.x; c < p.chunks; c += blockDim.x) best = better(best, ArgBest{values[c], indices[c]});
  best = block_best(best);
  // An all-NaN row leaves INT_MAX: it has no token, -1 (the embedding reads a zero row for it; the
  // host reads the -1 and stops the generation, the model's state having gone NaN).
  if (threadIdx.x == 0) static_cast<int32_t*>(p.out)[row] = best.index < p.vocab ? best.index : -1;
}

// ---- sample ----------------------------------------------------------------------------------

// This lane's inclusive prefix sum over the warp's values, in lane order.
template <class T>
__device__ __forceinline__ T warp_inclusive_sum(T value) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const T up = __shfl_up_sync(kFullMask, value, offset);
    if (lane >= offset) value += up;
  }
  return value;
}

__device__ __forceinline__ double block_sum_f64(double value) {
  __shared__ double scratch[kWarpSize];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) value += __shfl_xor_sync(kFullMask, value, offset);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  double total = lane < static_cast<int>(blockDim.x / kWarpSize) ? scratch[lane] : 0.0;
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) total += __shfl_xor_sync(kFullMask, total, offset);
  __syncthreads();
  return total;
}

// probs[i] = exp((z[i] - max z) / T) / sum, sampling.py's float32 order of operations: subtracting
// first keeps a tiny T from overflowing. z is the logit with NaN read as -inf; the maxima (+inf
// included) get exp(0) = 1, so sum >= 1 (an all -inf row is uniform). T below FLT_MIN (a launch
// parameter that rounded to 0 or a denormal) is FLT_MIN; T that rounded to inf is FLT_MAX (-inf /
// inf would make a masked token's weight NaN). Returns the largest p, 1 / sum, and in
// thread_max the largest p among the entries this thread normalised; all_nan: the row held only NaN.
__device__ __forceinline__ float sample_logit(const float* logits, int i) {
  const float v = logits[i];
  return isnan(v) ? -INFINITY : v;
}

__device__ __forceinline__ float sample_temperature(const SampleParams& p) {
  return fminf(fmaxf(p.temperature, FLT_MIN), FLT_MAX);
}

// The unnormalised p of logit z (NaN already read as -inf) against the row's largest, zmax.
__device__ __forceinline__ float sample_weight(float z, float zmax, float temperature) {
  return z == zmax ? 1.0f : expf((z - zmax) / temperature);
}

__device__ float sample_softmax(const SampleParams& p, float* scratch, float& thread_max, bool& all_nan) {
  const float* logits = static_cast<const float*>(p.logits);
  float* probs = static_cast<float*>(p.probs);
  const float temperature = sample_temperature(p);
  float zmax = -INFINITY;
  float numbers = 0.0f;  // 1 once this thread read a value that is not NaN
  for (int i = threadIdx.x; i < p.vocab; i += blockDim.x) {
    numbers = isnan(logits[i]) ? numbers : 1.0f;
    zmax = fmaxf(zmax, sample_logit(logits, i));
  }
  all_nan = block_max(numbers, scratch) == 0.0f;
  zmax = block_max(zmax, scratch);
  float partial = 0.0f;
  for (int i = threadIdx.x; i < p.vocab; i += blockDim.x) {
    const float e = sample_weight(sample_logit(logits, i), zmax, temperature);
    probs[i] = e;
    partial += e;
  }
  const float total = block_sum(partial, scratch);
  thread_max = 0.0f;  // a thread without entries reports 0, which bounds nothing
  for (int i = threadIdx.x; i < p.vocab; i += blockDim.x) {
    probs[i] /= total;  // same thread wrote it
    thread_max = fmaxf(thread_max, probs[i]);
  }
  __syncthreads();
  return 1.0f / total;
}

// Number of p >= threshold (top_k) or, with kMass, their summed mass among p >= floor.
template <bool kMass>
__device__ double sample_tally(const SampleParams& p, float threshold, float floor) {
  const float* probs = static_cast<const float*>(p.probs);
  double partial = 0.0;
  for (int i = threadIdx.x; i < p.vocab; i += blockDim.x) {
    const float v = probs[i];
    if (v >= threshold && v >= floor) partial += kMass ? static_cast<double>(v) : 1.0;
  }
  return block_sum_f64(partial);
}

// Largest float t in [0, pmax] with tally(t) >= goal (tally is non-increasing in t). Capped at
// the largest p so a goal of 0 (top_p rounded to 0) keeps that p, as the reference does.
template <bool kMass>
__device__ float sample_bisect(const SampleParams& p, double goal, float floor, float pmax) {
  uint32_t lo = 0u;                            // tally(0) is everything kept: >= goal
  uint32_t hi = __float_as_uint(pmax) + 1u;    // no p exceeds pmax
  while (hi - lo > 1u) {
    const uint32_t mid = lo + (hi - lo) / 2u;
    if (sample_tally<kMass>(p, __uint_as_float(mid), floor) >= goal) lo = mid; else hi = mid;
  }
  return __uint_as_float(lo);
}

// First index whose inclusive prefix sum of kept p exceeds target (the last kept index if the
// rounding of the sums leaves none).
__device__ int sample_draw(const SampleParams& p, float floor, double target) {
  __shared__ double warp_totals[kWarpSize];
  __shared__ int found;
  const float* probs = static_cast<const float*>(p.probs);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  if (threadIdx.x == 0) found = INT_MAX;
  double running = 0.0;
  int last_kept = 0;
  for (int base = 0; base < p.vocab; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const float v = i < p.vocab ? probs[i] : 0.0f;
    const double mass = v >= floor ? static_cast<double>(v) : 0.0;
    if (mass > 0.0) last_kept = i;
    const double inclusive = warp_inclusive_sum(mass);
    if (lane == kWarpSize - 1) warp_totals[warp] = inclusive;
    __syncthreads();
    double before = running;
    for (int w = 0; w < warp; ++w) before += warp_totals[w];
    if (mass > 0.0 && before + inclusive > target) atomicMin(&found, i);
    double chunk_total = 0.0;
    for (int w = 0; w < static_cast<int>(blockDim.x / kWarpSize); ++w) chunk_total += warp_totals[w];
    running += chunk_total;
    __syncthreads();
    if (found != INT_MAX) break;  // uniform: read after the barrier
  }
  if (found != INT_MAX) return found;
  __shared__ int last;
  if (threadIdx.x == 0) last = 0;
  __syncthreads();
  atomicMax(&last, last_kept);
  __syncthreads();
  return last;
}

// ---- sample, fast path: top_k <= the block's threads, min_p, or top_p alone ------------------------
// The keep threshold is at least `bound`: the top_k-th largest of the threads' own largest p (each
// of the top_k threads above it holds an entry >= it, so at least top_k entries are) and min_p *
// the largest p. The entries >= bound (the top-n of the row) are gathered in index order into
// shared memory by one pass; when they fit, one warp finds the thresholds by the same bisections
// over them alone and draws, instead of ~60 passes over the whole row.
// top_p alone bounds nothing by itself: the bound is then a guess (the kTopPBoundRank-th largest
// thread maximum: ~2K entries of an i.i.d. 248K row) that holds only when the entries above it
// carry at least top_p of the row's mass, which is checked; a flat row takes the full path.
constexpr int kSampleCandidates = 4096;
constexpr int kTopPBoundRank = 896;

struct SampleCandidates {
  float value[kSampleCandidates];  // p (sample) or the logit (top_ids)
  int index[kSampleCandidates];
  int count;  // of entries >= the bound; past kSampleCandidates only the count is kept
};

// The k-th largest (k in 1..blockDim.x) of the threads' `mine`, in every thread: each thread's rank
// (descending, ties by thread) is counted over all the others, and exactly one has rank k - 1.
__device__ float block_kth_largest(float mine, int k) {
  __shared__ float maxima[kSampleThreads];
  __shared__ float kth;
  maxima[threadIdx.x] = mine;
  __syncthreads();
  int rank = 0;
  for (int j = 0; j < static_cast<int>(blockDim.x); ++j) {
    const float other = maxima[j];
    rank += other > mine || (other == mine && j < static_cast<int>(threadIdx.x));
  }
  if (rank == k - 1) kth = mine;
  __syncthreads();
  return kth;
}

__device__ __forceinline__ bool bounded_by_top_k(const SampleParams& p) {
  return p.top_k > 0 && p.top_k < p.vocab && p.top_k <= static_cast<int>(blockDim.x);
}

// Whether top_k or min_p keeps a set whose smallest p the bound cannot exceed; otherwise top_p is
// the only cut and the bound is a guess the candidates' mass must confirm.
__device__ __forceinline__ bool bound_is_certain(const SampleParams& p) {
  return bounded_by_top_k(p) || p.min_p > 0.0f;
}

// -1 when no setting cuts the row (the full path runs: it is ~5 passes then).
__device__ float sample_lower_bound(const SampleParams& p, float thread_max, float pmax) {
  if (!bound_is_certain(p)) {
    const int rank = min(kTopPBoundRank, static_cast<int>(blockDim.x));
    return p.top_p < 1.0f ? block_kth_largest(thread_max, rank) : -1.0f;
  }
  const float bound = p.min_p > 0.0f ? __fmul_rn(p.min_p, pmax) : 0.0f;
  return bounded_by_top_k(p) ? fmaxf(bound, block_kth_largest(thread_max, p.top_k)) : bound;
}

// Gathers the entries of values[0..n) that are >= bound (never NaN) in index order, a block scan
// per chunk of blockDim entries; returns how many there are (the gather stops once they overflow
// the buffer), the same in every thread.
__device__ int gather_at_least(const float* values, int n, float bound, SampleCandidates& c) {
  __shared__ int warp_counts[kWarpSize];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int warps = static_cast<int>(blockDim.x) / kWarpSize;
  int running = 0;
  for (int base = 0; base < n && running <= kSampleCandidates; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const float v = i < n ? values[i] : 0.0f;
    const int keep = i < n && v >= bound;
    const int inclusive = warp_inclusive_sum(keep);
    if (lane == kWarpSize - 1) warp_counts[warp] = inclusive;
    __syncthreads();
    int before = running;
    for (int w = 0; w < warp; ++w) before += warp_counts[w];
    const int slot = before + inclusive - keep;
    if (keep && slot < kSampleCandidates) {
      c.value[slot] = v;
      c.index[slot] = i;
    }
    for (int w = 0; w < warps; ++w) running += warp_counts[w];
    __syncthreads();
  }
  if (threadIdx.x == 0) c.count = running;
  __syncthreads();
  return running;
}

// Over the first n candidates, one warp: the number (or, kMass, the double mass) of p >= threshold
// among p >= floor, in every lane.
template <bool kMass>
__device__ double candidate_tally(const SampleCandidates& c, int n, float threshold, float floor) {
  double partial = 0.0;
  for (int j = threadIdx.x % kWarpSize; j < n; j += kWarpSize) {
    const float v = c.value[j];
    if (v >= threshold && v >= floor) partial += kMass ? static_cast<double>(v) : 1.0;
  }
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) partial += __shfl_xor_sync(kFullMask, partial, offset);
  return partial;
}

// sample_bisect over the candidates: the largest float t in [0, pmax] with tally(t) >= goal.
template <bool kMass>
__device__ float candidate_bisect(const SampleCandidates& c, int n, double goal, float floor, float pmax) {
  uint32_t lo = 0u;
  uint32_t hi = __float_as_uint(pmax) + 1u;
  while (hi - lo > 1u) {
    const uint32_t mid = lo + (hi - lo) / 2u;
    if (candidate_tally<kMass>(c, n, __uint_as_float(mid), floor) >= goal) lo = mid; else hi = mid;
  }
  return __uint_as_float(lo);
}

// One warp's step of a draw in index order over 32 entries: each lane's mass (0 for an entry not
// kept) after `running`. found: the first lane whose running mass exceeds target (kWarpSize when
// none); kept: the last lane with mass (-1 when none); running moves past the 32.
struct DrawStep {
  int found;
  int kept;
};

__device__ __forceinline__ DrawStep warp_draw_step(double mass, double target, double& running) {
  const int lane = threadIdx.x % kWarpSize;
  const double inclusive = warp_inclusive_sum(mass);
  DrawStep step{mass > 0.0 && running + inclusive > target ? lane : kWarpSize, mass > 0.0 ? lane : -1};
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    step.found = min(step.found, __shfl_xor_sync(kFullMask, step.found, offset));
    step.kept = max(step.kept, __shfl_xor_sync(kFullMask, step.kept, offset));
  }
  running += __shfl_sync(kFullMask, inclusive, kWarpSize - 1);
  return step;
}

// The first candidate (index order) whose running kept mass exceeds target, else the last kept.
__device__ int candidate_draw(const SampleCandidates& c, int n, float floor, double target) {
  const int lane = threadIdx.x % kWarpSize;
  double running = 0.0;
  int last_kept = c.index[0];
  for (int base = 0; base < n; base += kWarpSize) {
    const int j = base + lane;
    const DrawStep step = warp_draw_step(j < n && c.value[j] >= floor ? static_cast<double>(c.value[j]) : 0.0, target, running);
    if (step.found < kWarpSize) return c.index[base + step.found];
    if (step.kept >= 0) last_kept = c.index[base + step.kept];
  }
  return last_kept;
}

// The full path's thresholds and draw over the candidates (warp 0; the entries below the bound
// are below every threshold it finds). row_mass: the whole row's, top_p's base when it cuts alone.
__device__ void sample_candidates(const SampleParams& p, const SampleCandidates& c, float pmax, double row_mass) {
  const int n = c.count;
  float floor = 0.0f;
  if (p.top_k > 0 && p.top_k < p.vocab && n >= p.top_k) {
    floor = candidate_bisect<false>(c, n, static_cast<double>(p.top_k), 0.0f, pmax);
  }  // fewer than top_k candidates: the bound is min_p's, above the top_k-th p
  if (p.min_p > 0.0f) floor = fmaxf(floor, __fmul_rn(p.min_p, pmax));
  if (p.top_p < 1.0f) {
    const double kept = bound_is_certain(p) ? candidate_tally<true>(c, n, 0.0f, floor) : row_mass;
    floor = fmaxf(floor, candidate_bisect<true>(c, n, static_cast<double>(p.top_p) * kept, floor, pmax));
  }
  const double total = candidate_tally<true>(c, n, 0.0f, floor);
  const int token = candidate_draw(c, n, floor, static_cast<double>(p.uniform) * total);
  if (threadIdx.x == 0) static_cast<int32_t*>(p.out)[0] = min(token, p.vocab - 1);
}

// Draws from the candidates (warp 0) when they settle the row: the bound is certain, or top_p's
// guessed bound holds (the candidates carry top_p of row_mass). False, nothing drawn, otherwise.
__device__ bool sample_from_candidates(const SampleParams& p, const SampleCandidates& c, float pmax, double row_mass) {
  // Every warp sums the candidates in the same order, so all take the same branch.
  const double top_p_goal = static_cast<double>(p.top_p) * row_mass;
  if (!bound_is_certain(p) && candidate_tally<true>(c, c.count, 0.0f, 0.0f) < top_p_goal) return false;
  if (threadIdx.x < kWarpSize) sample_candidates(p, c, pmax, row_mass);
  return true;
}

// The thresholds by bisection over the whole row of p (p.probs) and the draw over it, the block's
// threads striding the row: for a row the candidates cannot settle.
__device__ void sample_full_path(const SampleParams& p, float pmax) {
  float floor = 0.0f;
  if (p.top_k > 0 && p.top_k < p.vocab) floor = sample_bisect<false>(p, static_cast<double>(p.top_k), 0.0f, pmax);
  if (p.min_p > 0.0f) floor = fmaxf(floor, __fmul_rn(p.min_p, pmax));
  if (p.top_p < 1.0f) {
    const double kept = sample_tally<true>(p, 0.0f, floor);
    floor = fmaxf(floor, sample_bisect<true>(p, static_cast<double>(p.top_p) * kept, floor, pmax));
  }
  const double total = sample_tally<true>(p, 0.0f, floor);
  const int token = sample_draw(p, floor, static_cast<double>(p.uniform) * total);
  if (threadIdx.x == 0) static_cast<int32_t*>(p.out)[0] = min(token, p.vocab - 1);
}

__device__ void sample(const SampleParams& p) {
  __shared__ float scratch[kWarpSize];
  __shared__ SampleCandidates candidates;
  if (p.vocab <= 0) return;
  float thread_max;
  bool all_nan;
  const float pmax = sample_softmax(p, scratch, thread_max, all_nan);
  if (all_nan) {  // no token, as argmax_final's -1: the host stops the generation
    if (threadIdx.x == 0) static_cast<int32_t*>(p.out)[0] = -1;
    return;
  }
  const float bound = sample_lower_bound(p, thread_max, pmax);
  const float* probs = static_cast<const float*>(p.probs);
  if (bound >= 0.0f && gather_at_least(probs, p.vocab, bound, candidates) <= kSampleCandidates) {
    const double row_mass = bound_is_certain(p) ? 0.0 : sample_tally<true>(p, 0.0f, 0.0f);
    if (sample_from_candidates(p, candidates, pmax, row_mass)) return;
  }
  sample_full_path(p, pmax);
}

// ---- penalize -------------------------------------------------------------------------------

constexpr int kPenalizeThreads = 256;
constexpr int32_t kPromptToken = 1;  // PenalizeParams.flags bits (atlas.sampling.PROMPT_TOKEN, END_TOKEN)
constexpr int32_t kEndToken = 2;

__device__ void penalize(const PenalizeParams& p) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= p.vocab) return;
  const int32_t count = static_cast<const int32_t*>(p.counts)[i];
  const int32_t flags = static_cast<const int32_t*>(p.flags)[i];
  float z = static_cast<const float*>(p.logits)[i];
  if (p.bias != nullptr) z = __fadd_rn(z, static_cast<const float*>(p.bias)[i]);
  if (p.mask_ends != 0 && (flags & kEndToken) != 0) z = -INFINITY;
  if (p.repetition != 1.0f && ((flags & kPromptToken) != 0 || count > 0)) {
    z = z > 0.0f ? __fdiv_rn(z, p.repetition) : __fmul_rn(z, p.repetition);
  }
  if (count > 0) z = __fsub_rn(z, __fadd_rn(__fmul_rn(p.frequency, static_cast<float>(count)), p.presence));
  static_cast<float*>(p.out)[i] = z;
}

// ---- top_ids, logprob_rows ------------------------------------------------------------------
// The ids of the k (<= the block's threads) largest logits of a row, descending, ties the lower id
// first, NaN never: the k-th largest of the threads' own largest logit bounds them from below (as
// in sample's fast path), the entries above it are gathered, and each finds its slot by its rank
// among them (values, when given, get the logits). Slots past the candidates, or all of them when
// the gather overflows, are -1.
__device__ void top_of_row(const float* logits, int vocab, int k, int32_t* ids, float* values) {
  __shared__ SampleCandidates c;
  float mine = -INFINITY;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float v = logits[i];
    if (!isnan(v)) mine = fmaxf(mine, v);
  }
  const int n = gather_at_least(logits, vocab, block_kth_largest(mine, k), c);
  for (int slot = threadIdx.x; slot < k; slot += blockDim.x) ids[slot] = -1;
  __syncthreads();  // the -1s land before the ranked ids overwrite them
  if (n > kSampleCandidates) return;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const float v = c.value[j];
    int rank = 0;
    for (int m = 0; m < n; ++m) rank += c.value[m] > v || (c.value[m] == v && c.index[m] < c.index[j]);
    if (rank < k) {
      ids[rank] = c.index[j];
      if (values != nullptr) values[rank] = v;
    }
  }
}

__device__ void top_ids(const TopIdsParams& p) {
  top_of_row(static_cast<const float*>(p.logits), p.vocab, p.k, static_cast<int32_t*>(p.ids), nullptr);
}

// One block per row: log-sum-exp of the row / T in double (atlas.sampling.token_logprob's
// peak + log(sum(exp(z - peak))) at T = 1, NaN read as -inf) as float hi + lo, the logit of the
// row's token, its rank (the logits at or above it, itself and ties included: vLLM's rank) and
// the top k logits; the host forms the log-probabilities (T = 1) or structured output's weights
// at the sampling temperature. A row whose peak is not finite reports it in hi (the host reads
// that row instead).
__device__ void logprob_rows(const LogprobParams& p) {
  __shared__ float scratch[kWarpSize];
  const int row = blockIdx.x;
  if (row >= p.rows) return;
  const float* logits = static_cast<const float*>(p.logits) + static_cast<int64_t>(row) * p.vocab;
  float mine = -INFINITY;
  for (int i = threadIdx.x; i < p.vocab; i += blockDim.x) {
    const float v = logits[i];
    if (!isnan(v)) mine = fmaxf(mine, v);
  }
  const float peak = block_max(mine, scratch);
  const double temperature = static_cast<double>(fminf(fmaxf(p.temperature, FLT_MIN), FLT_MAX));
  const float token_logit = logits[static_cast<const int32_t*>(p.tokens)[row]];
  const float picked = isnan(token_logit) ? -INFINITY : token_logit;
  double partial = 0.0;
  int at_or_above = 0;
  for (int i = threadIdx.x; i < p.vocab; i += blockDim.x) {
    const float v = logits[i];
    const float z = isnan(v) ? -INFINITY : v;
    at_or_above += z >= picked;
    if (isfinite(peak) && !isnan(v)) partial += exp((static_cast<double>(v) - static_cast<double>(peak)) / temperature);
  }
  const double total = block_sum_f64(partial);
  const double rank = block_sum_f64(static_cast<double>(at_or_above));  // exact: below 2^53
  if (threadIdx.x == 0) {
    const double top = static_cast<double>(peak) / temperature;
    const double lse = isfinite(peak) ? top + log(total) : static_cast<double>(peak);
    const float hi = static_cast<float>(lse);
    float* out = static_cast<float*>(p.lse) + 2 * row;
    out[0] = hi;
    out[1] = isfinite(hi) ? static_cast<float>(lse - static_cast<double>(hi)) : 0.0f;
    static_cast<float*>(p.picked)[row] = picked;
    static_cast<int32_t*>(p.ranks)[row] = static_cast<int32_t>(rank);
  }
  if (p.k > 0) {
    top_of_row(logits, p.vocab, p.k, static_cast<int32_t*>(p.ids) + row * p.k,
               static_cast<float*>(p.values) + row * p.k);
  }
}

__device__ void count_token(const CountTokenParams& p) {
  if (threadIdx.x != 0) return;
  const int32_t token = *static_cast<const int32_t*>(p.token);
  if (token >= 0 && token < p.vocab) static_cast<int32_t*>(p.counts)[token] += 1;
}

}  // namespace atlas
