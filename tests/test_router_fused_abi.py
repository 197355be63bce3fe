"""The fused decode router (issue 4, decode launches) on the CPU: its params, the wrapper's launch
choice and geometry, an emulation of atlas_router_fused's arrival counting (router.cuh: each
block stores and fences its logits, counts itself in, and the block that arrives last routes the
token and sets its counter back to 0), and one decode step's launches on the emulated driver.
The device check is tests/test_gpu_router_fused.py."""

from __future__ import annotations

import ctypes
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from _abi import RecordingRuntime, header_constant
from atlas.backends.cuda import ops_linear_moe as ops
from atlas.backends.numpy_backend import NumpyBackend
from atlas.errors import AtlasError
from atlas.kernel_params import linear_moe as kp

FUSED = "atlas_router_fused"
SPLIT = ["atlas_router_logits", "atlas_router_top_k"]


# --- params and wrapper ---------------------------------------------------------------------------
def test_router_params_carry_the_arrival_counters_after_the_pointers() -> None:
    names = [name for name, _ in kp.RouterParams._fields_]
    assert names[:6] == ["x", "weight", "logits", "ids", "weights", "arrivals"]
    assert kp.RouterParams.arrivals.offset == 5 * 8 and kp.RouterParams.num_tokens.offset == 6 * 8
    assert ctypes.sizeof(kp.RouterParams) == 6 * 8 + 6 * 4 and ctypes.alignment(kp.RouterParams) == 8


def _route(rt: RecordingRuntime, tokens: int, shared: int, arrivals: object, experts: int = 32, hidden: int = 64) -> None:
    x, w = rt.empty((tokens, hidden), "f32"), rt.empty((experts + shared, hidden), "bf16")
    ids, weights = ops.router(rt, x, w, 4, True, shared_expert=bool(shared), arrivals=arrivals)  # type: ignore[arg-type]
    assert ids.shape == weights.shape == (tokens, 4 + shared)


@pytest.mark.parametrize("shared", [0, 1])
def test_steps_up_to_the_counters_launch_once(rng: np.random.Generator, shared: int) -> None:
    rt = RecordingRuntime()
    arrivals = rt.empty((ops.ROUTER_FUSED_MAX_TOKENS,), "i32")
    experts = 8 * int(rng.integers(1, 40)) + int(rng.integers(0, 8))
    for tokens in range(1, ops.ROUTER_FUSED_MAX_TOKENS + 1):
        rt.launches.clear()
        _route(rt, tokens, shared, arrivals, experts)
        [launch] = rt.launches
        p = launch.params
        assert launch.kernel == FUSED and launch.block == (ops.ROUTER_WARPS * 32, 1, 1)
        assert launch.grid == (tokens, -(-(experts + shared) // ops.ROUTER_WARPS), 1)
        assert p.arrivals == arrivals.ptr and p.num_tokens == tokens and p.shared_expert == shared
    rt.launches.clear()
    _route(rt, ops.ROUTER_FUSED_MAX_TOKENS + 1, shared, arrivals, experts)  # prefill: two launches, no counters
    assert [launch.kernel for launch in rt.launches] == SPLIT and all(not launch.params.arrivals for launch in rt.launches)
    rt.launches.clear()
    _route(rt, 1, shared, None, experts)
    assert [launch.kernel for launch in rt.launches] == SPLIT


def test_fused_router_geometry_mirrors_the_header() -> None:
    assert ops.ROUTER_WARPS == header_constant("router.cuh", "kWarps")
    assert ops.ROUTER_FUSED_MAX_TOKENS == ops.MOE_GEMV_MAX_TOKENS  # the decode-shaped steps
    rt = RecordingRuntime()
    with pytest.raises(ValueError, match="arrivals"):
        _route(rt, 1, 0, rt.empty((8,), "f32"))
    assert rt.launches == []


def test_router_form_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ops.ROUTER_ENV, raising=False)
    assert ops.router_form() == "split"  # opt-in until the device confirms the fused kernel
    monkeypatch.setenv(ops.ROUTER_ENV, "fused")
    assert ops.router_form() == "fused" and ops.router_form("split") == "split"
    monkeypatch.setenv(ops.ROUTER_ENV, "one-launch")
    with pytest.raises(AtlasError, match=f"{ops.ROUTER_ENV}='one-launch'.*'fused'"):
        ops.router_form()
    with pytest.raises(AtlasError, match=ops.ROUTER_ENV):
        ops.router_form("Fused")


# --- emulation of atlas_router_fused --------------------------------------------------------------
@dataclass
class DeviceMemory:
    """The buffers of one launch, flat, as the kernel indexes them (NaN / -1 where unwritten)."""

    x: np.ndarray  # [T * H]
    weight: np.ndarray  # [(E + s) * H]
    logits: np.ndarray  # [T * (E + s)], device-visible values only
    ids: np.ndarray  # [T * (k + s)]
    weights: np.ndarray  # [T * (k + s)]
    arrivals: np.ndarray  # [>= T] u32


def route_token(p: kp.RouterParams, mem: DeviceMemory, t: int) -> None:
    """route_token<E>: softmax over the first E logits of token t, k argmax rounds (ties -> lower
    index), renormalisation, slot k = (E, sigmoid(logit E)); f32 as on the device."""
    experts, columns, slots = p.num_experts, p.num_experts + p.shared_expert, p.top_k + p.shared_expert
    row = mem.logits[t * columns : t * columns + experts]
    probs = np.exp(row - row.max()) * (np.float32(1) / np.exp(row - row.max()).sum(dtype=np.float32))
    picked = np.argsort(-probs, kind="stable")[: p.top_k]
    found = ~np.isnan(probs[picked])
    chosen = np.where(found, probs[picked], np.float32(0))
    if p.renormalize:
        chosen = chosen * (np.float32(1) / chosen.sum(dtype=np.float32))
    mem.ids[t * slots : t * slots + p.top_k] = np.where(found, picked, -1)
    mem.weights[t * slots : t * slots + p.top_k] = chosen
    if p.shared_expert:
        mem.ids[t * slots + p.top_k] = experts
        mem.weights[t * slots + p.top_k] = 1 / (1 + np.exp(-mem.logits[t * columns + experts]))


def fused_block(p: kp.RouterParams, mem: DeviceMemory, blocks: int, t: int, y: int, reset: bool) -> Iterator[None]:
    """One block (t, y) of router_fused, suspended where another block may run in between."""
    columns, hidden = p.num_experts + p.shared_expert, p.hidden
    rows = range(y * ops.ROUTER_WARPS, min((y + 1) * ops.ROUTER_WARPS, columns))
    x = mem.x[t * hidden : (t + 1) * hidden]
    stored = {t * columns + e: np.float32(x @ mem.weight[e * hidden : (e + 1) * hidden]) for e in rows}
    yield  # stored, not yet visible at device scope
    for index, value in stored.items():
        mem.logits[index] = value  # __threadfence by each storing lane
    yield
    arrived = int(mem.arrivals[t])  # atomicAdd: read and increment in one step
    mem.arrivals[t] = arrived + 1
    if arrived == blocks - 1:
        if reset:
            mem.arrivals[t] = 0
        yield
        route_token(p, mem, t)


def emulate_fused_launch(launch: object, mem: DeviceMemory, rng: np.random.Generator, reset: bool = True) -> None:
    """Every block of the launch, interleaved in a random order (blocks of all tokens together)."""
    p, (tokens, blocks, _) = launch.params, launch.grid  # type: ignore[attr-defined]
    live = [fused_block(p, mem, blocks, t, y, reset) for t in range(tokens) for y in range(blocks)]
    while live:
        block = live[int(rng.integers(len(live)))]
        if next(block, StopIteration) is StopIteration:
            live.remove(block)


def _case(rng: np.random.Generator, tokens: int, shared: int) -> tuple[np.ndarray, np.ndarray, int]:
    experts, hidden = int(rng.integers(4, 70)), 8 * int(rng.integers(2, 10))
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)  # [T, H]
    w = rng.standard_normal((experts + shared, hidden), dtype=np.float32) * np.float32(2 / np.sqrt(hidden))  # [E + s, H]
    return x, w, int(rng.integers(1, experts + 1))


def _launch_on(x: np.ndarray, w: np.ndarray, top_k: int, shared: int, renormalize: bool) -> object:
    rt = RecordingRuntime()
    arrivals = rt.empty((ops.ROUTER_FUSED_MAX_TOKENS,), "i32")
    ops.router(rt, rt.empty(x.shape, "f32"), rt.empty(w.shape, "bf16"), top_k, renormalize,
               shared_expert=bool(shared), arrivals=arrivals)
    [launch] = rt.launches
    return launch


def _memory(x: np.ndarray, w: np.ndarray, top_k: int, shared: int, arrivals: np.ndarray) -> DeviceMemory:
    tokens, slots = x.shape[0], top_k + shared
    return DeviceMemory(x.reshape(-1), w.reshape(-1), np.full(tokens * w.shape[0], np.nan, np.float32),
                        np.full(tokens * slots, -1, np.int32), np.full(tokens * slots, np.nan, np.float32), arrivals)


@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("renormalize", [True, False])
def test_last_arrival_routes_each_token_and_leaves_the_counters_zero(
    rng: np.random.Generator, shared: int, renormalize: bool
) -> None:
    arrivals = np.zeros(ops.ROUTER_FUSED_MAX_TOKENS, np.uint32)  # persistent: every replay reuses it
    for _ in range(4):
        tokens = int(rng.integers(1, ops.ROUTER_FUSED_MAX_TOKENS + 1))
        x, w, top_k = _case(rng, tokens, shared)
        mem = _memory(x, w, top_k, shared, arrivals)
        emulate_fused_launch(_launch_on(x, w, top_k, shared, renormalize), mem, rng)
        assert not arrivals.any(), f"counters left at {arrivals.tolist()}"
        want_ids, want_weights = NumpyBackend().router(x, w, top_k, renormalize, shared_expert=bool(shared))
        np.testing.assert_array_equal(mem.ids.reshape(want_ids.shape), want_ids)
        np.testing.assert_allclose(mem.weights.reshape(want_weights.shape), want_weights, rtol=1e-5)


def test_a_counter_left_set_routes_nothing(rng: np.random.Generator) -> None:
    """Why the last block resets: without it the next launch (a graph replay) finds no last block
    and leaves the ids unwritten; routing before every block has fenced would read NaN logits."""
    arrivals = np.zeros(ops.ROUTER_FUSED_MAX_TOKENS, np.uint32)
    x, w, top_k = _case(rng, 2, 1)
    launch = _launch_on(x, w, top_k, 1, True)
    first = _memory(x, w, top_k, 1, arrivals)
    emulate_fused_launch(launch, first, rng, reset=False)
    assert (first.ids >= 0).all() and arrivals[:2].tolist() == [launch.grid[1]] * 2  # type: ignore[attr-defined]
    replay = _memory(x, w, top_k, 1, arrivals)
    emulate_fused_launch(launch, replay, rng, reset=False)
    assert (replay.ids == -1).all() and np.isnan(replay.weights).all()


# --- one decode step on the emulated driver --------------------------------------------------------
def _router_arrivals(launches: list[tuple[str, tuple[int, int, int], bytes, int]]) -> set[int]:
    return {kp.RouterParams.from_buffer_copy(raw).arrivals for name, _, raw, _ in launches if name == FUSED}


def test_demo_decode_routes_each_moe_block_in_one_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_select import make_runtime

    from atlas.backends.cuda.backend import CudaBackend
    from atlas.config import load_spec
    from atlas.demo import DEMO_DIR
    from atlas.engine import Engine
    from atlas.safetensors import Checkpoint

    monkeypatch.setenv(ops.ROUTER_ENV, "fused")
    rt, driver = make_runtime(arena_bytes=8 << 20)
    backend = CudaBackend(rt)  # graphs on: the counters must exist before the first capture
    assert backend.router_form == "fused" and "fused router" in backend.describe()
    monkeypatch.setenv(ops.ROUTER_ENV, "split")  # read once, where the backend was built
    engine = Engine(load_spec(DEMO_DIR), Checkpoint.open(DEMO_DIR), backend, max_seq_len=64)
    layers, top_k = engine.spec.num_hidden_layers, engine.spec.num_experts_per_tok
    engine.prefill(list(range(1, ops.ROUTER_FUSED_MAX_TOKENS + 3)))
    prefill = Counter(launch[0] for launch in driver.launches)
    assert prefill["atlas_router_logits"] == prefill["atlas_router_top_k"] == layers and FUSED not in prefill
    allocations = dict(driver.allocs)
    for position in range(ops.ROUTER_FUSED_MAX_TOKENS + 2, ops.ROUTER_FUSED_MAX_TOKENS + 5):
        first = len(driver.launches)
        engine.decode(5, position)
        step = Counter(name for name, *_ in driver.launches[first:])
        moe = {name: n for name, n in step.items() if name.startswith(("atlas_router", "atlas_moe"))}
        assert moe == {FUSED: layers, "atlas_moe_gate_up_gemv": layers, f"atlas_moe_down_gemv_k{top_k + 1}": layers}
    assert driver.graph_launches == 3 and driver.allocs.keys() >= allocations.keys()
    [arrivals] = _router_arrivals(driver.launches)
    assert arrivals == backend._router_arrivals.ptr and arrivals in allocations  # allocated once, before decode
    assert not backend.to_numpy(backend._router_arrivals).any()  # zeroed when allocated


def test_bad_router_form_is_one_line_at_backend_build(monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_select import make_runtime

    from atlas.backends.cuda.backend import CudaBackend

    monkeypatch.setenv(ops.ROUTER_ENV, "fast")
    rt, driver = make_runtime()
    with pytest.raises(AtlasError, match=f"^{ops.ROUTER_ENV}='fast' is not a router form"):
        CudaBackend(rt)
    monkeypatch.delenv(ops.ROUTER_ENV)
    backend = CudaBackend(rt)
    assert backend.router_form == "split" and backend._router_arrivals is None and "fused" not in backend.describe()


def test_decode_forms_switch_between_captures(monkeypatch: pytest.MonkeyPatch) -> None:
    """use_decode_forms (bench/launch_settings.py's switch): the next captured decode step runs the
    forms set last, and each fused form's counters are allocated once, on its first use."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_select import make_runtime

    from atlas.backends.cuda.backend import CudaBackend
    from atlas.config import load_spec
    from atlas.demo import DEMO_DIR
    from atlas.engine import Engine
    from atlas.safetensors import Checkpoint

    for switch in (ops.ROUTER_ENV, "ATLAS_DELTANET_DECODE", "ATLAS_ATTENTION_PREP"):
        monkeypatch.delenv(switch, raising=False)
    rt, driver = make_runtime(arena_bytes=8 << 20)
    backend = CudaBackend(rt)
    engine = Engine(load_spec(DEMO_DIR), Checkpoint.open(DEMO_DIR), backend, max_seq_len=64)
    engine.prefill([1, 2, 3])
    fused_kernels = {FUSED, "atlas_delta_net_decode", "atlas_attention_prep"}
    counters = []
    for position, fused in enumerate((False, True, False, True), start=3):
        backend.use_decode_forms(*(("fused",) * 3 if fused else ("split", "separate", "separate")))
        engine.reset()
        first = len(driver.launches)
        engine.decode(5, position)
        step = {name for name, *_ in driver.launches[first:]}
        assert (step & fused_kernels == fused_kernels) if fused else not step & fused_kernels, sorted(step)
        assert ("fused router" in backend.describe()) == fused
        counters.append((backend._router_arrivals and backend._router_arrivals.ptr,
                         backend._delta_arrivals and backend._delta_arrivals.ptr))
    assert counters[0] == (None, None) and None not in counters[1] and counters[1] == counters[2] == counters[3]
