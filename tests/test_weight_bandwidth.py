"""bench/weight_bandwidth.py on a stand-in engine: the census finds each one-token bf16 GEMV shape
of a decode step with its launches (not the multi-token or quantized ones, nor other kernels), each
shape is timed over enough weight copies to overflow L2, and GB/s is its bytes over the time per
launch; the MoE step counts the shared expert's slot when it is stacked."""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import weight_bandwidth  # noqa: E402

from atlas.kernel_params.dense import LinearParams, RmsNormParams  # noqa: E402


class Runtime:
    def __init__(self) -> None:
        self.zeros_made: list[tuple[int, ...]] = []

    def launch(self, kernel: str, grid: Any, block: Any, params: Any, smem: int = 0) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def reset_step(self) -> None:
        pass

    def zeros(self, shape: tuple[int, ...], dtype: str) -> SimpleNamespace:
        self.zeros_made.append(tuple(shape))
        return SimpleNamespace(shape=tuple(shape))


class Backend:
    def __init__(self) -> None:
        self.rt = Runtime()
        self.linear_weights: list[Any] = []
        self.expert_sets: list[Any] = []

    def upload(self, array: np.ndarray, dtype: str) -> np.ndarray:
        return array

    def linear(self, x: Any, weight: Any) -> None:
        self.linear_weights.append(weight)

    def moe_experts(self, x: Any, ids: Any, weights: Any, gate_up: Any, down: Any) -> None:
        self.expert_sets.append(tuple(ids.ravel()))


class Engine:
    def __init__(self, launches: list[tuple[str, Any]], spec: Any) -> None:
        self.backend, self.launches, self.spec = Backend(), launches, spec

    def eager_decode(self, token: Any, position: int) -> None:
        for kernel, params in self.launches:
            self.backend.rt.launch(kernel, (1, 1, 1), (32, 1, 1), params)


def test_each_shape_is_timed_alone_over_copies_that_overflow_l2(rng: np.random.Generator,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    shapes = {(int(rng.integers(1, 300_000)), 8 * int(rng.integers(1, 600))) for _ in range(4)}
    plan = {shape: int(rng.integers(1, 41)) for shape in shapes}
    launches = [(f"atlas_gemv{'' if i % 2 else '_narrow'}_t1", LinearParams(tokens=1, n=n, k=k))
                for i, ((n, k), count) in enumerate(plan.items()) for _ in range(count)]
    launches += [("atlas_gemv_t4", LinearParams(tokens=4, n=64, k=64)), ("atlas_rms_norm", RmsNormParams()),
                 ("atlas_qgemv_fp8_t1", SimpleNamespace(tokens=1, n=8, k=8))]
    spec = SimpleNamespace(num_experts=int(rng.integers(16, 300)), num_experts_per_tok=int(rng.integers(1, 9)),
                           hidden_size=8 * int(rng.integers(8, 300)), moe_intermediate_size=8 * int(rng.integers(8, 100)),
                           shared_expert_intermediate_size=0)
    stacked = bool(rng.integers(2))
    spec.shared_expert_intermediate_size = spec.moe_intermediate_size if stacked else spec.moe_intermediate_size + 8
    engine = Engine(launches, spec)
    ms = float(rng.uniform(0.01, 5.0))
    timed: list[int] = []

    def graph_ms(rt: Any, run: Any, repeats: int) -> float:
        run()
        timed.append(repeats)
        return ms

    monkeypatch.setattr(weight_bandwidth, "graph_replay_ms", graph_ms)
    table = weight_bandwidth.measure(engine, object(), 7, rng)
    us = 1e3 * ms / weight_bandwidth.LAUNCHES
    assert set(table["gemv"]) == {f"{n}x{k}" for n, k in shapes} and timed == [weight_bandwidth.REPEATS] * (len(shapes) + 1)
    for (n, k), count in plan.items():
        row = table["gemv"][f"{n}x{k}"]
        assert row["launches_per_step"] == count and row["us"] == pytest.approx(us, abs=0.01)
        assert row["gb_s"] == pytest.approx(2 * n * k / 1e3 / us, rel=1e-3, abs=0.1)
    made = Counter(engine.backend.rt.zeros_made)
    used = engine.backend.linear_weights
    assert len(used) == len(shapes) * weight_bandwidth.LAUNCHES
    for i, (n, k) in enumerate(sorted(shapes)):
        copies = made[(n, k)]
        assert copies == min(weight_bandwidth.MAX_COPIES, max(1, math.ceil(weight_bandwidth.SPREAD_BYTES / (2 * n * k))))
        replay = used[i * weight_bandwidth.LAUNCHES:(i + 1) * weight_bandwidth.LAUNCHES]
        assert {w.shape for w in replay} == {(n, k)}
        assert len({id(w) for w in replay}) == min(copies, weight_bandwidth.LAUNCHES)  # every copy in turn
    slots = spec.num_experts_per_tok + int(stacked)
    moe = table["moe_step"]
    assert moe["slots"] == slots
    assert moe["gb_s"] == pytest.approx(2 * slots * 3 * spec.moe_intermediate_size * spec.hidden_size / 1e3 / us, rel=1e-3, abs=0.1)
    sets = engine.backend.expert_sets
    assert len(sets) == weight_bandwidth.LAUNCHES and all(len(set(s)) == slots for s in sets)
    assert len(set(sets)) > 1  # cycled expert choices, not one set re-read from L2
    assert weight_bandwidth.summary_line(table).startswith("weights streamed alone (GB/s): GEMV ")
