"""The element codes of the published formats, decoded from their bit layouts (no ml_dtypes).

e4m3 (float8_e4m3fn): sign | 4 exponent bits (bias 7) | 3 mantissa bits; no infinities, S.1111.111
is NaN, largest finite 448. e2m1 (float4_e2m1fn): sign | 2 exponent bits (bias 1) | 1 mantissa
bit; codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6, bit 3 the sign.

Encoding rounds to nearest even and saturates at the largest finite value. e2m1 (and the KV
cache's Lloyd-Max codebooks) go through `nearest_code`, nearest-value quantisation onto a sorted
table of non-negative magnitudes; e4m3 rounds the float32 bits directly.
"""

from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E4M3_NAN = 0x7F
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1_SIGN_BIT = 0x8


def e4m3_table() -> np.ndarray:
    """float32 value of every e4m3 byte [256]."""
    bits = np.arange(256, dtype=np.uint32)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent = ((bits >> 3) & 0xF).astype(np.int32)
    mantissa = (bits & 0x7).astype(np.float64)
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = (mantissa / 8.0) * np.exp2(-6.0)
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(bits & 0x7F) == E4M3_NAN] = np.nan
    return values.astype(np.float32)


def e2m1_table() -> np.ndarray:
    """float32 value of every e2m1 nibble [16]."""
    return np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES]).astype(np.float32)


E4M3_VALUES = e4m3_table()
E2M1_VALUES = e2m1_table()


def nearest_code(magnitude: np.ndarray, table: np.ndarray) -> np.ndarray:
    """|x| (>= 0) -> index of the nearest entry of a sorted table (ties to the even index),
    saturating (NaN too) at the last entry. uint8."""
    m = np.fmin(np.asarray(magnitude, dtype=np.float64), float(table[-1]))
    upper = np.clip(np.searchsorted(table, m, side="left"), 1, len(table) - 1)
    lo, hi = table[upper - 1].astype(np.float64), table[upper].astype(np.float64)
    below, above = m - lo, hi - m
    take_upper = (above < below) | ((above == below) & (upper % 2 == 0))
    return np.where(take_upper, upper, upper - 1).astype(np.uint8)


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    """e4m3 bytes (uint8 or float8_e4m3fn storage) -> float32, exactly."""
    return E4M3_VALUES[np.asarray(codes).view(np.uint8)]


def encode_e4m3(values: np.ndarray) -> np.ndarray:
    """float32 -> e4m3 bytes (uint8), round to nearest even, saturating at +-448; NaN -> S.1111.111.

    Integer bit ops on the float32 (a table search is ~10x slower on checkpoint-sized tensors)."""
    values = np.asarray(values, dtype=np.float32)
    magnitude = np.abs(values)
    bits = magnitude.view(np.uint32).astype(np.int64)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - ((127 - 7) << 3)  # 3 mantissa bits kept
    subnormal = np.rint(np.fmin(magnitude, 2.0**-6) * np.float32(2.0**9)).astype(np.int64)  # 2^-9 units
    code = np.minimum(np.where(magnitude < 2.0**-6, subnormal, normal), E4M3_NAN - 1)
    code = np.where(np.isnan(values), E4M3_NAN, code).astype(np.uint8)
    return (np.signbit(values).astype(np.uint8) << 7) | code


def decode_e2m1(codes: np.ndarray) -> np.ndarray:
    """e2m1 nibbles (uint8, 0..15) -> float32, exactly."""
    return E2M1_VALUES[np.asarray(codes, dtype=np.uint8) & 0xF]


def encode_e2m1(values: np.ndarray) -> np.ndarray:
    """float32 -> e2m1 nibbles (uint8, 0..15), round to nearest even, saturating (NaN too) at +-6."""
    values = np.asarray(values, dtype=np.float32)
    sign = np.where(np.signbit(values), E2M1_SIGN_BIT, 0).astype(np.uint8)
    return sign | nearest_code(np.abs(values), E2M1_MAGNITUDES)
