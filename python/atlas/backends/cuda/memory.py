"""Device memory: the per-step bump arena and the persistent allocation pool.

The arena makes step allocations free of cudaMalloc and deterministic: a step that asks for the
same sizes in the same order gets the same addresses, which is what lets a captured CUDA graph be
replayed. It grows by adding blocks when a step needs more (allowed while capturing: the stream
is captured in relaxed mode) and folds them into one block at the next reset; that changes
addresses, so `generation` increments and graphs captured before must be captured again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from atlas.errors import AtlasError

from .driver import CudaError, Driver

ALIGN = 256
GIB = 1 << 30


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass
class _Block:
    ptr: int
    size: int


@dataclass
class StepArena:
    driver: Driver
    initial_bytes: int
    generation: int = 0
    high_water: int = 0
    _blocks: list[_Block] = field(default_factory=list)
    _offset: int = 0  # within the last block
    _used_before_last: int = 0  # bytes used in earlier blocks this step

    def alloc(self, nbytes: int) -> int:
        size = _round_up(max(nbytes, 1), ALIGN)
        if not self._blocks or self._offset + size > self._blocks[-1].size:
            self._grow(size)
        ptr = self._blocks[-1].ptr + self._offset
        self._offset += size
        self.high_water = max(self.high_water, self._used_before_last + self._offset)
        return ptr

    def _grow(self, size: int) -> None:
        if self._blocks:
            self._used_before_last += self._offset
        block_size = max(size, self.initial_bytes, sum(b.size for b in self._blocks) // 2)
        block_size = _round_up(block_size, 1 << 20)
        try:
            ptr = self.driver.mem_alloc(block_size)
        except CudaError as err:
            if "OUT_OF_MEMORY" not in str(err):
                raise
            held = sum(b.size for b in self._blocks)
            raise AtlasError(
                f"the GPU ran out of memory for this step's working memory ({(held + block_size) / GIB:.1f} "
                "GiB needed beside the weights); use a shorter prompt or free GPU memory"
            ) from None
        self._blocks.append(_Block(ptr, block_size))
        self._offset = 0

    def mark(self) -> tuple[int, int, int]:
        return (len(self._blocks), self._offset, self._used_before_last)

    def rewind(self, mark: tuple[int, int, int]) -> None:
        """Forget allocations made after `mark` (same blocks only: after growth, keep going)."""
        if mark[0] == len(self._blocks):
            self._offset, self._used_before_last = mark[1], mark[2]

    def reset(self) -> None:
        """Start a new step. Tensors from the previous step become invalid."""
        if len(self._blocks) > 1:
            total = _round_up(self.high_water, 1 << 20)
            for block in self._blocks:
                self.driver.mem_free(block.ptr)
            self._blocks = [_Block(self.driver.mem_alloc(total), total)]
            self.generation += 1
        self._offset = 0
        self._used_before_last = 0

    def spans(self) -> list[tuple[int, int]]:
        """(ptr, size) of every block, e.g. to poison all scratch memory in tests."""
        return [(block.ptr, block.size) for block in self._blocks]

    def release(self) -> None:
        for block in self._blocks:
            self.driver.mem_free(block.ptr)
        self._blocks = []


class Allocation:
    """Owner of one persistent allocation; returns it to the pool when garbage-collected."""

    __slots__ = ("ptr", "size", "__weakref__")

    def __init__(self, ptr: int, size: int) -> None:
        self.ptr = ptr
        self.size = size


CACHED_MAX_BYTES = 1 << 20


@dataclass
class PersistentPool:
    """cuMemAlloc with a free list for small sizes, so per-step uploads (ids, positions) reuse
    memory. Larger allocations are freed at the next `trim()` (never from a finalizer, which may
    run during a graph capture)."""

    driver: Driver
    allocated_bytes: int = 0
    _free: dict[int, list[int]] = field(default_factory=dict)
    _pending_free: list[tuple[int, int]] = field(default_factory=list)
    _owned: dict[int, int] = field(default_factory=dict)  # every cuMemAlloc not yet freed: ptr -> size

    def alloc(self, nbytes: int) -> Allocation:
        size = _round_up(max(nbytes, 1), ALIGN)
        cached = self._free.get(size)
        if cached:
            ptr = cached.pop()
        else:
            self.trim()
            ptr = self.driver.mem_alloc(size)
            self._owned[ptr] = size
            self.allocated_bytes += size
        allocation = Allocation(ptr, size)
        weakref.finalize(allocation, self._give_back, ptr, size)
        return allocation

    def _give_back(self, ptr: int, size: int) -> None:
        if ptr not in self._owned:  # freed by release() while its owner lived on
            return
        if size <= CACHED_MAX_BYTES:
            self._free.setdefault(size, []).append(ptr)
        else:
            self._pending_free.append((ptr, size))

    def trim(self) -> None:
        """Free the large allocations dropped since the last trim (call outside capture)."""
        while self._pending_free:
            ptr, size = self._pending_free.pop()
            self.driver.mem_free(ptr)
            del self._owned[ptr]
            self.allocated_bytes -= size

    def release(self) -> None:
        """Free every allocation, in use or not (the runtime is closing: nothing runs on them again)."""
        owned, self._owned = self._owned, {}
        self._free.clear()
        self._pending_free.clear()
        self.allocated_bytes = 0
        for ptr in owned:
            self.driver.mem_free(ptr)
