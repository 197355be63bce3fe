"""Device-to-host reads that finish later, so the host can queue more work before it waits.

The decode loop reads token N back while step N+1 already runs (atlas.decode_loop). A read is an
async copy into a slot of one page-locked buffer followed by an event; `result()` waits on that
event alone. A copy into pageable memory would return only once it landed, that is once every
step queued before it had run, so nothing could be queued behind it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from .driver import Driver, Handle
from .tensor import DeviceTensor, StorageDType

SLOTS = 8  # reads in flight at most; the decode loop keeps two
SLOT_BYTES = 256  # token ids and a few scalars, never a row of logits
HOST_DTYPES: dict[StorageDType, type] = {"f32": np.float32, "bf16": np.uint16, "i32": np.int32, "u8": np.uint8}


@dataclass(frozen=True)
class PendingRead:
    """A tensor's raw storage on its way to the host."""

    reads: PinnedReads
    slot: int
    ticket: int
    shape: tuple[int, ...]
    dtype: StorageDType

    def result(self) -> np.ndarray:
        """The bytes as a host array (bf16 as uint16), once the copy landed."""
        return self.reads.take(self)


class PinnedReads:
    """A ring of SLOTS page-locked slots, each with its event; memory is taken at the first read."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.base = 0  # the page-locked buffer, SLOTS * SLOT_BYTES
        self.events: list[Handle] = []
        self.tickets = [0] * SLOTS  # the read each slot holds now
        self.issued = 0

    def start(self, src: DeviceTensor, stream: Handle) -> PendingRead:
        """Queue src's copy into the next slot, in stream order after everything queued so far."""
        if src.nbytes > SLOT_BYTES:
            raise ValueError(f"a pending read holds at most {SLOT_BYTES} bytes; {src.shape} {src.dtype} is {src.nbytes}")
        if not self.base:
            self.base = self.driver.host_alloc(SLOTS * SLOT_BYTES)
            self.events = [self.driver.event_create() for _ in range(SLOTS)]
        slot = self.issued % SLOTS
        self.driver.event_synchronize(self.events[slot])  # the slot's last copy landed (a free slot: at once)
        self.issued += 1
        self.tickets[slot] = self.issued
        if src.nbytes:
            self.driver.memcpy_dtoh(self.base + slot * SLOT_BYTES, src.ptr, src.nbytes, stream)
        self.driver.event_record(self.events[slot], stream)
        return PendingRead(self, slot, self.issued, src.shape, src.dtype)

    def take(self, read: PendingRead) -> np.ndarray:
        if self.tickets[read.slot] != read.ticket:
            raise RuntimeError(f"a pending read was overtaken: more than {SLOTS} reads were started before its result")
        self.driver.event_synchronize(self.events[read.slot])
        out = np.empty(read.shape, dtype=HOST_DTYPES[read.dtype])
        ctypes.memmove(out.ctypes.data, self.base + read.slot * SLOT_BYTES, out.nbytes)
        return out

    def release(self) -> None:
        """Free the page-locked buffer (after the stream drained: no copy is landing in it)."""
        if self.base:
            self.driver.host_free(self.base)
            self.base = 0
