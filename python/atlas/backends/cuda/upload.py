"""Host -> device conversion of weights and inputs (the loader shows the weight progress bar).

Arrays whose leading axes have stride 0 (np.broadcast_to views, e.g. the benchmark's synthetic
expert stacks) are uploaded once and replicated on the device, so the host never materialises
them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .runtime import CudaRuntime
from .tensor import DeviceTensor, StorageDType


def to_storage(array: np.ndarray, dtype: StorageDType) -> np.ndarray:
    """Host array in the device storage format (bf16 as its uint16 bits, round to nearest even)."""
    if dtype == "bf16":
        if array.dtype == ml_dtypes.bfloat16:
            return np.ascontiguousarray(array).view(np.uint16)
        return np.ascontiguousarray(array, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    if dtype == "f32":
        return np.ascontiguousarray(array, dtype=np.float32)
    if dtype == "i32":
        return np.ascontiguousarray(array, dtype=np.int32)
    if dtype == "u8":  # packed quantized codes (uint8 or float8 storage), bytes as they are
        if array.dtype.itemsize != 1:
            raise ValueError(f"u8 storage takes 1-byte elements, got {array.dtype}")
        return np.ascontiguousarray(array).view(np.uint8)
    raise ValueError(f"unknown storage dtype {dtype!r} (f32, bf16, i32 or u8)")


def from_storage(raw: np.ndarray, dtype: StorageDType) -> np.ndarray:
    if dtype == "bf16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw


def _broadcast_depth(array: np.ndarray) -> int:
    """How many leading axes are stride-0 repeats."""
    depth = 0
    while depth < array.ndim - 1 and array.strides[depth] == 0 and array.shape[depth] > 1:
        depth += 1
    return depth


@dataclass
class Uploader:
    rt: CudaRuntime

    def upload(self, array: np.ndarray, dtype: StorageDType) -> DeviceTensor:
        array = np.asarray(array)
        shape = tuple(int(d) for d in array.shape)
        depth = _broadcast_depth(array)
        base = array[(0,) * depth] if depth else array
        host = to_storage(base, dtype)
        out = self.rt.persistent(shape, dtype)
        tile = DeviceTensor(out.ptr, host.shape, dtype, out.owner)
        self.rt.write(tile, host)
        self._replicate(out, tile.nbytes, math.prod(shape[:depth]))
        return out

    def _replicate(self, out: DeviceTensor, tile_bytes: int, copies: int) -> None:
        """Fill out with `copies` repeats of its first tile_bytes by doubling device copies."""
        filled = 1
        while filled < copies:
            count = min(filled, copies - filled)
            self.rt.driver.memcpy_dtod(out.ptr + filled * tile_bytes, out.ptr, count * tile_bytes,
                                       self.rt.stream)
            filled += count
        if copies > 1:
            self.rt.synchronize()
