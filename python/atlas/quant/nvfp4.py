"""NVFP4 (ModelOpt): e2m1 elements packed two per byte, an e4m3 scale per 16 elements of a row,
and one fp32 scale per tensor: W = e2m1[nibble] * weight_scale * weight_scale_2.

Element 2i sits in the low nibble of byte i, element 2i+1 in the high nibble.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kvcache.packing import pack_nibbles, unpack_nibbles
from .codes import E2M1_MAX, E2M1_VALUES, E4M3_MAX, decode_e4m3, encode_e2m1, encode_e4m3

GROUP_SIZE = 16


@dataclass(frozen=True)
class Nvfp4Weight:
    weight: np.ndarray  # [N, K/2] uint8, two e2m1 codes per byte
    weight_scale: np.ndarray  # [N, K/16] uint8 e4m3 codes
    weight_scale_2: np.ndarray  # [] float32
    input_scale: np.ndarray  # [] float32; W4A16 does not use it (no activation calibration)


def quantize_nvfp4(w: np.ndarray) -> Nvfp4Weight:
    """w [N, K] float (K a multiple of 16) -> packed codes and two-level scales."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    if k % GROUP_SIZE:
        raise ValueError(f"nvfp4 needs in-features divisible by {GROUP_SIZE}, got {k}")
    scale_2 = np.float32(np.abs(w).max() / np.float32(E4M3_MAX * E2M1_MAX))
    groups = w.reshape(n, k // GROUP_SIZE, GROUP_SIZE)  # [N, K/16, 16]
    group_amax = np.abs(groups).max(axis=2)  # [N, K/16]
    wanted = group_amax / (np.float32(E2M1_MAX) * scale_2) if scale_2 > 0 else np.zeros_like(group_amax)
    scale_codes = encode_e4m3(wanted)  # [N, K/16]
    unit = (decode_e4m3(scale_codes) * scale_2)[:, :, None]  # [N, K/16, 1]
    scaled = np.where(unit > 0, groups / np.where(unit > 0, unit, 1), 0).reshape(n, k)  # [N, K]
    return Nvfp4Weight(
        weight=pack_nibbles(encode_e2m1(scaled)),
        weight_scale=scale_codes,
        weight_scale_2=np.array(scale_2, dtype=np.float32),
        input_scale=np.array(1.0, dtype=np.float32),
    )


def dequantize_nvfp4(weight: np.ndarray, weight_scale: np.ndarray, weight_scale_2: np.ndarray) -> np.ndarray:
    """packed [N, K/2], e4m3 scales [N, K/16], fp32 scalar -> float32 [N, K]:
    (e2m1 * weight_scale), exact in float32, then one rounding by weight_scale_2."""
    elements = E2M1_VALUES[unpack_nibbles(np.asarray(weight).view(np.uint8))]  # [N, K]
    scale = decode_e4m3(weight_scale)  # [N, K/16]
    if scale.shape[1] * GROUP_SIZE != elements.shape[1] or scale.shape[0] != elements.shape[0]:
        raise ValueError(f"weight_scale {scale.shape} does not match packed weight {np.shape(weight)}")
    scaled = elements * np.repeat(scale, GROUP_SIZE, axis=1)  # [N, K]
    return scaled * np.float32(np.asarray(weight_scale_2, dtype=np.float32).reshape(()))
