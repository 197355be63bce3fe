"""Device time of the kernels that pick a token from a [1, V] row of logits: argmax (greedy), and
for Qwen3.6's recommended sampling the penalties, the draw and the count of the pick. On an H200
(2026-12-04) sampled decode ran at 150 tok/s against greedy's 279, ~3 ms more per token, with
only these kernels between them; atlas_sample is one block over the whole row, so each is timed
alone here (median of REPEATS, event pair around its launches), the draw in each ATLAS_SAMPLE form."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from event_timing import median_ms

REPEATS = 20


def median_us(rt: Any, run: Callable[[], Any]) -> float:
    return 1e3 * median_ms(rt, run, REPEATS)


def time_pick_ops(backend: Any, vocab: int, sampling: dict[str, Any], rng: np.random.Generator) -> dict[str, float]:
    """Microseconds of each pick op (its launches) on a fresh random row (logits ~ N(0, 4), a
    history of 64 picks for the penalties)."""
    from atlas.backends.base import PenaltyOperands, SamplingParams
    from atlas.backends.cuda.ops_dense import SAMPLE_FORMS

    params = SamplingParams(**sampling)
    logits = backend.upload(rng.normal(0.0, 2.0, size=(1, vocab)).astype(np.float32), "f32")  # [1, V]
    counts = np.zeros(vocab, dtype=np.int32)  # [V]
    np.add.at(counts, rng.integers(0, vocab, size=64), 1)
    operands = PenaltyOperands(backend.upload(counts, "i32"), backend.upload(np.zeros(vocab, dtype=np.int32), "i32"), None)
    token = backend.upload(np.array([int(rng.integers(vocab))], dtype=np.int32), "i32")
    uniform = float(rng.random())
    rt = backend.rt
    times = {
        "argmax": median_us(rt, lambda: backend.argmax(logits)),
        "penalize": median_us(rt, lambda: backend.penalize(logits, operands, params, False)),
    }
    form = backend.sample_form
    try:
        for each in SAMPLE_FORMS:  # both draws, whatever ATLAS_SAMPLE picked
            backend.sample_form = each
            times[f"sample_{each}"] = median_us(rt, lambda: backend.sample(logits, params, uniform))
    finally:
        backend.sample_form = form
    times["count_token"] = median_us(rt, lambda: backend.count_token(operands.counts, token))
    return times


def summary_line(us: dict[str, float]) -> str:
    return "pick ops (us each): " + ", ".join(f"{k} {v:.1f}" for k, v in us.items())
