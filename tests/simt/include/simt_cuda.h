// Force-included before the kernel sources when tests/simt builds a tuple for the host: the CUDA
// dialect the kernels use, mapped onto one host thread that runs every CUDA thread of a block as
// a fiber (runtime.cpp). Barriers and warp collectives are real rendezvous points, so a missing
// __syncthreads / __syncwarp or a read before a cp.async wait shows up as a wrong result.
#pragma once

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>

#define ATLAS_SIMT_HOST 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define __constant__
// Dynamic shared memory: one buffer, poisoned before every block like the static arrays.
#define ATLAS_DYNAMIC_SMEM(type, name) type* const name = static_cast<type*>(simt::dynamic_smem())
// Static shared arrays live in one linker section that the runtime poisons before every block.
#define __shared__ static __attribute__((section("simt_shared")))

struct __attribute__((aligned(8))) uint2 { unsigned x, y; };
struct __attribute__((aligned(16))) uint4 { unsigned x, y, z, w; };
struct __attribute__((aligned(8))) float2 { float x, y; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };

inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

namespace simt {

struct Fiber;
extern Fiber* current;
extern uint3 block_idx;
extern dim3 block_dim;
extern dim3 grid_dim;
const uint3& thread_idx();

void syncthreads();
void syncwarp(unsigned mask);
// Every lane of `mask` deposits `bytes` (<= kExchangeBytes) and gets back the 32 deposits of this
// round, lane-major with a stride of kExchangeBytes; the caller's lane must be in `mask`.
constexpr int kExchangeBytes = 64;
const unsigned char* warp_exchange(unsigned mask, const void* mine, std::size_t bytes);
unsigned lane_id();
void* dynamic_smem();
[[noreturn]] void fail(const char* what);

// cp.async: the copy is taken now and lands in shared memory at the wait that covers its group.
void async_copy(void* dst, const void* src, int bytes);
void async_commit();
void async_wait(int pending);

// wgmma: an issued operation stays with its thread and is performed, in issue order, at the
// wait_group that covers its group; a thread may issue only after a wgmma.fence since its last wait
// (stricter than PTX, which asks for one where the accumulators were touched since).
using AsyncMma = std::function<void()>;
void mma_fence();
void mma_issue(AsyncMma op);
void mma_commit();
void mma_wait(int pending);

template <class T>
T shuffle(unsigned mask, T value, int src_lane) {
  static_assert(sizeof(T) <= kExchangeBytes, "shuffle: value too large");
  const unsigned char* all = warp_exchange(mask, &value, sizeof(T));
  if (src_lane < 0 || src_lane >= 32 || !((mask >> src_lane) & 1u)) return value;  // PTX: own value
  T out;
  std::memcpy(&out, all + src_lane * kExchangeBytes, sizeof(T));
  return out;
}

}  // namespace simt

#define threadIdx (simt::thread_idx())
#define blockIdx (simt::block_idx)
#define blockDim (simt::block_dim)
#define gridDim (simt::grid_dim)

inline void __syncthreads() { simt::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { simt::syncwarp(mask); }
inline void __threadfence() {}

template <class T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  const int lane = static_cast<int>(simt::lane_id());
  return simt::shuffle(mask, value, (lane & ~(width - 1)) | ((lane ^ lane_mask) & (width - 1)));
}
template <class T>
T __shfl_sync(unsigned mask, T value, int src, int width = 32) {
  const int lane = static_cast<int>(simt::lane_id());
  return simt::shuffle(mask, value, (lane & ~(width - 1)) | (src & (width - 1)));
}
template <class T>
T __shfl_up_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  const int lane = static_cast<int>(simt::lane_id());
  const int within = lane & (width - 1);
  return simt::shuffle(mask, value, within >= static_cast<int>(delta) ? lane - static_cast<int>(delta) : lane);
}

template <class T> T __ldg(const T* p) { return *p; }
template <class T> T __ldcg(const T* p) { return *p; }

// Fibers never preempt each other, so a plain read-modify-write is atomic.
template <class T> T atomicAdd(T* p, T v) { const T old = *p; *p = old + v; return old; }
template <class T> T atomicMax(T* p, T v) { const T old = *p; *p = std::max(old, v); return old; }
template <class T> T atomicMin(T* p, T v) { const T old = *p; *p = std::min(old, v); return old; }
template <class T> T atomicExch(T* p, T v) { const T old = *p; *p = v; return old; }

inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
// The host build uses -ffp-contract=off, so these round like their device namesakes.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline int __float2int_rn(float a) { return static_cast<int>(std::nearbyint(a)); }
inline float rsqrtf(float a) { return 1.0f / std::sqrt(a); }
inline float __expf(float a) { return std::exp(a); }
inline float __frcp_rn(float a) { return 1.0f / a; }

using std::isfinite;
using std::isinf;
using std::isnan;
using std::max;
using std::min;

inline std::size_t __cvta_generic_to_shared(const void* p) { return reinterpret_cast<std::size_t>(p); }
