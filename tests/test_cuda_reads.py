"""Pending reads (atlas.backends.cuda.reads): a small tensor's copy into a page-locked slot, waited
for at result(); a ring of slots, so a read kept past SLOTS later ones is refused instead of
returning another read's bytes; the page-locked memory goes back with the runtime."""

from __future__ import annotations

import numpy as np
import pytest

from atlas.backends.cuda.driver import CudaError
from atlas.backends.cuda.reads import SLOT_BYTES, SLOTS
from test_cuda_select import make_runtime


def test_pending_reads_give_each_tensor_back(rng: np.random.Generator) -> None:
    rt, driver = make_runtime()
    values = [rng.integers(-2**31, 2**31 - 1, size=int(rng.integers(1, SLOT_BYTES // 4 + 1)), dtype=np.int32)
              for _ in range(SLOTS)]
    tensors = [rt.persistent(v.shape, "i32") for v in values]
    for tensor, v in zip(tensors, values):
        rt.write(tensor, v)
    pending = [rt.read_later(t) for t in tensors]
    for read, v in zip(reversed(pending), reversed(values)):  # in any order, while all are in flight
        np.testing.assert_array_equal(read.result(), v)
    floats = rng.standard_normal(5).astype(np.float32)
    tensor = rt.persistent((5,), "f32")
    rt.write(tensor, floats)
    np.testing.assert_array_equal(rt.read_later(tensor).result(), floats)
    assert len(driver.pinned) == 1  # one buffer for every slot
    rt.close()
    assert not driver.pinned


def test_a_read_overtaken_by_the_ring_is_refused() -> None:
    rt, _ = make_runtime()
    tensor = rt.zeros((1,), "i32")
    first = rt.read_later(tensor)
    later = [rt.read_later(tensor) for _ in range(SLOTS)]
    with pytest.raises(RuntimeError, match="overtaken"):
        first.result()
    assert all(int(read.result()[0]) == 0 for read in later)


def test_wide_reads_and_reads_in_a_capture_are_refused() -> None:
    rt, driver = make_runtime()
    with pytest.raises(ValueError, match=f"at most {SLOT_BYTES} bytes"):
        rt.read_later(rt.zeros((SLOT_BYTES // 4 + 1,), "f32"))
    driver.begin_capture(rt.stream)
    rt.capturing = True
    with pytest.raises(CudaError, match="device-to-host copy inside a captured decode step"):
        rt.read_later(rt.empty((1,), "i32"))
    rt.capturing = False
    driver.end_capture(rt.stream)
