// Kernels that exercise the host emulator itself (tests/test_simt.py): the PTX emulations against
// their definitions, and each kind of fault the emulator promises to report.
#include "atlas/ptx.cuh"

struct SelfTestParams {
  void* in;
  void* out;
  int32_t n;
};

// out[i] = sum of in[0..blockDim) for every thread i: a shared-memory reduction with its barrier.
extern "C" __global__ void __launch_bounds__(1024) simt_block_sum(const SelfTestParams p) {
  __shared__ float values[1024];
  const float* in = static_cast<const float*>(p.in);
  values[threadIdx.x] = in[threadIdx.x];
  __syncthreads();
  float total = 0.0f;
  for (unsigned i = 0; i < blockDim.x; ++i) total += values[i];
  static_cast<float*>(p.out)[threadIdx.x] = total;
}

// The same without the barrier: threads read neighbours' slots before they are written.
extern "C" __global__ void __launch_bounds__(1024) simt_block_sum_unsynced(const SelfTestParams p) {
  __shared__ float values[1024];
  const float* in = static_cast<const float*>(p.in);
  values[threadIdx.x] = in[threadIdx.x];
  float total = 0.0f;
  for (unsigned i = 0; i < blockDim.x; ++i) total += values[i];
  static_cast<float*>(p.out)[threadIdx.x] = total;
}

// out[lane] = in[lane ^ n] within each warp.
extern "C" __global__ void __launch_bounds__(1024) simt_shfl_xor(const SelfTestParams p) {
  const float v = static_cast<const float*>(p.in)[threadIdx.x];
  static_cast<float*>(p.out)[threadIdx.x] = __shfl_xor_sync(0xffffffffu, v, p.n);
}

// Threads past n return, the rest meet at a barrier: undefined behaviour, reported.
extern "C" __global__ void __launch_bounds__(1024) simt_exit_then_sync(const SelfTestParams p) {
  if (static_cast<int>(threadIdx.x) >= p.n) return;
  __syncthreads();
  static_cast<float*>(p.out)[threadIdx.x] = 1.0f;
}

// Lane 0 waits at a shuffle while the other threads wait at a barrier: a deadlock.
extern "C" __global__ void __launch_bounds__(1024) simt_deadlock(const SelfTestParams p) {
  float v = 1.0f;
  if (threadIdx.x == 0) {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  } else {
    __syncthreads();
  }
  static_cast<float*>(p.out)[threadIdx.x] = v;
}

// Reads in[n]: one element past an allocation of n floats when n * 4 is a multiple of 256.
extern "C" __global__ void __launch_bounds__(1024) simt_read_past_end(const SelfTestParams p) {
  static_cast<float*>(p.out)[threadIdx.x] = static_cast<const float*>(p.in)[p.n];
}

// One warp: in = A (16x16, row-major) then B^T (8x16, row-major: B stored by column), bf16; fragments
// gathered by ldmatrix from shared memory exactly as gemm.cuh does; out = D (16x8 f32, row-major).
extern "C" __global__ void __launch_bounds__(32) simt_mma_tile(const SelfTestParams p) {
  __shared__ __align__(16) uint16_t a[16][16];
  __shared__ __align__(16) uint16_t bt[8][16];
  const uint16_t* in = static_cast<const uint16_t*>(p.in);
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) a[i / 16][i % 16] = in[i];
  for (int i = lane; i < 128; i += 32) bt[i / 16][i % 16] = in[256 + i];
  __syncwarp();
  uint32_t af[4];
  atlas::ldmatrix_x4(af, &a[lane % 16][(lane / 16) * 8]);
  uint32_t bf[4];  // x4 over B^T rows 0-7, k 0-7 / 8-15, twice: b0, b1 = matrices 0, 1
  atlas::ldmatrix_x4(bf, &bt[lane % 8][((lane / 8) % 2) * 8]);
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  atlas::mma_bf16_16816(d, af, bf[0], bf[1]);
  float* out = static_cast<float*>(p.out);
  const int row = lane / 4;
  const int col = 2 * (lane % 4);
  out[row * 8 + col] = d[0];
  out[row * 8 + col + 1] = d[1];
  out[(row + 8) * 8 + col] = d[2];
  out[(row + 8) * 8 + col + 1] = d[3];
}

// One warp: in = a 16x16 bf16 tile (row-major); out[lane * 4 + j] = register j of ldmatrix.x4.trans
// over the four 8x8 quarters (rows lane % 16, columns (lane / 16) * 8), as attention_mma.cuh reads V.
extern "C" __global__ void __launch_bounds__(32) simt_ldmatrix_trans(const SelfTestParams p) {
  __shared__ __align__(16) uint16_t v[16][16];
  const uint16_t* in = static_cast<const uint16_t*>(p.in);
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) v[i / 16][i % 16] = in[i];
  __syncwarp();
  uint32_t r[4];
  atlas::ldmatrix_x4_trans(r, &v[lane % 16][(lane / 16) * 8]);
  for (int j = 0; j < 4; ++j) static_cast<uint32_t*>(p.out)[lane * 4 + j] = r[j];
}

// in: n floats; each thread copies its 16-byte chunk to shared memory by cp.async and reads it back
// before (out[0..n)) and after (out[n..2n)) the wait.
extern "C" __global__ void __launch_bounds__(1024) simt_cp_async(const SelfTestParams p) {
  __shared__ __align__(16) float stage[1024 * 4];
  const float* in = static_cast<const float*>(p.in);
  float* out = static_cast<float*>(p.out);
  const int i = threadIdx.x * 4;
  atlas::cp_async_16(&stage[i], &in[i], true);
  atlas::cp_async_commit();
  for (int j = 0; j < 4; ++j) out[i + j] = stage[i + j];
  atlas::cp_async_wait<0>();
  for (int j = 0; j < 4; ++j) out[p.n + i + j] = stage[i + j];
}

// A 16-byte vector load from in + 4 n bytes: misaligned unless n % 4 == 0.
extern "C" __global__ void __launch_bounds__(1024) simt_vector_load(const SelfTestParams p) {
  const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const char*>(p.in) + 4 * p.n);
  static_cast<unsigned*>(p.out)[threadIdx.x] = v.x;
}

// A function template's __shared__ array (GCC keeps it out of the poisoned section): thread 0 reads
// element 0 before anyone writes it, then every thread writes its element.
template <int N>
__device__ void read_unwritten_shared(const SelfTestParams& p) {
  __shared__ float stage[N];
  if (threadIdx.x == 0) static_cast<float*>(p.out)[0] = stage[0];
  __syncthreads();
  stage[threadIdx.x % N] = 1.0f;
}

extern "C" __global__ void __launch_bounds__(1024) simt_template_shared(const SelfTestParams p) {
  read_unwritten_shared<64>(p);
}

// One warpgroup: in = A (64x16) then B (128x16), bf16 row-major (B^T of the product: K-major),
// staged in dynamic shared memory in the 128-byte swizzle layout gemm_wgmma.cuh uses; out = D
// (64x128 f32, row-major) of one wgmma m64n128k16. n = 1 flips the sign of A[0][0] after the issue and
// before the wait (a race on the GPU); n = 2 issues without a wgmma.fence.
__device__ __forceinline__ int swizzled_128(int row, int col) {
  return row * 128 + (((col / 8) ^ (row % 8)) * 16) + (col % 8) * 2;
}

__device__ __forceinline__ uint64_t swizzled_128_desc(uint32_t addr) {
  return ((addr & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}

extern "C" __global__ void __launch_bounds__(128) simt_wgmma_tile(const SelfTestParams p) {
  ATLAS_DYNAMIC_SMEM(uint8_t, smem);
  uint8_t* const a = smem;
  uint8_t* const b = smem + 64 * 128;
  const uint16_t* in = static_cast<const uint16_t*>(p.in);
  for (int i = threadIdx.x; i < 64 * 16; i += 128)
    *reinterpret_cast<uint16_t*>(a + swizzled_128(i / 16, i % 16)) = in[i];
  for (int i = threadIdx.x; i < 128 * 16; i += 128)
    *reinterpret_cast<uint16_t*>(b + swizzled_128(i / 16, i % 16)) = in[64 * 16 + i];
  __syncthreads();
  float d[atlas::kWgmmaN128Accum];
  for (float& v : d) v = 0.0f;
  if (p.n != 2) atlas::wgmma_fence();
  atlas::wgmma_m64n128k16(d, swizzled_128_desc(atlas::smem_addr(a)), swizzled_128_desc(atlas::smem_addr(b)));
  atlas::wgmma_commit();
  if (p.n == 1 && threadIdx.x == 0) *reinterpret_cast<uint16_t*>(a) ^= 0x8000;  // a new value whatever was drawn
  atlas::wgmma_wait_all();
  float* out = static_cast<float*>(p.out);
  const int lane = threadIdx.x % 32;
  const int row0 = (threadIdx.x / 32) * 16 + lane / 4;
  for (int i = 0; i < atlas::kWgmmaN128Accum; ++i)
    out[(row0 + 8 * ((i % 4) / 2)) * 128 + 8 * (i / 4) + 2 * (lane % 4) + i % 2] = d[i];
}
