"""What each kernel costs inside the replayed decode graph: the step captured again with every
launch of one kernel issued twice, against the plain step. The difference is that kernel's share
of the replayed step (its run and the gap it adds), without the floor an event pair puts on
each eager launch (bench/step_profile.py; its single rms_norm launch read 9.5 us on an H200,
2026-12-04, where the whole replayed step with 473 launches took 3585 us).

A doubled kernel that updates in place (the DeltaNet state, the KV cache, the residual stream)
changes the numbers the step computes, not the work it does."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

STEPS = 128  # timed decode steps per variant (~0.5 s on an H200)
TOP = 8  # kernels named in the summary line

TimeDecode = Callable[[Any, list[int], int], tuple[float, int]]  # bench/decode.py's time_decode


class DoubledLaunches:
    """Wraps rt.launch for the duration: every launch of `kernel` is issued twice."""

    def __init__(self, rt: Any, kernel: str) -> None:
        self.rt, self.kernel = rt, kernel
        self._launch = rt.launch

    def __enter__(self) -> DoubledLaunches:
        def twice(kernel: str, grid: Any, block: Any, params: Any, smem: int = 0) -> None:
            self._launch(kernel, grid, block, params, smem)
            if kernel == self.kernel:
                self._launch(kernel, grid, block, params, smem)

        self.rt.launch = twice
        return self

    def __exit__(self, *exc: object) -> None:
        del self.rt.launch  # the class's method again


def launch_census(engine: Any, token: Any, position: int) -> Counter[str]:
    """Launches per kernel in one eager decode step from `token` (a [1] i32 device tensor)."""
    rt = engine.backend.rt
    counts: Counter[str] = Counter()
    launch = rt.launch

    def counted(kernel: str, grid: Any, block: Any, params: Any, smem: int = 0) -> None:
        counts[kernel] += 1
        launch(kernel, grid, block, params, smem)

    rt.launch = counted
    try:
        engine.eager_decode(token, position)
        rt.synchronize()
    finally:
        del rt.launch
    return counts


def step_us(engine: Any, prompt: list[int], time_decode: TimeDecode) -> float:
    """Microseconds per replayed greedy step, the graph captured afresh."""
    engine.reset()
    rate, _ = time_decode(engine, prompt, STEPS)
    return 1e6 / rate


def marginal_costs(engine: Any, prompt: list[int], token: Any, time_decode: TimeDecode) -> dict[str, Any]:
    """Per kernel: launches per step and the microseconds its doubling adds to the replayed step;
    the plain step timed before and after (their difference is the noise to read the rest by)."""
    rt = engine.backend.rt
    counts = launch_census(engine, token, len(prompt))
    base = step_us(engine, prompt, time_decode)
    kernels = {}
    for kernel, launches in counts.items():
        with DoubledLaunches(rt, kernel):
            added = step_us(engine, prompt, time_decode) - base
        kernels[kernel] = {"launches": launches, "us": round(added, 2), "us_per_launch": round(added / launches, 3)}
    again = step_us(engine, prompt, time_decode)
    engine.reset()
    summed = sum(k["us"] for k in kernels.values())
    return {"steps": STEPS, "step_us": base, "step_us_again": again, "launches_per_step": sum(counts.values()),
            "kernel_us_sum": summed, "outside_kernels_us": base - summed,
            "kernels": dict(sorted(kernels.items(), key=lambda item: -item[1]["us"]))}


def summary_line(marginal: dict[str, Any]) -> str:
    top = ", ".join(f"{k} {v['us']:.0f} ({v['us_per_launch']:.1f}/launch)" for k, v in list(marginal["kernels"].items())[:TOP])
    return (f"in-graph cost: step {marginal['step_us']:.0f} us (again {marginal['step_us_again']:.0f}), "
            f"{marginal['launches_per_step']} launches, kernels {marginal['kernel_us_sum']:.0f} us, "
            f"outside {marginal['outside_kernels_us']:.0f} us; by kernel (us): {top}")
