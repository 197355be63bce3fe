"""Element codes of the KV cache levels: nearest-value quantisation onto a sorted table.

The float formats (e4m3, e2m1) are the published codecs of `atlas.quant.codes`; a Lloyd-Max
codebook goes through the same `nearest_code` primitive, shifted so its table is non-negative.
bf16 is rounded with integer bit ops.
"""

from __future__ import annotations

import numpy as np

from ..quant.codes import (
    E2M1_MAX, E4M3_MAX, decode_e2m1, decode_e4m3, encode_e2m1, encode_e4m3, nearest_code,
)  # fmt: skip

__all__ = [
    "E2M1_MAX", "E4M3_MAX", "decode_bf16", "decode_codebook", "decode_e2m1", "decode_e4m3",
    "encode_bf16", "encode_codebook", "encode_e2m1", "encode_e4m3", "nearest_code",
]  # fmt: skip


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
