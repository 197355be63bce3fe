"""ATLAS_NORM=fused on the GPU (norm_fusion.py): a decode token's add_rms_norm taken into the GEMV
(bf16, fp8, nvfp4) or the router that reads it leaves the same bits as the two launches, in the
consumer's output and in the norm's own two outputs (written by the consumer's first block), at
the demo and Qwen3.6 dims; then a chain of two norms, a GEMV and the router replayed in a
captured graph with fresh inputs, and the whole demo model. Outputs poisoned first.
tests/test_norm_fusion.py checks which launches happen."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from test_gpu_ops import Env, env, normal, weight  # noqa: F401 - env is a fixture

pytestmark = pytest.mark.gpu

EPS = 1e-6
REPLAYS = 4
TAKING = {"atlas_gemv_norm_t1", "atlas_router_logits_norm", "atlas_router_fused_norm"}  # the bf16 entries that take a norm in


@pytest.fixture
def wide_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wide GEMV at any N and any number of blocks (the form that takes the norm in, where it
    pays), so a few blocks do, on any SM count."""
    from atlas.backends.cuda import norm_fusion, ops_dense, ops_quant

    monkeypatch.setattr(ops_dense, "DENSE_GEMV", dataclasses.replace(ops_dense.DENSE_GEMV, wide_min_waves=0))
    monkeypatch.setattr(ops_quant, "QUANT_GEMV", dataclasses.replace(ops_quant.QUANT_GEMV, wide_min_waves=0))
    monkeypatch.setattr(norm_fusion, "MAX_GEMV_BLOCKS_PER_SM", 1 << 20)


@contextmanager
def recorded(rt: Any) -> Iterator[list[str]]:
    names: list[str] = []
    launch = rt.launch

    def hooked(kernel: str, *args: Any, **kwargs: Any) -> None:
        names.append(kernel)
        launch(kernel, *args, **kwargs)

    rt.launch = hooked
    try:
        yield names
    finally:
        del rt.launch


def _backends(env: Env, router: str = "split") -> dict[str, Any]:
    from atlas.backends.cuda.backend import CudaBackend

    return {form: CudaBackend(env.gpu.rt, use_graphs=False, router=router, norm=form) for form in ("separate", "fused")}


def _run(backend: Any, op: Callable[[Any], tuple[Any, ...]]) -> tuple[list[np.ndarray], list[str]]:
    rt = backend.rt
    rt.reset_step()
    rt.poison_scratch()
    with recorded(rt) as names:
        outs = op(backend)
        rt.synchronize()
    return [backend.to_numpy(t) for t in outs], names


def _same_bits(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))


def _norm_inputs(env: Env, rng: np.random.Generator) -> tuple[Any, Any, Any]:
    h = env.d("hidden_size")
    x, residual, w = normal(rng, 1, h, scale=2), normal(rng, 1, h), normal(rng, h) + 1  # [1, H], [1, H], [H]
    return env.gpu.upload(x, "f32"), env.gpu.upload(residual, "f32"), env.gpu.upload(w, "f32")


@pytest.mark.parametrize("rows", [77, 200])
def test_gemv_takes_the_norm_in_bit_for_bit(env: Env, rng: np.random.Generator, wide_always: None, rows: int) -> None:
    """77 rows: a last block with 13 rows past N; 200: seven blocks."""
    x, residual, w = _norm_inputs(env, rng)
    linear_weight = env.gpu.upload(weight(rng, rows, env.d("hidden_size")), "bf16")

    def op(be: Any) -> tuple[Any, ...]:
        normed, total = be.add_rms_norm(x, residual, w, EPS)
        return be.linear(normed, linear_weight), normed, total

    runs = {form: _run(be, op) for form, be in _backends(env).items()}
    assert runs["separate"][1] == ["atlas_add_rms_norm", "atlas_gemv_t1"]
    assert runs["fused"][1] == ["atlas_gemv_norm_t1"]
    _same_bits(runs["fused"][0], runs["separate"][0])
    out, normed, total = runs["fused"][0]
    ref_normed, ref_total = env.ref.add_rms_norm(*(env.gpu.to_numpy(t) for t in (x, residual, w)), EPS)
    np.testing.assert_allclose(total, ref_total, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(normed, ref_normed, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantized_gemv_takes_the_norm_in_bit_for_bit(env: Env, rng: np.random.Generator, wide_always: None,
                                                      fmt: str) -> None:
    """The fp8 / nvfp4 GEMV (its x staged in swizzled slots) on the model's quantized tuple."""
    from atlas.backends.cuda.backend import CudaBackend
    from atlas.backends.cuda.quant_weights import upload
    from test_gpu_quant import open_tuple, quantize

    gpu, _, _ = open_tuple(env.model, fmt)
    host, _ = quantize(fmt, weight(rng, 77, env.d("hidden_size")))  # 3 wide blocks, the last one short
    quantized = upload(gpu.uploader, host)
    h = env.d("hidden_size")
    x, residual, w = (gpu.upload(t, "f32") for t in (normal(rng, 1, h, scale=2), normal(rng, 1, h), normal(rng, h) + 1))

    def op(be: Any) -> tuple[Any, ...]:
        normed, total = be.add_rms_norm(x, residual, w, EPS)
        return be.linear(normed, quantized), normed, total

    runs = {form: _run(CudaBackend(gpu.rt, use_graphs=False, norm=form), op) for form in ("separate", "fused")}
    assert runs["separate"][1] == ["atlas_add_rms_norm", f"atlas_qgemv_{fmt}_t1"]
    assert runs["fused"][1] == [f"atlas_qgemv_{fmt}_norm_t1"]
    _same_bits(runs["fused"][0], runs["separate"][0])


@pytest.mark.parametrize("router", ["split", "fused"])
@pytest.mark.parametrize("shared", [False, True])
def test_router_takes_the_norm_in_bit_for_bit(env: Env, rng: np.random.Generator, router: str, shared: bool) -> None:
    e, top_k, h = env.d("num_experts"), env.d("num_experts_per_tok"), env.d("hidden_size")
    x, residual, w = _norm_inputs(env, rng)
    router_weight = env.gpu.upload(weight(rng, e + int(shared), h) * 4, "bf16")

    def op(be: Any) -> tuple[Any, ...]:
        normed, total = be.add_rms_norm(x, residual, w, EPS)
        return (*be.router(normed, router_weight, top_k, True, shared_expert=shared), normed, total)

    runs = {form: _run(be, op) for form, be in _backends(env, router).items()}
    entry = "atlas_router_fused" if router == "fused" else "atlas_router_logits"
    assert runs["fused"][1] == [f"{entry}_norm", *(["atlas_router_top_k"] if router == "split" else [])]
    _same_bits(runs["fused"][0], runs["separate"][0])


def test_norms_taken_in_replay_in_a_captured_graph(env: Env, rng: np.random.Generator, wide_always: None) -> None:
    """norm -> GEMV [H, H] -> norm over its output and the first norm's sum -> router, captured once
    and replayed on fresh inputs: the second norm reads what the GEMV's first block wrote."""
    from atlas.backends.cuda.graph import GraphedDecodeStep

    e, top_k, h = env.d("num_experts"), env.d("num_experts_per_tok"), env.d("hidden_size")
    x, residual, w = _norm_inputs(env, rng)
    w2 = env.gpu.upload(normal(rng, h) + 1, "f32")
    proj, router_weight = env.gpu.upload(weight(rng, h, h), "bf16"), env.gpu.upload(weight(rng, e, h) * 4, "bf16")

    def chain(be: Any) -> tuple[Any, ...]:
        normed, total = be.add_rms_norm(x, residual, w, EPS)
        update = be.linear(normed, proj)
        normed2, total2 = be.add_rms_norm(update, total, w2, EPS)
        return (*be.router(normed2, router_weight, top_k, True), update, total2)

    backends = _backends(env)
    graphed = GraphedDecodeStep(env.gpu.rt, lambda ids, positions: chain(backends["fused"]))
    for _ in range(REPLAYS):
        env.gpu.rt.write(x, normal(rng, 1, h, scale=2))
        env.gpu.rt.write(residual, normal(rng, 1, h))
        want, _ = _run(backends["separate"], chain)
        env.gpu.rt.poison_scratch()
        outs = graphed(np.zeros(1, np.int32), np.zeros(1, np.int32))
        _same_bits([backends["fused"].to_numpy(t) for t in outs], want)
    assert graphed.captures == 1


def test_the_demo_decodes_the_same_logits_with_its_norms_taken_in(rng: np.random.Generator, wide_always: None) -> None:
    """The whole demo model, prefill then replayed decode steps teacher-forced, with the norms taken
    in and without: the same logits bit for bit; in an eager decode step every layer's two norms
    are taken in (the input norm by the in_proj or qkv GEMV, the post norm by the router), but
    the first layer's input norm, which has no residual to add, and the final norm too (by the
    lm_head GEMV, whose blocks wide_always lets take it)."""
    from test_gpu_model import gpu_llm

    llm = gpu_llm()
    engine, vocab = llm.parts.engine, llm.parts.spec.vocab_size
    backend = engine.backend
    prompt = rng.integers(0, vocab, size=int(rng.integers(2, 30))).tolist()
    fed = rng.integers(0, vocab, size=6).tolist()
    runs, taken = {}, {}
    try:
        for form in ("separate", "fused"):
            backend.use_decode_forms(norm=form)
            engine.reset()
            logits = [backend.to_numpy(engine.prefill(prompt))]
            logits += [backend.to_numpy(engine.decode(t, len(prompt) + i)) for i, t in enumerate(fed)]
            runs[form] = np.concatenate(logits)  # [1 + steps, V]
            token = backend.upload(np.array([fed[-1]], np.int32), "i32")
            with recorded(backend.rt) as names:
                engine.eager_decode(token, len(prompt) + len(fed))
                backend.rt.synchronize()
            taken[form] = sum(name in TAKING for name in names)
    finally:
        backend.use_decode_forms(norm="separate")
        engine.reset()
    _same_bits([runs["fused"]], [runs["separate"]])
    assert taken == {"separate": 0, "fused": 2 * llm.parts.spec.num_hidden_layers - 1 + 1}, taken
