"""The unrotated levels: bf16, fp8 (e4m3, per-vector fp32 scale), nvfp4 (e2m1, e4m3 group scale)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .codes import (
    E2M1_MAX, E4M3_MAX, decode_bf16, decode_e2m1, decode_e4m3, encode_bf16, encode_e2m1, encode_e4m3,
)  # fmt: skip
from .level import Fields, Layout, check_divisible, grouped, safe_divide
from .packing import pack_nibbles, unpack_nibbles

NVFP4_GROUP = 16


@dataclass(frozen=True)
class Bf16Level:
    """Each value rounded to bfloat16 (nearest even)."""

    name: str = "bf16"

    def layout(self, dim: int) -> Layout:
        return {"bits": ((dim,), np.dtype(np.uint16))}

    def encode(self, x: np.ndarray) -> Fields:
        return {"bits": encode_bf16(x)}

    def decode(self, fields: Fields) -> np.ndarray:
        return decode_bf16(fields["bits"])


@dataclass(frozen=True)
class Fp8Level:
    """e4m3 codes of x / scale, scale = max|x| / 448 in fp32, one per (token, head)."""

    name: str = "fp8"

    def layout(self, dim: int) -> Layout:
        return {"codes": ((dim,), np.dtype(np.uint8)), "scale": ((), np.dtype(np.float32))}

    def encode(self, x: np.ndarray) -> Fields:
        scale = (np.max(np.abs(x), axis=-1) / np.float32(E4M3_MAX)).astype(np.float32)  # [N]
        return {"codes": encode_e4m3(safe_divide(x, scale[:, None])), "scale": scale}

    def decode(self, fields: Fields) -> np.ndarray:
        return decode_e4m3(fields["codes"]) * fields["scale"][:, None]


@dataclass(frozen=True)
class Nvfp4Level:
    """NVFP4 per head vector: e2m1 codes (two per byte, element 2i in the low nibble), an e4m3 scale
    per group of 16 and an fp32 scale per (token, head): value = e2m1 * (group_scale * scale).
    scale = max|x| / (6 * 448) puts the largest group scale at the top of the e4m3 range."""

    name: str = "nvfp4"

    def layout(self, dim: int) -> Layout:
        check_divisible(self.name, dim, NVFP4_GROUP)
        return {
            "codes": ((dim // 2,), np.dtype(np.uint8)),
            "group_scale": ((dim // NVFP4_GROUP,), np.dtype(np.uint8)),
            "scale": ((), np.dtype(np.float32)),
        }

    def encode(self, x: np.ndarray) -> Fields:
        check_divisible(self.name, x.shape[-1], NVFP4_GROUP)
        groups = grouped(x, NVFP4_GROUP)  # [N, G, 16]
        scale = (np.max(np.abs(x), axis=-1) / np.float32(E2M1_MAX * E4M3_MAX)).astype(np.float32)  # [N]
        group_amax = np.max(np.abs(groups), axis=-1)  # [N, G]
        group_scale = encode_e4m3(safe_divide(group_amax / np.float32(E2M1_MAX), scale[:, None]))  # [N, G]
        effective = decode_e4m3(group_scale) * scale[:, None]  # [N, G]
        codes = encode_e2m1(safe_divide(groups, effective[..., None])).reshape(x.shape)  # [N, D]
        return {"codes": pack_nibbles(codes), "group_scale": group_scale, "scale": scale}

    def decode(self, fields: Fields) -> np.ndarray:
        values = decode_e2m1(unpack_nibbles(fields["codes"]))  # [N, D]
        effective = decode_e4m3(fields["group_scale"]) * fields["scale"][:, None]  # [N, G]
        return (grouped(values, NVFP4_GROUP) * effective[..., None]).reshape(values.shape)
