"""What each kernel costs inside the replayed decode graph: the step captured again with every
launch of one kernel issued twice, against the plain step. The difference is that kernel's share
of the replayed step (its run and the gap it adds), without the floor an event pair puts on
each eager launch (bench/step_profile.py; its single rms_norm launch read 9.5 us on an H200,
2026-12-04, where the whole replayed step with 473 launches took 3585 us).

A doubled kernel that updates in place (the DeltaNet state, the KV cache, the residual stream)
changes the numbers the step computes, not the work it does."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from launch_hook import Launch, launch_hook, step_launches

STEPS = 128  # timed decode steps per variant (~0.5 s on an H200)
TOP = 8  # kernels named in the summary line

TimeDecode = Callable[[Any, list[int], int], tuple[float, int]]  # bench/decode.py's time_decode


def doubled_launches(rt: Any, kernel: str) -> AbstractContextManager[None]:
    """For the block: every launch of `kernel` is issued twice."""

    def twice(launch: Launch, name: str, *args: Any) -> None:
        for _ in range(2 if name == kernel else 1):
            launch(name, *args)

    return launch_hook(rt, twice)


def weight_bytes(kernel: str, params: Any) -> int:
    """Bytes of bf16 weights a decode launch streams (0 for the kernels that read activations,
    states or caches alone): with the in-graph cost, the kernel's achieved bandwidth."""
    from atlas.kernel_params import dense, linear_moe

    if isinstance(params, dense.LinearNormParams):  # ATLAS_NORM=fused: the linear inside
        params = params.linear
    elif isinstance(params, linear_moe.RouterNormParams):
        params = params.router
    if isinstance(params, dense.LinearParams) and kernel.startswith("atlas_gemv"):
        return 2 * params.n * params.k
    if isinstance(params, linear_moe.RouterParams) and kernel.startswith(("atlas_router_logits", "atlas_router_fused")):
        return 2 * (params.num_experts + params.shared_expert) * params.hidden
    if isinstance(params, linear_moe.MoeGateUpGemvParams):
        return 2 * params.num_slots * 2 * params.inter * params.hidden
    if isinstance(params, linear_moe.MoeDownGemvParams):
        return 2 * params.num_tokens * params.top_k * params.hidden * params.inter
    return 0


def launch_census(engine: Any, token: Any, position: int) -> tuple[Counter[str], Counter[str]]:
    """Launches and weight bytes per kernel in one eager decode step from `token` (a [1] i32
    device tensor)."""
    counts: Counter[str] = Counter()
    weights: Counter[str] = Counter()
    for name, params in step_launches(engine, token, position):
        counts[name] += 1
        weights[name] += weight_bytes(name, params)
    return counts, weights


def step_us(engine: Any, prompt: list[int], time_decode: TimeDecode) -> float:
    """Microseconds per replayed greedy step, the graph captured afresh."""
    engine.reset()
    rate, _ = time_decode(engine, prompt, STEPS)
    return 1e6 / rate


def marginal_costs(engine: Any, prompt: list[int], token: Any, time_decode: TimeDecode,
                   until: float = math.inf) -> dict[str, Any]:
    """Per kernel: launches per step and the microseconds its doubling adds to the replayed step
    (and for the weight-streaming kernels their weight MB per step and GB/s at that cost, an upper
    bound: the doubled launch may find part of its weights still in L2; bench/weight_bandwidth.py
    times each alone); the plain step timed before and after (their difference is the noise to
    read the rest by). Kernels are doubled heaviest weights first, then most launches; those whose
    turn comes too close to `until` (perf_counter time) for one more variant and the final step
    are listed under "skipped" instead, so a stage's time limit still finds the JSON written."""
    rt = engine.backend.rt
    counts, weights = launch_census(engine, token, len(prompt))
    base = step_us(engine, prompt, time_decode)
    kernels: dict[str, dict[str, Any]] = {}
    skipped: list[str] = []
    longest = 0.0  # seconds of the slowest variant so far: what the next one and the final step may take
    for kernel in sorted(counts, key=lambda k: (-weights[k], -counts[k])):
        started = time.perf_counter()
        if started + 2 * longest > until:
            skipped.append(kernel)
            continue
        with doubled_launches(rt, kernel):
            added = step_us(engine, prompt, time_decode) - base
        longest = max(longest, time.perf_counter() - started)
        kernels[kernel] = kernel_row(counts[kernel], weights[kernel], added)
    again = step_us(engine, prompt, time_decode)
    engine.reset()
    summed = sum(k["us"] for k in kernels.values())
    return {"steps": STEPS, "step_us": base, "step_us_again": again, "launches_per_step": sum(counts.values()),
            "kernel_us_sum": summed, "outside_kernels_us": None if skipped else base - summed, "skipped": skipped,
            "kernels": dict(sorted(kernels.items(), key=lambda item: -item[1]["us"]))}


def kernel_row(launches: int, weight_bytes: int, added: float) -> dict[str, Any]:
    row: dict[str, Any] = {"launches": launches, "us": round(added, 2), "us_per_launch": round(added / launches, 3)}
    if weight_bytes:
        row["weight_mb"] = round(weight_bytes / 1e6, 3)
        row["gb_s"] = round(weight_bytes / 1e3 / added, 1) if added > 0 else None
    return row


def kernel_cost(name: str, row: dict[str, Any]) -> str:
    rate = f", {row['gb_s']:.0f} GB/s" if row.get("gb_s") else ""
    return f"{name} {row['us']:.0f} ({row['us_per_launch']:.1f}/launch{rate})"


def summary_line(marginal: dict[str, Any]) -> str:
    top = ", ".join(kernel_cost(k, v) for k, v in list(marginal["kernels"].items())[:TOP])
    outside = marginal["outside_kernels_us"]
    skipped = marginal.get("skipped", [])
    return (f"in-graph cost: step {marginal['step_us']:.0f} us (again {marginal['step_us_again']:.0f}), "
            f"{marginal['launches_per_step']} launches, kernels {marginal['kernel_us_sum']:.0f} us, "
            f"outside {'?' if outside is None else f'{outside:.0f}'} us; by kernel (us): {top}"
            + (f"; not doubled (budget spent): {', '.join(skipped)}" if skipped else ""))
