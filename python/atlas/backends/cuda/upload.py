"""Host -> device conversion of weights and inputs, with a byte progress bar for weights.

Arrays whose leading axes have stride 0 (np.broadcast_to views, e.g. the benchmark's synthetic
expert stacks) are uploaded once and replicated on the device, so the host never materialises
them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from .runtime import CudaRuntime
from .tensor import DeviceTensor, StorageDType

PROGRESS_MIN_BYTES = 1 << 20


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
    raise ValueError(f"unknown storage dtype {dtype!r} (f32, bf16 or i32)")


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
class WeightProgress:
    """A tqdm bar over the expected weight bytes; closes itself when done or at `close`."""

    total_bytes: int
    _bar: Any = None
    _done: int = 0
    _closed: bool = False

    def add(self, nbytes: int) -> None:
        if self._closed or self.total_bytes <= 0 or nbytes < PROGRESS_MIN_BYTES and self._bar is None:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_bytes, unit="B", unit_scale=True, desc="upload weights",
                             leave=False)
        self._done += nbytes
        self._bar.update(nbytes)
        if self._done >= self.total_bytes:
            self.close()

    def close(self) -> None:
        if self._bar is not None and not self._closed:
            self._bar.close()
        self._closed = True


@dataclass
class Uploader:
    rt: CudaRuntime
    progress: WeightProgress = field(default_factory=lambda: WeightProgress(0))

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
        self.progress.add(out.nbytes)
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
