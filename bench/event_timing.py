"""Device time between a pair of events on the runtime's stream: the median over repeats after
one warm-up call (module load, first touch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def median_ms(rt: Any, run: Callable[[], Any], repeats: int, reset_step: bool = True) -> float:
    """Median milliseconds of `run` (host launch gaps included); `reset_step` recycles the step
    arena before each call (not for a graph replay, whose captured memory it could move)."""
    start, end = rt.driver.event_create(), rt.driver.event_create()
    times = []
    for _ in range(repeats + 1):
        if reset_step:
            rt.reset_step()
        rt.driver.event_record(start, rt.stream)
        run()
        rt.driver.event_record(end, rt.stream)
        rt.driver.event_synchronize(end)
        times.append(rt.driver.event_elapsed_ms(start, end))
    return float(np.median(times[1:]))


def graph_replay_ms(rt: Any, run: Callable[[], Any], repeats: int) -> float:
    """Median milliseconds of one replay of `run` captured as a CUDA graph (an eager call first,
    so the arena already holds what the capture allocates)."""
    rt.reset_step()
    run()
    rt.reset_step()
    rt.synchronize()
    rt.driver.begin_capture(rt.stream)
    rt.capturing = True
    try:
        run()
    finally:
        rt.capturing = False
        graph = rt.driver.end_capture(rt.stream)
    try:
        return median_ms(rt, lambda: rt.driver.graph_launch(graph, rt.stream), repeats, reset_step=False)
    finally:
        rt.driver.graph_destroy(graph)
