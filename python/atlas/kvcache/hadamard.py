"""The turbo levels' rotation: a normalised Walsh-Hadamard transform after fixed sign flips.

WHT_D / sqrt(D) is orthonormal and its own inverse. The sign flips (one per coordinate, from the
low bit of murmur3's 32-bit finaliser of the coordinate index, so a kernel computes them without a
table) break the alignment of a head vector's outlier channels with Hadamard rows:
rotate(x) = wht(x * s), unrotate(y) = wht(y) * s.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..errors import AtlasError


def fmix32(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser."""
    h = x.astype(np.uint64) & 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h


@lru_cache(maxsize=8)
def sign_flips(dim: int) -> np.ndarray:
    """[D] f32 of +-1: -1 where fmix32(i) is odd."""
    odd = fmix32(np.arange(dim, dtype=np.uint64)) & 1
    return np.where(odd == 1, -1.0, 1.0).astype(np.float32)


def check_power_of_two(dim: int) -> None:
    if dim < 2 or dim & (dim - 1):
        raise AtlasError(
            f"the turbo KV cache levels need a power-of-two head_dim, got {dim}; use fp8 or nvfp4"
        )


def wht(x: np.ndarray) -> np.ndarray:
    """[..., D] -> normalised Walsh-Hadamard transform (natural order) in float32, butterflies with
    stride 1, 2, 4, ... then one multiply by 1/sqrt(D)."""
    dim = x.shape[-1]
    check_power_of_two(dim)
    y = np.asarray(x, dtype=np.float32).reshape(-1, dim)  # [N, D]
    half = 1
    while half < dim:
        pairs = y.reshape(y.shape[0], dim // (2 * half), 2, half)  # [N, blocks, 2, half]
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = np.stack([a + b, a - b], axis=2).reshape(y.shape[0], dim)
        half *= 2
    return (y * np.float32(1.0 / np.sqrt(dim))).reshape(x.shape)


def rotate(x: np.ndarray) -> np.ndarray:
    return wht(x * sign_flips(x.shape[-1]))


def unrotate(y: np.ndarray) -> np.ndarray:
    return wht(y) * sign_flips(y.shape[-1])
