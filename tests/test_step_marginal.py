"""bench/step_marginal.py on a stand-in engine whose step launches kernels of known cost: each
kernel's doubled step adds exactly its cost times its launches, the census counts one eager
step, and the runtime's own launch is back afterwards."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import step_marginal  # noqa: E402


class Runtime:
    def __init__(self) -> None:
        self.issued: list[str] = []

    def launch(self, kernel: str, grid: Any, block: Any, params: Any, smem: int = 0) -> None:
        self.issued.append(kernel)

    def synchronize(self) -> None:
        pass


class Backend:
    def __init__(self) -> None:
        self.rt = Runtime()


class Engine:
    """A decode step of `plan` (kernel -> launches), in a fixed interleaved order."""

    def __init__(self, plan: dict[str, int], params: dict[str, Any] | None = None) -> None:
        self.backend = Backend()
        self.order = [k for round_ in range(max(plan.values())) for k, n in plan.items() if round_ < n]
        self.params = params or {}  # kernel -> its launches' params (None when absent)
        self.resets = 0

    def step(self) -> None:
        for kernel in self.order:
            self.backend.rt.launch(kernel, (1, 1, 1), (32, 1, 1), self.params.get(kernel))

    def eager_decode(self, token: Any, position: int) -> None:
        self.step()

    def reset(self) -> None:
        self.resets += 1


def timer(costs: dict[str, float], floor_us: float) -> step_marginal.TimeDecode:
    """time_decode's stand-in: one step is captured (launched once through rt.launch) and priced."""

    def time_decode(engine: Any, prompt: list[int], tokens: int) -> tuple[float, int]:
        rt = engine.backend.rt
        rt.issued.clear()
        engine.step()
        step = floor_us + sum(costs[k] for k in rt.issued)
        return 1e6 / step, tokens - 1

    return time_decode


def test_each_kernel_costs_what_doubling_it_adds(rng: np.random.Generator) -> None:
    names = [f"atlas_k{i}" for i in range(int(rng.integers(3, 8)))]
    plan = {k: int(rng.integers(1, 41)) for k in names}
    costs = {k: float(rng.uniform(0.5, 30)) for k in names}
    floor_us = float(rng.uniform(10, 200))
    engine = Engine(plan)
    plain_launch = Runtime.launch
    result = step_marginal.marginal_costs(engine, list(range(5)), object(), timer(costs, floor_us))
    assert engine.backend.rt.launch.__func__ is plain_launch  # the wrappers are gone
    kernels = result["kernels"]
    assert {k: v["launches"] for k, v in kernels.items()} == plan
    for kernel, row in kernels.items():
        assert row["us"] == pytest.approx(costs[kernel] * plan[kernel], abs=0.01)
        assert row["us_per_launch"] == pytest.approx(costs[kernel], abs=0.01)
    assert list(kernels) == sorted(kernels, key=lambda k: -kernels[k]["us"])
    step = floor_us + sum(costs[k] * n for k, n in plan.items())
    assert result["step_us"] == pytest.approx(step) and result["step_us_again"] == pytest.approx(step)
    assert result["launches_per_step"] == sum(plan.values())
    assert result["outside_kernels_us"] == pytest.approx(floor_us, abs=0.01 * len(names))
    assert engine.resets == len(names) + 3  # each variant captured afresh, and reset once more at the end
    line = step_marginal.summary_line(result)
    assert line.startswith(f"in-graph cost: step {step:.0f} us") and max(kernels, key=lambda k: kernels[k]["us"]) in line


def test_weight_streaming_kernels_report_their_bandwidth(rng: np.random.Generator) -> None:
    """Weight MB per step and GB/s at the in-graph cost for the GEMV, router and MoE launches
    (bf16 bytes from their params), none for a kernel reading activations alone."""
    from atlas.kernel_params.dense import LinearNormParams, LinearParams, RmsNormParams
    from atlas.kernel_params.linear_moe import MoeDownGemvParams, MoeGateUpGemvParams, RouterNormParams, RouterParams

    n, k, hidden, inter, experts, top_k = (int(rng.integers(1, 4000)), 8 * int(rng.integers(1, 500)),
                                           8 * int(rng.integers(1, 300)), 8 * int(rng.integers(1, 100)),
                                           int(rng.integers(8, 300)), int(rng.integers(1, 9)))
    params = {"atlas_gemv_t1": LinearParams(tokens=1, n=n, k=k),
              "atlas_router_logits": RouterParams(hidden=hidden, num_experts=experts, shared_expert=1),
              "atlas_moe_gate_up_gemv": MoeGateUpGemvParams(num_slots=top_k + 1, hidden=hidden, inter=inter),
              "atlas_moe_down_gemv_k9": MoeDownGemvParams(num_tokens=1, top_k=top_k + 1, hidden=hidden, inter=inter),
              "atlas_rms_norm": RmsNormParams(),
              # ATLAS_NORM=fused: the linear's and the router's params inside the norm-taking ones
              "atlas_gemv_norm_t1": LinearNormParams(linear=LinearParams(tokens=1, n=n + 1, k=k)),
              "atlas_router_fused_norm": RouterNormParams(router=RouterParams(hidden=hidden, num_experts=experts))}
    bytes_per_launch = {"atlas_gemv_t1": 2 * n * k, "atlas_router_logits": 2 * (experts + 1) * hidden,
                        "atlas_gemv_norm_t1": 2 * (n + 1) * k, "atlas_router_fused_norm": 2 * experts * hidden,
                        "atlas_moe_gate_up_gemv": 4 * (top_k + 1) * inter * hidden,
                        "atlas_moe_down_gemv_k9": 2 * (top_k + 1) * hidden * inter}
    plan = {name: int(rng.integers(1, 41)) for name in params}
    costs = {name: float(rng.uniform(0.5, 30)) for name in params}
    result = step_marginal.marginal_costs(Engine(plan, params), [0], object(), timer(costs, 50.0))
    for name, row in result["kernels"].items():
        if name not in bytes_per_launch:
            assert "gb_s" not in row and "weight_mb" not in row
            continue
        assert row["weight_mb"] == pytest.approx(plan[name] * bytes_per_launch[name] / 1e6, abs=1e-3)
        assert row["gb_s"] == pytest.approx(bytes_per_launch[name] / 1e3 / costs[name], rel=1e-2, abs=0.05)  # 0.1 GB/s steps
    assert "GB/s" in step_marginal.summary_line(result)


def test_a_deadline_leaves_out_the_kernels_it_has_no_time_for(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each timed step takes one second of a stand-in clock: a kernel is doubled only while one more
    variant and the final plain step fit before `until`, the heaviest weights first, then the most
    launched; the rest are listed as skipped and the run ends inside the deadline."""
    from types import SimpleNamespace

    from atlas.kernel_params.dense import LinearParams

    count = int(rng.integers(4, 9))
    plan = {f"atlas_k{i}": i + 1 for i in range(count)}  # launches: atlas_k{count-1} most
    heavy = "atlas_gemv_t1"  # the one weight streamer, doubled first despite its one launch
    plan[heavy] = 1
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(step_marginal, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    priced = timer({k: 1.0 for k in plan}, 10.0)

    def time_decode(engine: Any, prompt: list[int], tokens: int) -> tuple[float, int]:
        clock.now += 1.0
        return priced(engine, prompt, tokens)

    doubled = int(rng.integers(1, count))  # the base step ends at t=1; kernel i >= 1 starts at 1 + i and needs 2 s more
    until = 2.0 + doubled + 0.5
    engine = Engine(plan, {heavy: LinearParams(tokens=1, n=64, k=64)})
    result = step_marginal.marginal_costs(engine, [0], object(), time_decode, until=until)
    order = [heavy, *sorted((k for k in plan if k != heavy), key=lambda k: -plan[k])]
    assert set(result["kernels"]) == set(order[:doubled])
    assert result["skipped"] == order[doubled:] and result["outside_kernels_us"] is None
    assert clock.now <= until
    assert step_marginal.summary_line(result).endswith("; not doubled (budget spent): " + ", ".join(order[doubled:]))
