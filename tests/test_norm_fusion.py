"""ATLAS_NORM=fused on the CPU (norm_fusion.py): which launches a decode token's add_rms_norm
turns into, on the emulated driver of test_cuda_select.py. Deferred, it is taken in by the wide
bf16 GEMV or the router that reads it next, with the norm's params; anything else that reaches
the stream first (another kernel, a copy, a read, a step's end, a graph capture's end) issues it
as it was, so no reader can see its outputs unwritten. The numbers are checked on the GPU (and the
emulated GPU) by tests/test_gpu_norm_fused.py."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest

from atlas.backends.cuda import ops_dense
from atlas.backends.cuda.backend import CudaBackend
from atlas.backends.cuda.graph import GraphedDecodeStep
from atlas.backends.cuda.runtime import CudaRuntime
from atlas.kernel_params import dense as kp
from atlas.kernel_params import linear_moe as kpm
from test_cuda_select import FakeDriver, make_runtime

H = 64  # a hidden size whose norm takes norm_threads(H) = 256 threads, as the GEMV's and the router's blocks
WIDE = 32 * 2 * 132  # rows: the fake H200's 132 SMs twice over in 32-row blocks


@dataclasses.dataclass
class Fixture:
    rt: CudaRuntime
    driver: FakeDriver
    backend: CudaBackend

    def launched(self) -> list[str]:
        return [name for name, *_ in self.driver.launches]

    def upload(self, rng: np.random.Generator, *shape: int, dtype: str = "f32") -> object:
        return self.backend.upload(rng.standard_normal(shape).astype(np.float32), dtype)


@pytest.fixture(params=["fused"])
def fx(request: pytest.FixtureRequest) -> Iterator[Fixture]:
    rt, driver = make_runtime(arena_bytes=8 << 20)
    yield Fixture(rt, driver, CudaBackend(rt, use_graphs=False, norm=request.param))


def _norm(fx: Fixture, rng: np.random.Generator, tokens: int = 1) -> tuple[object, object, object]:
    x, residual, weight = fx.upload(rng, tokens, H), fx.upload(rng, tokens, H), fx.upload(rng, H)
    normed, total = fx.backend.add_rms_norm(x, residual, weight, 1e-6)
    return normed, total, (x, residual, weight)


def test_a_wide_gemv_takes_the_norm_in(fx: Fixture, rng: np.random.Generator) -> None:
    w = fx.upload(rng, WIDE + 5, H, dtype="bf16")
    normed, total, (x, residual, weight) = _norm(fx, rng)
    assert fx.launched() == [], "the norm waits for its reader"
    out = fx.backend.linear(normed, w)
    assert fx.launched() == ["atlas_gemv_norm_t1"]
    name, grid, raw, _ = fx.driver.launches[0]
    params = kp.LinearNormParams.from_buffer_copy(raw)
    assert grid == (-(-(WIDE + 5) // 32), 1, 1)
    assert (params.linear.weight, params.linear.out, params.linear.n, params.linear.k, params.linear.tokens) == \
        (w.ptr, out.ptr, WIDE + 5, H, 1)
    assert (params.norm.x, params.norm.residual, params.norm.weight, params.norm.out, params.norm.sum_out) == \
        (x.ptr, residual.ptr, weight.ptr, normed.ptr, total.ptr)
    assert (params.norm.rows, params.norm.dim) == (1, H) and params.norm.eps == pytest.approx(1e-6)
    fx.backend.linear(normed, w)  # a second reader finds the norm's outputs written: the plain GEMV
    assert fx.launched() == ["atlas_gemv_norm_t1", "atlas_gemv_t1"]


@pytest.mark.parametrize("router", ["split", "fused"])
def test_the_router_takes_the_norm_in(fx: Fixture, rng: np.random.Generator, router: str) -> None:
    fx.backend.use_decode_forms(router=router, norm="fused")
    w = fx.upload(rng, 16 + 1, H, dtype="bf16")
    normed, total, _ = _norm(fx, rng)
    fx.backend.router(normed, w, 4, True, shared_expert=True)
    want = ["atlas_router_fused_norm"] if router == "fused" else ["atlas_router_logits_norm", "atlas_router_top_k"]
    assert fx.launched() == want
    params = kpm.RouterNormParams.from_buffer_copy(fx.driver.launches[0][2])
    assert (params.norm.out, params.norm.sum_out, params.router.num_tokens, params.router.hidden) == \
        (normed.ptr, total.ptr, 1, H)


def test_other_next_work_issues_the_norm_first(fx: Fixture, rng: np.random.Generator) -> None:
    """A narrow GEMV (its blocks would stage the three rows 4x as often), the lm_head's many
    blocks, an elementwise op, a read and a step's end each find the norm issued before them."""
    narrow, lm_head = fx.upload(rng, 8, H, dtype="bf16"), fx.upload(rng, 32 * 4 * 132 + 32, H, dtype="bf16")
    steps = [
        (lambda normed, total: fx.backend.linear(normed, narrow), "atlas_gemv_narrow_t1"),
        (lambda normed, total: fx.backend.linear(normed, lm_head), "atlas_gemv_t1"),
        (lambda normed, total: fx.backend.add(total, normed), "atlas_add"),
        (lambda normed, total: fx.backend.to_numpy(total), None),
        (lambda normed, total: fx.rt.reset_step(), None),
        (lambda normed, total: fx.rt.synchronize(), None),
    ]
    for run, then in steps:
        normed, total, _ = _norm(fx, rng)
        first = len(fx.driver.launches)
        run(normed, total)
        assert fx.launched()[first:] == ["atlas_add_rms_norm", *([then] if then else [])]


def test_only_one_decode_row_under_the_fused_form_waits(rng: np.random.Generator) -> None:
    for form, tokens in (("fused", 2), ("separate", 1)):
        rt, driver = make_runtime(arena_bytes=8 << 20)
        fx = Fixture(rt, driver, CudaBackend(rt, use_graphs=False, norm=form))
        _norm(fx, rng, tokens)
        assert fx.launched() == ["atlas_add_rms_norm"]


def test_a_norm_a_step_leaves_waiting_is_captured_with_it(fx: Fixture, rng: np.random.Generator) -> None:
    """A captured step that ends on a deferred norm records it; a failed capture forgets it."""
    x, residual, weight = fx.upload(rng, 1, H), fx.upload(rng, 1, H), fx.upload(rng, H)

    def step(ids: object, positions: object) -> object:
        return fx.backend.add_rms_norm(x, residual, weight, 1e-6)[0]

    graphed = GraphedDecodeStep(fx.rt, step)
    graphed(np.zeros(1, np.int32), np.zeros(1, np.int32))
    assert fx.launched() == ["atlas_add_rms_norm"]  # the replay's

    def failing(ids: object, positions: object) -> object:
        fx.backend.add_rms_norm(x, residual, weight, 1e-6)
        raise RuntimeError("a step that fails while its norm waits")

    with pytest.raises(RuntimeError):
        GraphedDecodeStep(fx.rt, failing)(np.zeros(1, np.int32), np.zeros(1, np.int32))
    fx.rt.synchronize()
    assert fx.launched() == ["atlas_add_rms_norm"]


def test_taking_a_launch_that_is_not_waiting_is_refused(fx: Fixture, rng: np.random.Generator) -> None:
    from atlas.backends.cuda.driver import CudaError
    from atlas.backends.cuda.runtime import DeferredLaunch

    stale = DeferredLaunch("atlas_add_rms_norm", (1, 1, 1), (256, 1, 1), kp.RmsNormParams(), (), ())
    with pytest.raises(CudaError, match="not the launch waiting"):
        fx.rt.take_deferred(stale)
    assert ctypes.sizeof(kp.LinearNormParams) == ctypes.sizeof(kp.LinearParams) + ctypes.sizeof(kp.RmsNormParams)


def test_qwen_s_norm_blocks_are_its_consumers_blocks() -> None:
    """The take-in keeps the norm's bits only with the norm kernel's block size: at Qwen3.6's
    hidden size that is the GEMV's and the router's."""
    from atlas.backends.cuda.ops_linear_moe import ROUTER_WARPS

    assert ops_dense.norm_threads(2048) == ops_dense.GEMV_THREADS == ROUTER_WARPS * 32
