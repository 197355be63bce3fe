"""Each weight-streaming decode kernel alone: every bf16 GEMV shape of one decode step, and the
MoE expert step (gate_up + down over top_k + 1 experts), launched LAUNCHES times back to back in a
captured graph over weight copies (or expert choices) that add up to several times the L2, so
each launch reads its weights from memory. GB/s per shape against the copy roofline says whether
a kernel streams its weights well on its own; step_marginal's in-graph cost doubles a launch on
the same weights, which the second launch may partly find in L2 (50 MB on an H200)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
from event_timing import graph_replay_ms
from launch_hook import step_launches

LAUNCHES = 24  # per graph replay
REPEATS = 5  # replays timed (median)
SPREAD_BYTES = 384 << 20  # the weights one replay cycles through: ~8 H200 L2s
MAX_COPIES = 64  # small shapes (the demo's) stay a few allocations
EXPERT_CHOICES = 16  # distinct expert sets cycled through by the MoE step


def gemv_shapes(engine: Any, token: Any, position: int) -> Counter[tuple[int, int]]:
    """(n, k) of each one-token bf16 GEMV in one eager decode step from `token`, with its launches."""
    return Counter((params.n, params.k) for name, params in step_launches(engine, token, position)
                   if name.startswith("atlas_gemv") and params.tokens == 1)


def time_gemv(backend: Any, n: int, k: int, rng: np.random.Generator) -> float:
    """Microseconds per launch of x [1, k] @ W.T over rotating copies of a bf16 W [n, k]."""
    rt = backend.rt
    copies = min(MAX_COPIES, max(1, math.ceil(SPREAD_BYTES / (2 * n * k))))
    weights = [rt.zeros((n, k), "bf16") for _ in range(copies)]  # zeros stream like any other bits
    x = backend.upload(rng.standard_normal((1, k), dtype=np.float32), "f32")  # [1, k]

    def run() -> None:
        for i in range(LAUNCHES):
            backend.linear(x, weights[i % copies])

    return 1e3 * graph_replay_ms(rt, run, REPEATS) / LAUNCHES


@dataclass(frozen=True)
class ExpertShape:
    experts: int
    slots: int  # experts per token: top_k, and the shared expert when stacked
    hidden: int
    inter: int


def time_moe_step(backend: Any, shape: ExpertShape, rng: np.random.Generator) -> float:
    """Microseconds per one-token expert step over cycled expert sets of a stacked bf16
    [E, 2I, H] / [E, H, I] pair."""
    rt = backend.rt
    gate_up = rt.zeros((shape.experts, 2 * shape.inter, shape.hidden), "bf16")
    down = rt.zeros((shape.experts, shape.hidden, shape.inter), "bf16")
    x = backend.upload(rng.standard_normal((1, shape.hidden), dtype=np.float32), "f32")  # [1, H]
    route = backend.upload(np.full((1, shape.slots), 1.0 / shape.slots, dtype=np.float32), "f32")  # [1, k]
    choices = [backend.upload(rng.choice(shape.experts, (1, shape.slots), replace=False).astype(np.int32), "i32")
               for _ in range(EXPERT_CHOICES)]

    def run() -> None:
        for i in range(LAUNCHES):
            backend.moe_experts(x, choices[i % EXPERT_CHOICES], route, gate_up, down)

    return 1e3 * graph_replay_ms(rt, run, REPEATS) / LAUNCHES


def measure(engine: Any, token: Any, position: int, rng: np.random.Generator) -> dict[str, Any]:
    """Per GEMV shape (n x k): launches per step, us and GB/s alone; the same for the MoE step."""
    spec, backend = engine.spec, engine.backend
    rows = {}
    for (n, k), launches in sorted(gemv_shapes(engine, token, position).items()):
        us = time_gemv(backend, n, k, rng)
        rows[f"{n}x{k}"] = {"launches_per_step": launches, "us": round(us, 2), "gb_s": round(2 * n * k / 1e3 / us, 1)}
    stacked = spec.shared_expert_intermediate_size == spec.moe_intermediate_size  # the shared expert as expert E
    slots = spec.num_experts_per_tok + int(stacked)
    shape = ExpertShape(spec.num_experts, slots, spec.hidden_size, spec.moe_intermediate_size)
    us = time_moe_step(backend, shape, rng)
    moe_bytes = 2 * slots * 3 * shape.inter * shape.hidden
    backend.rt.reset_step()
    return {"launches_per_replay": LAUNCHES, "gemv": rows,
            "moe_step": {"slots": slots, "us": round(us, 2), "gb_s": round(moe_bytes / 1e3 / us, 1)}}


def summary_line(table: dict[str, Any]) -> str:
    gemvs = ", ".join(f"{shape} {row['gb_s']:.0f}" for shape, row in table["gemv"].items())
    moe = table["moe_step"]
    return f"weights streamed alone (GB/s): GEMV {gemvs}; MoE step ({moe['slots']} experts) {moe['gb_s']:.0f}"
