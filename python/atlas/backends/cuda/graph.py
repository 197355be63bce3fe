"""The decode step as a CUDA graph: captured on first use, replayed per token.

Inputs are copied into buffers owned by the graph (device-to-device when they are already on
the device, so the greedy chain argmax -> next ids never visits the host); outputs are the
tensors the captured step returned, rewritten by every replay. A graph is captured again when
the input shapes change or the step arena moved (its generation changed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .runtime import CudaRuntime
from .tensor import DeviceTensor
from .upload import to_storage

Step = Callable[[Any, Any], Any]


@dataclass
class _Captured:
    exec_handle: Any
    ids: DeviceTensor
    positions: DeviceTensor
    output: Any
    arena_generation: int
    arena_mark: int


class GraphedDecodeStep:
    def __init__(self, rt: CudaRuntime, step: Step) -> None:
        self.rt = rt
        self.step = step
        self._graph: _Captured | None = None
        self.captures = 0

    def __call__(self, ids: Any, positions: Any) -> Any:
        graph = self._graph
        if graph is None or not self._fits(graph, ids, positions):
            self._drop()
            # It feeds its buffers itself: `ids` may be in an arena block its step start frees.
            graph = self._capture(ids, positions)
        else:
            self._feed(graph.ids, ids)
            self._feed(graph.positions, positions)
        self.rt.issue_deferred()  # before the arena rewinds under it; the stream is reached directly below
        self.rt.arena.rewind(graph.arena_mark)
        self.rt.driver.graph_launch(graph.exec_handle, self.rt.stream)
        return graph.output

    def _fits(self, graph: _Captured, ids: Any, positions: Any) -> bool:
        return (
            tuple(ids.shape) == graph.ids.shape
            and tuple(positions.shape) == graph.positions.shape
            and graph.arena_generation == self.rt.arena.generation
        )

    def _capture(self, ids: Any, positions: Any) -> _Captured:
        rt = self.rt
        ids_buf = rt.persistent(tuple(ids.shape), "i32")
        positions_buf = rt.persistent(tuple(positions.shape), "i32")
        self._feed(ids_buf, ids)
        self._feed(positions_buf, positions)
        rt.reset_step()
        rt.synchronize()
        rt.driver.begin_capture(rt.stream)
        rt.capturing = True
        try:
            output = self.step(ids_buf, positions_buf)
            rt.issue_deferred()  # a launch still waiting belongs to the step
        except BaseException:
            rt.capturing = False
            _abandon_capture(rt)
            raise
        rt.capturing = False
        exec_handle = rt.driver.end_capture(rt.stream)
        rt.graphs[id(exec_handle)] = exec_handle  # a closing runtime destroys it
        self.captures += 1
        self._graph = _Captured(exec_handle, ids_buf, positions_buf, output, rt.arena.generation,
                                rt.arena.mark())
        return self._graph

    def _feed(self, dst: DeviceTensor, src: Any) -> None:
        if isinstance(src, DeviceTensor):
            if src.ptr != dst.ptr:
                self.rt.copy(dst, src)
        else:
            self.rt.write(dst, to_storage(np.asarray(src), "i32"))

    def _drop(self) -> None:
        """Destroy the graph, unless its runtime closed and so destroyed it already."""
        if self._graph is not None:
            if self.rt.graphs.pop(id(self._graph.exec_handle), None) is not None:
                self.rt.driver.graph_destroy(self._graph.exec_handle)
            self._graph = None

    def __del__(self) -> None:
        try:
            self._drop()
        except Exception:
            pass


def _abandon_capture(rt: CudaRuntime) -> None:
    """End a failed capture so the stream is usable again; its graph is discarded."""
    rt.discard_deferred()
    try:
        rt.driver.graph_destroy(rt.driver.end_capture(rt.stream))
    except Exception:
        pass
