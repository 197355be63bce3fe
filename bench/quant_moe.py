"""Device half of bench/quant.py: synthetic quantized weights written straight into device memory,
and the MoE grouped GEMM (one launch over all experts) against a loop of per-expert GEMMs.

The loop gets its tokens already gathered expert-major (the gather and the weighted combine are
left out of its time); the grouped op is timed whole (route, gate_up, down, combine). Both are
timed eagerly (Python launches, as the runtime issues them) and as CUDA graphs (GPU-side launch
cost only).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import synthetic
from decode import fill_repeating
from event_timing import graph_replay_ms, median_ms

REPEATS = 5


def upload_synthetic_quant(rt: Any, fmt: str, rows: int, k: int, experts: int = 0) -> Any:
    """A [rows, k] (experts > 0: [E, rows / E, k]) QuantWeight whose every array is the synthetic
    tile's (synthetic.quant_device_tile) repeated down the rows: the device layout of the
    synthetic checkpoint's matrix (or stack of matrices)."""
    from atlas.backends.cuda.quant_weights import QuantWeight

    tile = synthetic.quant_device_tile(fmt, k)
    if rows % tile.rows:
        raise ValueError(f"synthetic quantized weights have a multiple of {tile.rows} rows, got {rows}")

    def fill(pattern: np.ndarray, dtype: str) -> Any:
        out = rt.persistent((rows, *pattern.shape[1:]), dtype)
        fill_repeating(rt, out, np.ascontiguousarray(pattern))
        return out

    q = fill(tile.q, "u8")
    scale = fill(tile.scale, "f32" if fmt == "fp8" else "u8")
    row_scale = None if tile.row_scale is None else fill(tile.row_scale, "f32")
    shape = (experts, rows // experts, k) if experts else (rows, k)
    return QuantWeight(fmt, q, scale, row_scale, shape)


def upload_synthetic_bf16(rt: Any, name: str, shape: tuple[int, ...]) -> Any:
    from atlas.backends.cuda.upload import to_storage

    out = rt.persistent(shape, "bf16")
    fill_repeating(rt, out, to_storage(synthetic.tile(name, shape), "bf16"))
    return out


def expert_slice(weight: Any, e: int) -> Any:
    """Expert e of a stacked [E, R, K] weight as a [R, K] matrix (a view)."""
    from atlas.backends.cuda.quant_weights import QuantWeight

    experts, rows, k = weight.shape
    if not isinstance(weight, QuantWeight):
        return weight.reshape(experts * rows, k).rows(e * rows, (e + 1) * rows).reshape(rows, k)
    span = (e * rows, (e + 1) * rows)
    row_scale = None if weight.row_scale is None else weight.row_scale.rows(*span)
    return QuantWeight(weight.format, weight.q.rows(*span), weight.scale.rows(*span), row_scale, (rows, k))


def weight_nbytes(weight: Any) -> int:
    from atlas.backends.cuda.quant_weights import QuantWeight

    if isinstance(weight, QuantWeight):
        return weight.q.nbytes + weight.scale.nbytes + (0 if weight.row_scale is None else weight.row_scale.nbytes)
    return int(weight.nbytes)


@dataclass(frozen=True)
class MoeShape:
    tokens: int
    experts: int
    top_k: int
    hidden: int
    inter: int


@dataclass
class MoeInputs:
    x: Any  # [T, H] f32
    ids: Any  # [T, k] i32
    weights: Any  # [T, k] f32
    x_by_expert: Any  # [T*k, H] f32, slots sorted by expert
    counts: list[int]


def make_inputs(backend: Any, shape: MoeShape, rng: np.random.Generator) -> MoeInputs:
    """Uniform routing: each token picks top_k distinct experts."""
    ids = np.argsort(rng.random((shape.tokens, shape.experts)), axis=1)[:, : shape.top_k].astype(np.int32)  # [T, k]
    route = rng.random((shape.tokens, shape.top_k)).astype(np.float32)
    route /= route.sum(axis=1, keepdims=True)  # [T, k]
    x = rng.standard_normal((shape.tokens, shape.hidden), dtype=np.float32)  # [T, H]
    order = np.argsort(ids.reshape(-1), kind="stable")  # slots, expert-major
    counts = np.bincount(ids.reshape(-1), minlength=shape.experts).tolist()
    return MoeInputs(backend.upload(x, "f32"), backend.upload(ids, "i32"), backend.upload(route, "f32"),
                     backend.upload(x[order // shape.top_k], "f32"), counts)


def per_expert_loop(backend: Any, inputs: MoeInputs, gate_up: Any, down: Any) -> Callable[[], None]:
    def run() -> None:
        start = 0
        for e, count in enumerate(inputs.counts):
            if count:
                rows = inputs.x_by_expert.rows(start, start + count)  # [c, H]
                act = backend.silu_mul(backend.linear(rows, expert_slice(gate_up, e)))  # [c, I]
                backend.linear(act, expert_slice(down, e))  # [c, H]
                start += count
    return run


def time_eager_ms(rt: Any, run: Callable[[], None]) -> float:
    """Median device time of `run` over REPEATS (after one warm-up), host launch gaps included."""
    return median_ms(rt, run, REPEATS)


def time_graph_ms(rt: Any, run: Callable[[], None]) -> float:
    """Median time of one replay of `run` captured as a CUDA graph, over REPEATS."""
    return graph_replay_ms(rt, run, REPEATS)


def moe_weights(rt: Any, fmt: str, shape: MoeShape) -> tuple[Any, Any]:
    """(gate_up [E, 2I, H], down [E, H, I]) in `fmt` (bf16 or a quantized format)."""
    e, h, i = shape.experts, shape.hidden, shape.inter
    if fmt == "bf16":
        return (upload_synthetic_bf16(rt, "moe-bench/gate_up", (e, 2 * i, h)),
                upload_synthetic_bf16(rt, "moe-bench/down", (e, h, i)))
    return upload_synthetic_quant(rt, fmt, e * 2 * i, h, e), upload_synthetic_quant(rt, fmt, e * h, i, e)


def bench_moe(backend: Any, fmt: str, shape: MoeShape, rng: np.random.Generator) -> dict[str, Any]:
    """Grouped vs per-expert loop for one weight format, eager and graphed; expert weight bytes."""
    rt = backend.rt
    t0 = time.perf_counter()
    gate_up, down = moe_weights(rt, fmt, shape)
    inputs = make_inputs(backend, shape, rng)
    grouped = lambda: backend.moe_experts(inputs.x, inputs.ids, inputs.weights, gate_up, down)  # noqa: E731
    loop = per_expert_loop(backend, inputs, gate_up, down)
    result: dict[str, Any] = {
        "expert_weight_bytes": weight_nbytes(gate_up) + weight_nbytes(down),
        "experts_with_tokens": sum(1 for c in inputs.counts if c),
        "grouped_launches": 4,  # route, gate_up, down, combine
        "loop_launches": 3 * sum(1 for c in inputs.counts if c),
    }
    timers = (("eager", time_eager_ms), ("graph", time_graph_ms)) if rt.driver.graphs else (("eager", time_eager_ms),)
    for mode, timer in timers:  # a binding without stream capture (pycuda) times eagerly only
        g, l = timer(rt, grouped), timer(rt, loop)
        result[mode] = {"grouped_ms": g, "loop_ms": l, "speedup": l / g}
    result["seconds"] = time.perf_counter() - t0
    rt.reset_step()
    return result
