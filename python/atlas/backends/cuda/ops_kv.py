"""Op wrappers of the quantized KV cache kernels (kernels/include/atlas/kv_quant.cuh).

A quantized cache is one device buffer per K or V holding the level's fields (atlas.kvcache
layouts) back to back, each [capacity, kv_heads, field bytes] in layout order, so its bytes are
exactly the numpy encoder's fields concatenated. `attention` writes the step's rows with the
level's encoder kernel, then attends through ops_dense.attend with the level's kernels."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from atlas.kernel_params import dense as kp
from atlas.kvcache.level import bytes_per_vector
from atlas.kvcache.levels import get_level

from .ops_common import ceil_div
from .ops_common import expect as _expect
from .ops_dense import ATTN_HEAD_DIMS, CachedKV, attend
from .tensor import DeviceTensor

if TYPE_CHECKING:
    from ..base import KVCache
    from .runtime import CudaRuntime

QUANTIZED_LEVELS = ("fp8", "nvfp4", "turbo8", "turbo4", "turbo3")
KV_WRITE_WARPS = 4  # kv_quant.cuh kKvWriteWarps: one warp per (k or v, token, kv head) vector
KV_WRITE_THREADS = 32 * KV_WRITE_WARPS


@dataclass(frozen=True)
class QuantizedKVCache:
    """One K or V cache [S, Hkv, D] stored at a quantized level (its fields back to back, bytes)."""

    level: str
    shape: tuple[int, int, int]  # [S, Hkv, D]
    data: DeviceTensor  # [bytes] u8

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def field_bytes(level: str, dim: int) -> list[tuple[str, int]]:
    """(field name, bytes per head vector) in layout order: the order of the buffer's regions."""
    layout = get_level(level).layout(dim)
    return [(name, int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize) for name, (shape, dt) in layout.items()]


def cache_bytes(level: str, shape: tuple[int, int, int]) -> int:
    capacity, heads, dim = shape
    return capacity * heads * bytes_per_vector(get_level(level), dim)


def quantized_cache(rt: CudaRuntime, level: str, shape: tuple[int, int, int]) -> QuantizedKVCache:
    """A zero-filled cache (persistent memory; every field is whole 4-byte words per vector)."""
    _expect(level in QUANTIZED_LEVELS, f"quantized_cache: level {level!r}, expected one of {QUANTIZED_LEVELS}")
    _expect(shape[2] in ATTN_HEAD_DIMS, f"quantized_cache: head dim {shape[2]}, kernels exist for {ATTN_HEAD_DIMS}")
    total = cache_bytes(level, shape)
    return QuantizedKVCache(level, tuple(shape), rt.zeros((total,), "u8"))  # type: ignore[arg-type]


def fields_from_bytes(level: str, shape: tuple[int, int, int], raw: np.ndarray) -> dict[str, np.ndarray]:
    """The cache buffer's bytes -> numpy's fields {name: [S, Hkv, ...]} (atlas.kvcache layout)."""
    capacity, heads, dim = shape
    flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    fields, offset = {}, 0
    for name, (field_shape, dt) in get_level(level).layout(dim).items():
        count = capacity * heads * int(np.prod(field_shape, dtype=np.int64))
        size = count * np.dtype(dt).itemsize
        fields[name] = flat[offset : offset + size].view(dt).reshape(capacity, heads, *field_shape)
        offset += size
    return fields


def field_rows(cache: QuantizedKVCache, stop: int) -> Iterator[tuple[str, DeviceTensor, tuple[int, ...], np.dtype]]:
    """(name, the view of the field's rows 0..stop-1 in bytes, its shape per row, its dtype) of
    each field: the buffer holds each field's S rows back to back (fields_from_bytes)."""
    capacity, heads, dim = cache.shape
    offset = 0
    for name, (field_shape, dt) in get_level(cache.level).layout(dim).items():
        row_bytes = heads * int(np.prod(field_shape, dtype=np.int64)) * np.dtype(dt).itemsize
        yield name, cache.data.elements(offset, offset + stop * row_bytes), (heads, *field_shape), np.dtype(dt)
        offset += capacity * row_bytes


def stored_rows(rt: CudaRuntime, cache: QuantizedKVCache, stop: int) -> dict[str, np.ndarray]:
    """Rows 0..stop-1 of each field, as numpy's fields [stop, Hkv, ...] (Backend.cache_rows)."""
    return {name: rt.read(view).view(dt).reshape(stop, *row) for name, view, row, dt in field_rows(cache, stop)}


def write_stored_rows(rt: CudaRuntime, cache: QuantizedKVCache, fields: dict[str, np.ndarray]) -> None:
    """The inverse of stored_rows."""
    stop = len(next(iter(fields.values())))
    for name, view, row, dt in field_rows(cache, stop):
        array = fields[name]
        _expect(array.shape == (stop, *row) and array.dtype == dt,
                f"write_stored_rows: field {name} {array.shape} {array.dtype}, expected {(stop, *row)} {dt}")
        rt.write(view, np.ascontiguousarray(array).view(np.uint8).reshape(-1))


def _check(q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, k_cache: QuantizedKVCache,
           v_cache: QuantizedKVCache, positions: DeviceTensor) -> None:
    tokens, q_heads, dim = q.shape
    capacity, kv_heads, cache_dim = k_cache.shape
    _expect(k_cache.level == v_cache.level and k_cache.shape == v_cache.shape,
            f"attention: k cache {k_cache.level} {k_cache.shape} vs v cache {v_cache.level} {v_cache.shape}")
    _expect(k.shape == (tokens, kv_heads, dim) and v.shape == k.shape and cache_dim == dim,
            f"attention: k {k.shape} / v {v.shape} vs q {q.shape}, cache {k_cache.shape}")
    _expect(q_heads % kv_heads == 0, f"attention: {q_heads} q heads not a multiple of {kv_heads} kv heads")
    _expect(positions.numel == tokens and positions.dtype == "i32", f"attention: positions {positions.shape} {positions.dtype}")
    _expect(all(t.dtype == "f32" for t in (q, k, v)), "attention: q, k, v must be f32")
    _expect(cache_bytes(k_cache.level, k_cache.shape) == k_cache.nbytes, f"attention: {k_cache.level} cache buffer size")


def write(rt: CudaRuntime, k: DeviceTensor, v: DeviceTensor, k_cache: QuantizedKVCache, v_cache: QuantizedKVCache,
          positions: DeviceTensor) -> None:
    """Encodes k, v [T, Hkv, D] into the caches at rows positions[t] (rows outside are skipped)."""
    tokens, kv_heads, dim = k.shape
    vectors = 2 * tokens * kv_heads
    if vectors == 0:
        return
    params = kp.KvCacheWriteParams(k=k.ptr, v=v.ptr, k_cache=k_cache.data.ptr, v_cache=v_cache.data.ptr,
                                   positions=positions.ptr, tokens=tokens, kv_heads=kv_heads, head_dim=dim,
                                   capacity=k_cache.shape[0])
    grid = (ceil_div(vectors, KV_WRITE_WARPS), 1, 1)
    rt.launch(f"atlas_kv_write_{k_cache.level}", grid, (KV_WRITE_THREADS, 1, 1), params)


def attention(rt: CudaRuntime, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, cache: KVCache,
              positions: DeviceTensor, scale: float, *, prefill: str = "simt") -> DeviceTensor:
    """ops_dense.attention over a quantized cache (cache.k, cache.v: QuantizedKVCache): write this
    step's rows, then attend (`prefill` as ops_dense.attend)."""
    k_cache, v_cache = cache.k, cache.v
    _check(q, k, v, k_cache, v_cache, positions)
    capacity, kv_heads, _ = k_cache.shape
    write(rt, k, v, k_cache, v_cache, positions)
    cache = CachedKV(k_cache.data.ptr, v_cache.data.ptr, capacity, kv_heads, f"_{k_cache.level}")
    return attend(rt, q, cache, positions, scale, prefill=prefill)
