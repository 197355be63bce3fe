"""DeviceTensor: a typed view of device memory (pointer, shape, storage dtype)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

StorageDType = Literal["f32", "bf16", "i32", "u8"]  # u8: packed quantized weights

ITEM_SIZE: dict[str, int] = {"f32": 4, "bf16": 2, "i32": 4, "u8": 1}


@dataclass(frozen=True)
class DeviceTensor:
    """Contiguous, row-major device data. `owner` keeps the allocation alive (None for arena
    memory, which lives until the next step reset)."""

    ptr: int
    shape: tuple[int, ...]
    dtype: StorageDType
    owner: object | None = field(default=None, compare=False, repr=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return ITEM_SIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def reshape(self, *shape: int | tuple[int, ...]) -> DeviceTensor:
        dims = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        new_shape = _resolve_shape(tuple(int(d) for d in dims), self.numel)  # type: ignore[arg-type]
        return DeviceTensor(self.ptr, new_shape, self.dtype, self.owner)

    def rows(self, start: int, stop: int) -> DeviceTensor:
        """The view of rows start..stop-1 along the first dimension."""
        if not 0 <= start <= stop <= self.shape[0]:
            raise ValueError(f"rows({start}, {stop}) out of range for shape {self.shape}")
        row_bytes = math.prod(self.shape[1:]) * self.itemsize
        return DeviceTensor(
            self.ptr + start * row_bytes, (stop - start, *self.shape[1:]), self.dtype, self.owner
        )

    def elements(self, start: int, stop: int) -> DeviceTensor:
        """The 1-D view of flat elements start..stop-1 (a column range of a one-row matrix)."""
        if not 0 <= start <= stop <= self.numel:
            raise ValueError(f"elements({start}, {stop}) out of range for shape {self.shape}")
        return DeviceTensor(self.ptr + start * self.itemsize, (stop - start,), self.dtype, self.owner)


def _resolve_shape(shape: tuple[int, ...], numel: int) -> tuple[int, ...]:
    if shape.count(-1) > 1:
        raise ValueError(f"reshape {shape}: at most one -1")
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        if known == 0 or numel % known:
            raise ValueError(f"cannot reshape {numel} elements to {shape}")
        shape = tuple(numel // known if d == -1 else d for d in shape)
    if math.prod(shape) != numel or any(d < 0 for d in shape):
        raise ValueError(f"cannot reshape {numel} elements to {shape}")
    return shape
