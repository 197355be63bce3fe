"""Device time of the kernels that pick a token from a [1, V] row of logits: argmax (greedy), and
for Qwen3.6's recommended sampling the penalties, the draw and the count of the pick. On an H200
(2026-12-04) sampled decode ran at 150 tok/s against greedy's 279, ~3 ms more per token, with
only these kernels between them; atlas_sample is one block over the whole row, so each is timed
alone here (median of REPEATS, event pair around the one launch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

REPEATS = 20


def median_us(rt: Any, run: Callable[[], Any]) -> float:
    start, end = rt.driver.event_create(), rt.driver.event_create()
    times = []
    for _ in range(REPEATS + 1):
        rt.driver.event_record(start, rt.stream)
        run()
        rt.driver.event_record(end, rt.stream)
        rt.driver.event_synchronize(end)
        times.append(1e3 * rt.driver.event_elapsed_ms(start, end))
    return float(np.median(times[1:]))  # the first: module load, first touch


def time_pick_ops(backend: Any, vocab: int, sampling: dict[str, Any], rng: np.random.Generator) -> dict[str, float]:
    """Microseconds per launch of each pick kernel on a fresh random row (logits ~ N(0, 4), a
    history of 64 picks for the penalties)."""
    from atlas.backends.base import PenaltyOperands, SamplingParams

    params = SamplingParams(**sampling)
    logits = backend.upload(rng.normal(0.0, 2.0, size=(1, vocab)).astype(np.float32), "f32")  # [1, V]
    counts = np.zeros(vocab, dtype=np.int32)  # [V]
    np.add.at(counts, rng.integers(0, vocab, size=64), 1)
    operands = PenaltyOperands(backend.upload(counts, "i32"), backend.upload(np.zeros(vocab, dtype=np.int32), "i32"), None)
    token = backend.upload(np.array([int(rng.integers(vocab))], dtype=np.int32), "i32")
    uniform = float(rng.random())
    rt = backend.rt
    return {
        "argmax": median_us(rt, lambda: backend.argmax(logits)),
        "penalize": median_us(rt, lambda: backend.penalize(logits, operands, params, False)),
        "sample": median_us(rt, lambda: backend.sample(logits, params, uniform)),
        "count_token": median_us(rt, lambda: backend.count_token(operands.counts, token)),
    }


def summary_line(us: dict[str, float]) -> str:
    return "pick kernels (us per launch): " + ", ".join(f"{k} {v:.1f}" for k, v in us.items())
