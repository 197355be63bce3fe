"""The element codes of the published formats, decoded from their bit layouts (no ml_dtypes).

e4m3 (float8_e4m3fn): sign | 4 exponent bits (bias 7) | 3 mantissa bits; no infinities, S.1111.111
is NaN, largest finite 448. e2m1 (float4_e2m1fn): sign | 2 exponent bits (bias 1) | 1 mantissa
bit; codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6, bit 3 the sign.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1_SIGN_BIT = 0x8
# Halfway points between neighbouring magnitudes; a tie goes to the even code (round to nearest even).
_E2M1_MIDPOINTS = (E2M1_MAGNITUDES[1:] + E2M1_MAGNITUDES[:-1]) / 2


def e4m3_table() -> np.ndarray:
    """float32 value of every e4m3 byte [256]."""
    bits = np.arange(256, dtype=np.uint32)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent = ((bits >> 3) & 0xF).astype(np.int32)
    mantissa = (bits & 0x7).astype(np.float64)
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = (mantissa / 8.0) * np.exp2(-6.0)
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(bits & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


def e2m1_table() -> np.ndarray:
    """float32 value of every e2m1 nibble [16]."""
    return np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES]).astype(np.float32)


E4M3_VALUES = e4m3_table()
E2M1_VALUES = e2m1_table()


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    """e4m3 bytes (uint8 or float8_e4m3fn storage) -> float32, exactly."""
    return E4M3_VALUES[np.asarray(codes).view(np.uint8)]


def encode_e4m3(values: np.ndarray) -> np.ndarray:
    """float32 -> e4m3 bytes (uint8), round to nearest even, saturating at +-448."""
    clipped = np.clip(np.asarray(values, dtype=np.float32), -E4M3_MAX, E4M3_MAX)
    return clipped.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def encode_e2m1(values: np.ndarray) -> np.ndarray:
    """float32 -> e2m1 nibbles (uint8, 0..15), round to nearest even, saturating at +-6."""
    values = np.asarray(values, dtype=np.float32)
    magnitude = np.minimum(np.abs(values), E2M1_MAX)
    code = np.searchsorted(_E2M1_MIDPOINTS, magnitude, side="left")
    at_midpoint = _E2M1_MIDPOINTS[np.minimum(code, len(_E2M1_MIDPOINTS) - 1)] == magnitude
    code = code + (at_midpoint & (code % 2 == 1))
    return (code + np.where(np.signbit(values), E2M1_SIGN_BIT, 0)).astype(np.uint8)
