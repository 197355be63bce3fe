// sample, split form (ATLAS_SAMPLE=split): the draw of `sample` with the whole-row passes spread
// over the GPU. The row is cut into kSampleUnits contiguous units, one warp each in the grid
// launches and one thread each in the single-block ones; five launches in stream order:
//   units   (grid)  per unit: the largest logit, its sum of exp((z - unit max) / T), any number;
//   row     (block) the row's largest logit, the softmax total (each unit's sum rescaled to the row's
//                   largest), pmax, and the candidates' lower bound from the units' largest p (as
//                   `sample` takes it from its threads' largest);
//   count   (grid)  per unit: p written to p.probs, how many p reach the bound, their mass (double);
//   gather  (grid)  per unit: its p >= bound at its offset (the counts before it) in the candidates;
//   pick    (block) the draw over the candidates when they settle the row, over the units' masses
//                   when nothing cuts it, else `sample`'s full path over p.probs.
// p is the single-block form's up to the rounding of the total (summed per unit, then across), so a
// draw may land on a neighbour of that form's token; both are within the reference's tolerance.
#pragma once

#include "atlas/sampling.cuh"

namespace atlas {

constexpr int kSampleUnits = 1024;            // one thread per unit in `row` and `pick`
static_assert(kSampleUnits == kSampleThreads, "the single-block launches run a thread per unit");
constexpr int kSampleUnitWarps = 8;           // units per block of the grid launches
constexpr int kSampleUnitThreads = kSampleUnitWarps * kWarpSize;
constexpr int kSampleScratchBytes = 65536;    // ops_dense.SAMPLE_SCRATCH_BYTES

struct SampleRow {
  float zmax;    // the largest logit (NaN as -inf)
  float total;   // sum over the row of sample_weight
  float pmax;    // 1 / total: the largest p
  float bound;   // candidates are p >= bound; < 0: nothing cuts the row
  int all_nan;   // the row held only NaN
};

struct SampleScratch {  // p.scratch
  double unit_mass[kSampleUnits];  // sum of p over the unit
  float unit_max[kSampleUnits];    // largest logit of the unit (NaN as -inf; -inf when empty)
  float unit_sum[kSampleUnits];    // sum of exp((z - unit_max) / T) over the unit
  int unit_numbers[kSampleUnits];  // 1: the unit read a value that is not NaN
  int unit_count[kSampleUnits];    // p >= bound in the unit
  SampleRow row;
  float candidate_value[kSampleCandidates];  // the p >= bound in index order
  int candidate_index[kSampleCandidates];
};
static_assert(sizeof(SampleScratch) <= kSampleScratchBytes, "SampleScratch outgrew SAMPLE_SCRATCH_BYTES");

struct UnitSpan {
  int begin;
  int end;
};

__device__ __forceinline__ UnitSpan unit_span(int vocab, int unit) {
  const int length = ceil_div(vocab, kSampleUnits);
  const int begin = min(unit * length, vocab);
  return {begin, min(begin + length, vocab)};
}

__device__ __forceinline__ SampleScratch& sample_scratch(const SampleParams& p) {
  return *static_cast<SampleScratch*>(p.scratch);
}

// This warp's unit in the grid launches; -1 past the last.
__device__ __forceinline__ int grid_unit() {
  const int unit = blockIdx.x * kSampleUnitWarps + static_cast<int>(threadIdx.x) / kWarpSize;
  return unit < kSampleUnits ? unit : -1;
}

__device__ void sample_split_units(const SampleParams& p) {
  const int unit = grid_unit();
  if (unit < 0) return;
  SampleScratch& s = sample_scratch(p);
  const float* logits = static_cast<const float*>(p.logits);
  const UnitSpan span = unit_span(p.vocab, unit);
  const int lane = threadIdx.x % kWarpSize;
  float zmax = -INFINITY;
  float numbers = 0.0f;
  for (int i = span.begin + lane; i < span.end; i += kWarpSize) {
    numbers = isnan(logits[i]) ? numbers : 1.0f;
    zmax = fmaxf(zmax, sample_logit(logits, i));
  }
  zmax = warp_max(zmax);
  const float temperature = sample_temperature(p);
  float sum = 0.0f;
  for (int i = span.begin + lane; i < span.end; i += kWarpSize) sum += sample_weight(sample_logit(logits, i), zmax, temperature);
  sum = warp_sum(sum);
  numbers = warp_max(numbers);
  if (lane == 0) {
    s.unit_max[unit] = zmax;
    s.unit_sum[unit] = sum;
    s.unit_numbers[unit] = numbers > 0.0f;
  }
}

__device__ void sample_split_row(const SampleParams& p) {
  __shared__ float scratch[kWarpSize];
  SampleScratch& s = sample_scratch(p);
  const int unit = threadIdx.x;
  const float unit_max = s.unit_max[unit];
  const float zmax = block_max(unit_max, scratch);
  const bool all_nan = block_max(static_cast<float>(s.unit_numbers[unit]), scratch) == 0.0f;
  const float weight = sample_weight(unit_max, zmax, sample_temperature(p));  // of the unit's largest
  const float total = block_sum(s.unit_sum[unit] * weight, scratch);
  const float pmax = 1.0f / total;
  const bool empty = unit_span(p.vocab, unit).begin >= p.vocab;
  const float bound = sample_lower_bound(p, empty ? 0.0f : weight / total, pmax);
  if (threadIdx.x == 0) s.row = SampleRow{zmax, total, pmax, bound, all_nan};
}

__device__ void sample_split_count(const SampleParams& p) {
  const int unit = grid_unit();
  if (unit < 0) return;
  SampleScratch& s = sample_scratch(p);
  const SampleRow row = s.row;
  const float* logits = static_cast<const float*>(p.logits);
  float* probs = static_cast<float*>(p.probs);
  const UnitSpan span = unit_span(p.vocab, unit);
  const float temperature = sample_temperature(p);
  const int lane = threadIdx.x % kWarpSize;
  float count = 0.0f;  // exact: at most the unit's length
  double mass = 0.0;
  for (int i = span.begin + lane; i < span.end; i += kWarpSize) {
    const float v = sample_weight(sample_logit(logits, i), row.zmax, temperature) / row.total;
    probs[i] = v;
    count += row.bound >= 0.0f && v >= row.bound ? 1.0f : 0.0f;
    mass += static_cast<double>(v);
  }
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) mass += __shfl_xor_sync(kFullMask, mass, offset);
  count = warp_sum(count);
  if (lane == 0) {
    s.unit_count[unit] = static_cast<int>(count);
    s.unit_mass[unit] = mass;
  }
}

__device__ void sample_split_gather(const SampleParams& p) {
  const int unit = grid_unit();
  if (unit < 0) return;
  SampleScratch& s = sample_scratch(p);
  const float bound = s.row.bound;
  if (bound < 0.0f) return;
  const int lane = threadIdx.x % kWarpSize;
  float before = 0.0f;  // exact: at most the vocabulary, below 2^24
  for (int u = lane; u < unit; u += kWarpSize) before += static_cast<float>(s.unit_count[u]);
  int offset = static_cast<int>(warp_sum(before));
  const float* probs = static_cast<const float*>(p.probs);
  const UnitSpan span = unit_span(p.vocab, unit);
  for (int base = span.begin; base < span.end && offset < kSampleCandidates; base += kWarpSize) {
    const int i = base + lane;
    const float v = i < span.end ? probs[i] : 0.0f;
    const int keep = i < span.end && v >= bound;
    const int inclusive = warp_inclusive_sum(keep);
    const int slot = offset + inclusive - keep;
    if (keep && slot < kSampleCandidates) {
      s.candidate_value[slot] = v;
      s.candidate_index[slot] = i;
    }
    offset += __shfl_sync(kFullMask, inclusive, kWarpSize - 1);
  }
}

// Nothing cuts the row: the first index whose running mass exceeds target, found by the unit
// (block scan over the units' masses) and then within it (warp 0); the unit's last entry with
// mass when rounding leaves the scan short, the row's last unit with mass when target is past all.
__device__ int draw_by_units(const SampleParams& p, const SampleScratch& s, double target) {
  __shared__ double warp_totals[kWarpSize];
  __shared__ int chosen;
  __shared__ double chosen_before;
  const int unit = threadIdx.x;
  const int lane = unit % kWarpSize;
  const int warp = unit / kWarpSize;
  const double mass = s.unit_mass[unit];
  const double inclusive = warp_inclusive_sum(mass);
  if (lane == kWarpSize - 1) warp_totals[warp] = inclusive;
  if (unit == 0) chosen = -1;
  __syncthreads();
  double before = inclusive - mass;
  for (int w = 0; w < warp; ++w) before += warp_totals[w];
  // A unit with mass bids its index, one that the running mass crosses in bids more, the lower
  // the unit the more: the maximum names the first crossing unit, else the last with mass.
  constexpr int kCrossing = 2 * kSampleUnits - 1;
  if (mass > 0.0) atomicMax(&chosen, before + mass > target ? kCrossing - unit : unit);
  __syncthreads();
  const int pick = chosen >= kSampleUnits ? kCrossing - chosen : max(chosen, 0);
  if (unit == pick) chosen_before = before;
  __syncthreads();
  if (warp != 0) return 0;
  const float* probs = static_cast<const float*>(p.probs);
  const UnitSpan span = unit_span(p.vocab, pick);
  double running = chosen_before;
  int last_kept = span.begin;
  for (int base = span.begin; base < span.end; base += kWarpSize) {
    const int i = base + lane;
    const DrawStep step = warp_draw_step(i < span.end ? static_cast<double>(probs[i]) : 0.0, target, running);
    if (step.found < kWarpSize) return base + step.found;
    if (step.kept >= 0) last_kept = base + step.kept;
  }
  return last_kept;
}

__device__ void sample_split_pick(const SampleParams& p) {
  __shared__ SampleCandidates candidates;
  const SampleScratch& s = sample_scratch(p);
  const SampleRow row = s.row;
  if (row.all_nan) {  // no token, as `sample`
    if (threadIdx.x == 0) static_cast<int32_t*>(p.out)[0] = -1;
    return;
  }
  const int count = static_cast<int>(block_sum_f64(static_cast<double>(s.unit_count[threadIdx.x])));
  const double row_mass = block_sum_f64(s.unit_mass[threadIdx.x]);
  if (row.bound < 0.0f) {
    const int token = draw_by_units(p, s, static_cast<double>(p.uniform) * row_mass);
    if (threadIdx.x == 0) static_cast<int32_t*>(p.out)[0] = min(token, p.vocab - 1);
    return;
  }
  if (count <= kSampleCandidates) {
    for (int j = threadIdx.x; j < count; j += blockDim.x) {
      candidates.value[j] = s.candidate_value[j];
      candidates.index[j] = s.candidate_index[j];
    }
    if (threadIdx.x == 0) candidates.count = count;
    __syncthreads();
    if (sample_from_candidates(p, candidates, row.pmax, row_mass)) return;
  }
  sample_full_path(p, row.pmax);
}

}  // namespace atlas
