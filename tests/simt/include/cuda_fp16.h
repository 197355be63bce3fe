// Host stand-in for <cuda_fp16.h> in the tests/simt build: the half2 calls the kernels make,
// with IEEE binary16 round-to-nearest-even (subnormals included).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

struct __half {
  uint16_t bits;
};
struct __attribute__((aligned(4))) __half2 {
  __half x, y;
};

inline float __half2float(__half h) {
  const uint32_t sign = (h.bits & 0x8000u) << 16;
  const int exponent = (h.bits >> 10) & 0x1f;
  const uint32_t mantissa = h.bits & 0x3ffu;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa ? NAN : INFINITY;
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400u), exponent - 25);
  }
  uint32_t u;
  std::memcpy(&u, &magnitude, 4);
  u |= sign;
  float out;
  std::memcpy(&out, &u, 4);
  return out;
}

inline __half __float2half_rn(float value) {
  uint32_t u;
  std::memcpy(&u, &value, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const float a = std::fabs(value);
  if (std::isnan(value)) return {static_cast<uint16_t>(sign | 0x7e00u)};
  if (a >= 65520.0f) return {static_cast<uint16_t>(sign | 0x7c00u)};  // rounds past the largest half
  if (a < 6.103515625e-05f) {  // subnormal: multiples of 2^-24, nearbyint rounds ties to even
    return {static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f)))};
  }
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  uint32_t q = static_cast<uint32_t>(std::nearbyint(std::ldexp(m, 11)));  // 11 significant bits
  if (q == 2048u) { q = 1024u; ++e; }
  return {static_cast<uint16_t>(sign | ((e + 14) << 10) | (q & 0x3ffu))};
}

inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
inline __half2 __float2half2_rn(float v) { return {__float2half_rn(v), __float2half_rn(v)}; }
inline __half2 __hmul2(__half2 a, __half2 b) {
  return {__float2half_rn(__half2float(a.x) * __half2float(b.x)),
          __float2half_rn(__half2float(a.y) * __half2float(b.y))};
}
