"""Where a decode step's device time goes: every kernel of an eager decode step timed between a
pair of events, summed by kernel over a few steps, beside the graph-replayed step's own time. The
difference is what launching costs (gaps between kernels, the pick and the token read back): the
number that says whether fewer launches (fused forms) or faster kernels pay more.

Eager launches are slower to issue than the device runs small kernels, so each profiled step
queues behind a long device copy: the launches and events are all enqueued before the device
reaches them, and an event pair brackets its kernel's run, not the host's launch latency."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from event_timing import median_ms
from launch_hook import Launch, launch_hook

STEPS = 3
BACK_TO_BACK = 32  # graph-replayed steps enqueued without a read-back between them
QUEUE_COPIES = 16  # back-to-back copies of QUEUE_BYTES: ~7 ms on an H200, longer than enqueuing a step
QUEUE_BYTES = 1 << 30
TOP = 8  # kernels named in the summary line


class LaunchTimes:
    """An event pair around every launch passed through `hook` (with launch_hook)."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.records: list[tuple[str, Any, Any]] = []

    def hook(self, launch: Launch, kernel: str, *args: Any) -> None:
        driver, stream = self.rt.driver, self.rt.stream
        start, end = driver.event_create(), driver.event_create()
        driver.event_record(start, stream)
        launch(kernel, *args)
        driver.event_record(end, stream)
        self.records.append((kernel, start, end))

    def by_kernel(self, steps: int) -> dict[str, dict[str, float]]:
        """kernel -> launches and device microseconds per step, the slowest first."""
        elapsed = self.rt.driver.event_elapsed_ms
        totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for kernel, start, end in self.records:
            totals[kernel][0] += 1
            totals[kernel][1] += 1e3 * elapsed(start, end)
        rows = {k: {"launches": n / steps, "us": us / steps} for k, (n, us) in totals.items()}
        return dict(sorted(rows.items(), key=lambda item: -item[1]["us"]))


def queue_ahead(rt: Any, scratch: tuple[Any, Any], copies: int) -> None:
    """Device copies that keep the stream busy while the host enqueues the step behind them."""
    src, dst = scratch
    for _ in range(copies):
        rt.driver.memcpy_dtod(dst.ptr, src.ptr, src.nbytes, rt.stream)


def back_to_back_step_us(engine: Any, token: Any, position: int) -> float:
    """Device microseconds per graph-replayed decode step when BACK_TO_BACK steps are enqueued
    with nothing read back between them (all from `token` at `position`): the step with no host gap,
    since the host enqueues a step faster than the device runs one."""
    def steps() -> None:
        for _ in range(BACK_TO_BACK):
            engine.decode_tensor(token, position)

    return 1e3 * median_ms(engine.backend.rt, steps, repeats=2, reset_step=False) / BACK_TO_BACK


def profile_decode(engine: Any, token: Any, position: int, graph_step_us: float) -> dict[str, Any]:
    """STEPS eager decode steps from `token` (a [1] i32 device tensor) at `position`: per kernel
    launches and device time per step; their sum beside `graph_step_us` (a graph-replayed step,
    pick and read-back included) and the replayed step back to back (no pick, no host gap)."""
    rt = engine.backend.rt
    device_step_us = back_to_back_step_us(engine, token, position)
    scratch = (rt.persistent((QUEUE_BYTES // 4,), "f32"), rt.persistent((QUEUE_BYTES // 4,), "f32"))
    rt.memset_zero(scratch[0])
    timed = LaunchTimes(rt)
    with launch_hook(rt, timed.hook):
        for step in range(STEPS):
            queue_ahead(rt, scratch, QUEUE_COPIES)
            engine.eager_decode(token, position + step)
            rt.synchronize()
    kernels = timed.by_kernel(STEPS)
    kernel_us = sum(row["us"] for row in kernels.values())
    return {
        "steps": STEPS, "launches_per_step": sum(row["launches"] for row in kernels.values()),
        "kernel_us_per_step": kernel_us, "graph_step_us": graph_step_us,
        "back_to_back_step_us": device_step_us, "host_gap_us": graph_step_us - device_step_us,
        "outside_kernels_us_per_step": graph_step_us - kernel_us,
        "kernels": {k: {"launches": round(v["launches"], 2), "us": round(v["us"], 2)} for k, v in kernels.items()},
    }


def summary_line(profile: dict[str, Any]) -> str:
    top = ", ".join(f"{k} {v['us']:.0f}" for k, v in list(profile["kernels"].items())[:TOP])
    back_to_back = ""
    if "back_to_back_step_us" in profile:  # older results lack it
        back_to_back = (f" ({profile['back_to_back_step_us']:.0f} back to back, so {profile['host_gap_us']:.0f} us of "
                        "pick, read-back and host per token)")
    return (f"decode step: {profile['graph_step_us']:.0f} us replayed{back_to_back}, "
            f"{profile['kernel_us_per_step']:.0f} us in "
            f"{profile['launches_per_step']:.0f} kernels, {profile['outside_kernels_us_per_step']:.0f} us outside "
            f"them; by kernel (us): {top}")
