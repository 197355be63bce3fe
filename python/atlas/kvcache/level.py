"""The KV cache level interface: how one head vector [D] is stored and read back.

A level encodes rows of head vectors x [N, D] (float32) into named fields, each [N, ...] of a
fixed per-vector shape and dtype (its `layout`), and decodes them back to float32 [N, D]. The
layout is the storage: bytes per vector are computed from it, and caches allocate from it.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..errors import AtlasError

Fields = dict[str, np.ndarray]
Layout = dict[str, tuple[tuple[int, ...], np.dtype]]


class KVLevel(Protocol):
    name: str

    def layout(self, dim: int) -> Layout: ...

    def encode(self, x: np.ndarray) -> Fields: ...

    def decode(self, fields: Fields) -> np.ndarray: ...


def bytes_per_vector(level: KVLevel, dim: int) -> int:
    """Storage of one head vector of `dim` values, every field counted."""
    fields = level.layout(dim).values()
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize for shape, dt in fields)


def round_trip(level: KVLevel, x: np.ndarray) -> np.ndarray:
    """x [..., D] -> what the cache gives back after storing x [..., D]."""
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])  # [N, D]
    return level.decode(level.encode(rows)).reshape(x.shape)


def check_divisible(level: str, dim: int, group: int) -> None:
    if dim % group:
        raise AtlasError(
            f"--kv-cache-dtype {level} stores head vectors in groups of {group}, but head_dim is {dim}; "
            "use bf16 or fp8"
        )


def grouped(x: np.ndarray, group: int) -> np.ndarray:
    """[N, D] -> [N, D/group, group] (a view)."""
    return x.reshape(x.shape[0], -1, group)


def safe_divide(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """x / scale in float32, 0 where the scale is 0 (an all-zero vector or group)."""
    out = np.zeros(np.broadcast_shapes(x.shape, scale.shape), dtype=np.float32)
    return np.divide(x, scale, out=out, where=scale != 0)
