"""Element codes of the KV cache levels: nearest-value quantisation onto a sorted magnitude table.

One primitive serves every level: a float format (e4m3, e2m1) is its table of non-negative
magnitudes in code order, a Lloyd-Max codebook is its table of levels. Rounding is to the nearest
table value, a tie going to the even code (round to nearest even for the float formats), and
magnitudes beyond the table saturate to its largest entry. bf16 is rounded with integer bit ops.
"""

from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0
E2M1_MAX = 6.0


def e4m3_magnitudes() -> np.ndarray:
    """The 127 finite non-negative float8_e4m3fn values, code 0..126 (0x7F is NaN) [127] f32."""
    codes = np.arange(127, dtype=np.int64)
    exponent, mantissa = codes >> 3, (codes & 7).astype(np.float64)
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = mantissa / 8.0 * 2.0**-6
    return np.where(exponent == 0, subnormal, normal).astype(np.float32)


E4M3_MAGNITUDES = e4m3_magnitudes()
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def nearest_code(magnitude: np.ndarray, table: np.ndarray) -> np.ndarray:
    """|x| (>= 0) -> index of the nearest table entry (ties to the even index), saturating. uint8."""
    m = np.minimum(np.asarray(magnitude, dtype=np.float64), float(table[-1]))
    upper = np.clip(np.searchsorted(table, m, side="left"), 1, len(table) - 1)
    lo, hi = table[upper - 1].astype(np.float64), table[upper].astype(np.float64)
    below, above = m - lo, hi - m
    take_upper = (above < below) | ((above == below) & (upper % 2 == 0))
    return np.where(take_upper, upper, upper - 1).astype(np.uint8)


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> float8_e4m3fn bytes (uint8), round to nearest even, saturating at +-448."""
    x = np.asarray(x, dtype=np.float32)
    sign = np.signbit(x).astype(np.uint8) << 7
    return sign | nearest_code(np.abs(x), E4M3_MAGNITUDES)


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    magnitude = E4M3_MAGNITUDES[np.minimum(codes & 0x7F, 126)]
    return np.where(codes & 0x80, -magnitude, magnitude).astype(np.float32)


def encode_e2m1(x: np.ndarray) -> np.ndarray:
    """float32 -> e2m1 nibbles (uint8 0..15, bit 3 the sign), round to nearest even, saturating at +-6."""
    x = np.asarray(x, dtype=np.float32)
    sign = np.signbit(x).astype(np.uint8) << 3
    return sign | nearest_code(np.abs(x), E2M1_MAGNITUDES)


def decode_e2m1(codes: np.ndarray) -> np.ndarray:
    magnitude = E2M1_MAGNITUDES[codes & 0x7]
    return np.where(codes & 0x8, -magnitude, magnitude).astype(np.float32)


def encode_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even (finite inputs)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def decode_bf16(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)


def encode_codebook(x: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """float32 -> index of the nearest entry of a sorted codebook (ties to the even index),
    saturating at both ends. uint8."""
    shifted = levels.astype(np.float64) - float(levels[0])  # non-negative, same spacing
    clipped = np.clip(np.asarray(x, dtype=np.float64) - float(levels[0]), 0.0, None)
    return nearest_code(clipped, shifted)


def decode_codebook(codes: np.ndarray, levels: np.ndarray) -> np.ndarray:
    return levels[codes].astype(np.float32)
