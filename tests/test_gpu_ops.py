"""Every CUDA op against the numpy reference, at the demo and the Qwen3.6 dimensions.

Bound (flash-attention style): err(gpu vs fp32 ref) <= 2 * err(bf16 ref vs fp32 ref) + floor,
err = ||out - ref32|| / ||ref32||, where the fp32 ref runs the numpy backend on the original
inputs and the bf16 ref on the inputs the GPU stores in bf16 (weights, caches, and activations of
ops that feed tensor cores) rounded to bf16. All step scratch memory is poisoned with NaN before
each op, so an unwritten output element fails. Fresh random inputs every run.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from atlas.backends.base import NO_TOKEN, KVCache, SamplingParams
from atlas.backends.numpy_backend import NumpyBackend
from atlas.config import Yarn, yarn_mscale
from atlas.errors import AtlasError
from atlas.layers.rotary import default_inv_freq, yarn_inv_freq
from atlas.sampling import draw_uniform

from _operands import delta_rule_operands

pytestmark = pytest.mark.gpu

MODELS = ("atlas-demo", "qwen3.6-35b-a3b")
F32_FLOOR = 2e-5
BF16_FLOOR = 2e-4
EXPERT_POOL = 16  # distinct expert matrices, repeated over E on the device (host memory stays small)


def open_gpu_backend(model: str) -> Any:
    """The CUDA backend for a registry model, or skip with the reason (fail under
    ATLAS_REQUIRE_GPU=1, which the device check sets)."""
    try:
        from atlas.backends.cuda.select import open_backend_for_model

        return open_backend_for_model(model)
    except (AtlasError, ImportError) as err:
        if os.environ.get("ATLAS_REQUIRE_GPU") == "1":
            raise
        pytest.skip(f"no CUDA backend here: {err}")


@dataclass
class Env:
    model: str
    gpu: Any
    dims: dict[str, int]
    ref: NumpyBackend = field(default_factory=NumpyBackend)

    def d(self, name: str) -> int:
        return int(self.dims[name])

    @property
    def conv_channels(self) -> int:
        return 2 * self.d("linear_num_key_heads") * self.d("linear_key_head_dim") + self.d(
            "linear_num_value_heads"
        ) * self.d("linear_value_head_dim")


@pytest.fixture(scope="module", params=MODELS)
def env(request: pytest.FixtureRequest) -> Env:
    from atlas.targets import load_registry

    backend = open_gpu_backend(request.param)
    return Env(request.param, backend, dict(load_registry().models[request.param].constants))


@pytest.fixture(params=("block", "split"))  # ops_dense.SAMPLE_FORMS
def sampler(env: Env, request: pytest.FixtureRequest) -> Iterator[Env]:
    """env with its backend drawing in the form the test is for (one block, or ATLAS_SAMPLE=split)."""
    before = env.gpu.sample_form
    env.gpu.sample_form = request.param
    yield env
    env.gpu.sample_form = before


@dataclass
class In:
    """One op argument: a tensor (storage set) or a plain value (storage None)."""

    value: Any
    storage: str | None = None  # "f32" | "bf16" | "i32"
    state: bool = False  # updated in place by the op: compared afterwards
    rounds: bool = False  # an f32 activation the kernel may convert to bf16


def bf16_round(x: np.ndarray) -> np.ndarray:
    from atlas.backends.cuda.upload import from_storage, to_storage

    return from_storage(to_storage(x, "bf16"), "bf16").reshape(x.shape)


def _as_inputs(inputs: list[Any]) -> list[In]:
    return [arg if isinstance(arg, In) else In(arg) for arg in inputs]


def _host_args(inputs: list[In], rounded: bool) -> list[Any]:
    args = []
    for arg in _as_inputs(inputs):
        value = arg.value
        if isinstance(value, ExpertPool):
            value = value.rounded() if rounded else value
        elif isinstance(value, np.ndarray):
            value = value.copy()
            if rounded and (arg.storage == "bf16" or arg.rounds):
                value = bf16_round(value)
        args.append(value)
    return args


def _gpu_args(env: Env, inputs: list[Any]) -> list[Any]:
    args = []
    for arg in _as_inputs(inputs):
        if isinstance(arg.value, ExpertPool):
            args.append(arg.value.upload(env.gpu))
        elif arg.storage is None:
            args.append(arg.value)
        else:
            args.append(env.gpu.upload(arg.value, arg.storage))
    return args


def _outputs(result: Any) -> list[Any]:
    return list(result) if isinstance(result, tuple) else [result]


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out64, ref64 = out.astype(np.float64), ref.astype(np.float64)
    return float(np.linalg.norm(out64 - ref64) / max(np.linalg.norm(ref64), 1e-30))


def check_bound(name: str, out: np.ndarray, ref32: np.ndarray, ref16: np.ndarray, floor: float) -> None:
    assert out.shape == ref32.shape, f"{name}: shape {out.shape} != {ref32.shape}"
    assert np.isfinite(out).all(), f"{name}: {int((~np.isfinite(out)).sum())} non-finite (unwritten?) values"
    err, err16 = rel_err(out, ref32), rel_err(ref16, ref32)
    assert err <= 2 * err16 + floor, f"{name}: err {err:.3e} > 2 * {err16:.3e} + {floor:.0e}"


def _flat(args: list[Any]) -> list[Any]:
    return args


def run_op(env: Env, op: str, inputs: list[Any], floor: float,
           pack: Callable[[list[Any]], list[Any]] = _flat) -> list[np.ndarray]:
    """Run op on the GPU and on both references; check every float output and state. Returns
    the GPU outputs (as numpy) for op-specific checks. Plain values (eps, top_k) pass as they are.
    `pack` groups the flat argument list into the op's arguments (a KVCache, DeltaNetOperands)."""
    inputs = _as_inputs(inputs)
    args32, args16 = _host_args(inputs, False), _host_args(inputs, True)
    ref32 = _outputs(getattr(env.ref, op)(*pack(args32)))
    ref16 = _outputs(getattr(env.ref, op)(*pack(args16)))
    gpu_args = _gpu_args(env, inputs)
    rt = env.gpu.rt
    rt.reset_step()
    rt.poison_scratch()
    gpu_out = [env.gpu.to_numpy(t) for t in _outputs(getattr(env.gpu, op)(*pack(gpu_args)))]
    assert len(gpu_out) == len(ref32), f"{op}: {len(gpu_out)} outputs, expected {len(ref32)}"
    for i, (out, r32, r16) in enumerate(zip(gpu_out, ref32, ref16)):
        if np.issubdtype(np.asarray(r32).dtype, np.floating):
            check_bound(f"{env.model} {op} output {i}", out, np.asarray(r32), np.asarray(r16), floor)
    for i, arg in enumerate(inputs):
        if arg.state:
            after = env.gpu.to_numpy(gpu_args[i])
            check_bound(f"{env.model} {op} state arg {i}", after, args32[i], args16[i], floor)
    return gpu_out


class ExpertPool:
    """E expert matrices made of `pool` distinct ones repeated (expert e = pool[e % P])."""

    def __init__(self, pool: np.ndarray, experts: int) -> None:
        self.pool, self.experts = pool, experts
        self.shape = (experts, *pool.shape[1:])

    def __getitem__(self, expert: Any) -> np.ndarray:
        return self.pool[int(expert) % self.pool.shape[0]]

    def rounded(self) -> ExpertPool:
        return ExpertPool(bf16_round(self.pool), self.experts)

    def upload(self, gpu: Any) -> Any:
        copies = self.experts // self.pool.shape[0]
        assert copies * self.pool.shape[0] == self.experts
        tiled = np.broadcast_to(self.pool[None], (copies, *self.pool.shape))
        return gpu.upload(tiled, "bf16").reshape(*self.shape)


def normal(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)


def weight(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    return normal(rng, n, k, scale=1.0 / math.sqrt(k))


# --- dense ops ------------------------------------------------------------------------------------
def test_embedding_is_an_exact_row_gather(env: Env, rng: np.random.Generator) -> None:
    vocab = min(env.d("vocab_size"), 4096)
    table = normal(rng, vocab, env.d("hidden_size"))
    ids = rng.integers(0, vocab, size=9).astype(np.int32)
    ids[0], ids[-1] = 0, vocab - 1
    (out,) = run_op(env, "embedding", [In(table, "bf16"), In(ids, "i32")], 0.0)
    np.testing.assert_array_equal(out, bf16_round(table)[ids])


@pytest.mark.parametrize("rows", [1, 3])
def test_nonfinite_count_counts_nan_and_infinity(env: Env, rng: np.random.Generator, rows: int) -> None:
    x = normal(rng, rows, env.d("hidden_size"), scale=1e30)  # [R, H] near float32's largest: still finite
    flat = x.reshape(-1)
    flat[int(rng.integers(flat.size))] = np.finfo(np.float32).max
    bad = rng.choice(flat.size, int(rng.integers(0, 40)), replace=False)
    flat[bad] = rng.choice([np.nan, np.inf, -np.inf], bad.size)
    (count,) = run_op(env, "nonfinite_count", [In(x, "f32")], 0.0)
    assert count.tolist() == [bad.size]


@pytest.mark.parametrize("dim", [36, 1001, 6000, 20000])
def test_norms_of_any_row_length(env: Env, rng: np.random.Generator, dim: int) -> None:
    """Rows the registers hold (dim % 4 == 0, up to 16 floats a thread, with more threads for
    6000) and rows the loop takes (odd lengths, and 20000 past 512 threads' registers)."""
    x, res, w = normal(rng, 3, dim, scale=3), normal(rng, 3, dim), normal(rng, dim) + 1  # [3, D], [3, D], [D]
    run_op(env, "rms_norm", [In(x, "f32"), In(w, "f32"), 1e-6], F32_FLOOR)
    run_op(env, "add_rms_norm", [In(x, "f32"), In(res, "f32"), In(w, "f32"), 1e-6], F32_FLOOR)


@pytest.mark.parametrize("tokens", [1, 17])
def test_norms_and_elementwise(env: Env, rng: np.random.Generator, tokens: int) -> None:
    h = env.d("hidden_size")
    x, res, w = normal(rng, tokens, h, scale=3), normal(rng, tokens, h), normal(rng, h) + 1
    run_op(env, "rms_norm", [In(x, "f32"), In(w, "f32"), 1e-6], F32_FLOOR)
    run_op(env, "add_rms_norm", [In(x, "f32"), In(res, "f32"), In(w, "f32"), 1e-6], F32_FLOOR)
    run_op(env, "add", [In(x, "f32"), In(res, "f32")], F32_FLOOR)
    inter = env.d("moe_intermediate_size")
    run_op(env, "silu_mul", [In(normal(rng, tokens, 2 * inter, scale=2), "f32")], F32_FLOOR)
    n = env.d("num_attention_heads") * env.d("head_dim")
    run_op(env, "sigmoid_mul", [In(normal(rng, tokens, n), "f32"), In(normal(rng, tokens, n, scale=3), "f32")],
           F32_FLOOR)
    run_op(env, "add_sigmoid_scaled",
           [In(x, "f32"), In(res, "f32"), In(normal(rng, tokens, 1, scale=2), "f32")], F32_FLOOR)


def _linear_shapes(env: Env) -> list[tuple[int, int]]:
    h = env.d("hidden_size")
    heads_q = env.d("num_attention_heads") * env.d("head_dim")
    values = env.d("linear_num_value_heads") * env.d("linear_value_head_dim")
    return [(env.conv_channels, h), (h, values), (heads_q, h), (2 * env.d("shared_expert_intermediate_size"), h),
            (1, h), (env.d("linear_num_value_heads"), h), (h, heads_q)]


@pytest.mark.parametrize("tokens", [1, 3, 17, 100])
def test_linear(env: Env, rng: np.random.Generator, tokens: int) -> None:
    for n, k in _linear_shapes(env):
        if n * tokens < 16:
            continue  # a handful of outputs make the norm-wise error bound a coin toss
        x = normal(rng, tokens, k)
        run_op(env, "linear", [In(x, "f32", rounds=True), In(weight(rng, n, k), "bf16")], BF16_FLOOR)


def test_linear_lm_head(env: Env, rng: np.random.Generator) -> None:
    v, h = env.d("vocab_size"), env.d("hidden_size")
    lm_head = weight(rng, v, h)
    for tokens in (1, 9):
        run_op(env, "linear", [In(normal(rng, tokens, h), "f32", rounds=True), In(lm_head, "bf16")], BF16_FLOOR)


@pytest.mark.parametrize("tokens,start", [(1, 0), (1, 777), (5, 40), (17, 0)])
def test_head_norm_rope(env: Env, rng: np.random.Generator, tokens: int, start: int) -> None:
    heads, d, rotary_dim = env.d("num_attention_heads"), env.d("head_dim"), env.d("rotary_dim")
    positions = np.arange(start, start + tokens, dtype=np.int32)
    yarn = Yarn(factor=4.0, original_max_position_embeddings=512, beta_fast=32.0, beta_slow=1.0,
                attention_factor=yarn_mscale(4.0, 1.0), truncate=True)
    tables = [(default_inv_freq(rotary_dim, theta), 1.0) for theta in (10_000.0, 10_000_000.0)]
    tables.append((yarn_inv_freq(rotary_dim, 10_000_000.0, yarn), yarn.attention_factor))
    for inv_freq, scaling in tables:
        run_op(env, "head_norm_rope",
               [In(normal(rng, tokens, heads, d, scale=2), "f32"), In(normal(rng, d) + 1, "f32"),
                In(positions, "i32"), In(inv_freq, "f32"), scaling, 1e-6], F32_FLOOR * 5)


def attention_args(args: list[Any]) -> list[Any]:
    """q, k, v, k_cache, v_cache, positions, scale -> Backend.attention's arguments."""
    q, k, v, k_cache, v_cache, positions, scale = args
    return [q, k, v, KVCache(k_cache, v_cache), positions, scale]


def delta_rule_args(args: list[Any]) -> list[Any]:
    """mixed_qkv, a, b, A_log, dt_bias, state, num_k_heads -> Backend.gated_delta_rule's arguments."""
    mixed, a, b, a_log, dt_bias, state, num_k_heads = args
    return [mixed, a, b, delta_rule_operands(a_log, dt_bias, state, num_k_heads)]


@pytest.mark.parametrize("tokens,start", [(1, 0), (1, 700), (3, 64), (17, 0), (80, 0), (40, 300)])
def test_attention(env: Env, rng: np.random.Generator, tokens: int, start: int) -> None:
    hq, hkv, d = env.d("num_attention_heads"), env.d("num_key_value_heads"), env.d("head_dim")
    capacity = 1024
    q, k, v = normal(rng, tokens, hq, d), normal(rng, tokens, hkv, d), normal(rng, tokens, hkv, d)
    k_cache, v_cache = normal(rng, capacity, hkv, d), normal(rng, capacity, hkv, d)
    positions = np.arange(start, start + tokens, dtype=np.int32)
    run_op(env, "attention",
           [In(q, "f32", rounds=True), In(k, "f32", rounds=True), In(v, "f32", rounds=True),
            In(k_cache, "bf16", state=True), In(v_cache, "bf16", state=True), In(positions, "i32"),
            1.0 / math.sqrt(d)], BF16_FLOOR * 5, pack=attention_args)


# --- linear attention -----------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", [1, 13, 150])  # 150: three token chunks (grid.y), windows read from x
def test_causal_conv1d(env: Env, rng: np.random.Generator, tokens: int) -> None:
    c, width = env.conv_channels, env.d("linear_conv_kernel_dim")
    run_op(env, "causal_conv1d",
           [In(normal(rng, tokens, c), "f32"), In(normal(rng, c, width, scale=0.5), "bf16"),
            In(normal(rng, c, width - 1), "f32", state=True)], BF16_FLOOR)


@pytest.mark.parametrize("tokens", [1, 2, 80])
def test_gated_delta_rule(env: Env, rng: np.random.Generator, tokens: int) -> None:
    hk, hv = env.d("linear_num_key_heads"), env.d("linear_num_value_heads")
    dk, dv = env.d("linear_key_head_dim"), env.d("linear_value_head_dim")
    mixed = normal(rng, tokens, 2 * hk * dk + hv * dv)
    a, b = normal(rng, tokens, hv), normal(rng, tokens, hv, scale=2)
    a_log = np.log(rng.uniform(1, 16, size=hv)).astype(np.float32)
    dt_bias = normal(rng, hv, scale=0.5)
    state = normal(rng, hv, dk, dv, scale=0.1)
    run_op(env, "gated_delta_rule",
           [In(mixed, "f32"), In(a, "f32"), In(b, "f32"), In(a_log, "f32"), In(dt_bias, "f32"),
            In(state, "f32", state=True), hk], 1e-4, pack=delta_rule_args)


@pytest.mark.parametrize("tokens", [1, 17])
def test_gated_rms_norm(env: Env, rng: np.random.Generator, tokens: int) -> None:
    hv, dv = env.d("linear_num_value_heads"), env.d("linear_value_head_dim")
    run_op(env, "gated_rms_norm",
           [In(normal(rng, tokens, hv, dv, scale=2), "f32"), In(normal(rng, tokens, hv, dv, scale=2), "f32"),
            In(normal(rng, dv) + 1, "f32"), 1e-6], F32_FLOOR)


# --- mixture of experts ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RouterCase:
    """One router call's host inputs: x [T, H] f32 (the kernel reads it as f32), w [E (+ 1), H]
    (uploaded as bf16)."""

    x: np.ndarray
    w: np.ndarray
    top_k: int
    renormalize: bool
    shared_expert: bool = False

    def reference(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The numpy router on f32 x and the weight given: ids, weights [T, k (+ 1)]."""
        return NumpyBackend().router(self.x, w, self.top_k, self.renormalize, shared_expert=self.shared_expert)


def check_router_weights(name: str, case: RouterCase, ids: np.ndarray, weights: np.ndarray) -> None:
    """The router's weights vs ref32 (f32 x, f32 w) within check_bound of ref16 = f32 x, bf16 w:
    the kernel's own inputs. A ref16 on bf16-rounded x adds an error the kernel does not make, and
    with few values (one token's k weights, the shared slot's one sigmoid) it lands nearer ref32
    than the exact kernel often enough to fail ~10 % of T = 1 draws (tests/test_router_weights_rule.py).
    Routed weights only of tokens whose ids equal both references' (a near-tie reorders them)."""
    ids16, ref16_w = case.reference(bf16_round(case.w))
    ids32, ref32_w = case.reference(case.w)
    keep = (ids == ids16).all(-1) & (ids16 == ids32).all(-1)  # [T]
    k = case.top_k
    check_bound(f"{name} routed weights", weights[keep, :k], ref32_w[keep, :k], ref16_w[keep, :k], BF16_FLOOR)
    if case.shared_expert:
        check_bound(f"{name} shared slot weight", weights[:, k], ref32_w[:, k], ref16_w[:, k], BF16_FLOOR)


@pytest.mark.parametrize("tokens,renormalize", [(1, True), (17, True), (17, False)])
def test_router(env: Env, rng: np.random.Generator, tokens: int, renormalize: bool) -> None:
    e, top_k, h = env.d("num_experts"), env.d("num_experts_per_tok"), env.d("hidden_size")
    x, w = normal(rng, tokens, h), weight(rng, e, h) * 4
    case = RouterCase(x, w, top_k, renormalize)
    gpu_args = _gpu_args(env, [In(x, "f32"), In(w, "bf16"), top_k, renormalize])
    env.gpu.rt.reset_step()
    env.gpu.rt.poison_scratch()
    ids_dev, weights_dev = env.gpu.router(*gpu_args)
    ids, weights = env.gpu.to_numpy(ids_dev), env.gpu.to_numpy(weights_dev)
    assert ids.shape == (tokens, top_k) and ((ids >= 0) & (ids < e)).all()
    # The kernel's inputs (f32 x, bf16 w): rounding x too moves logits by ~1e-2 and reorders
    # near-ties whose probabilities differ by more than the 2 % allowed (~2.5 % of Qwen3.6 T = 17 draws).
    ids_w, _ = case.reference(bf16_round(w))
    logits_w = x.astype(np.float64) @ bf16_round(w).astype(np.float64).T  # [T, E]
    probs_w = np.exp(logits_w - logits_w.max(-1, keepdims=True))
    probs_w /= probs_w.sum(-1, keepdims=True)
    chosen, expected = np.take_along_axis(probs_w, ids, -1), np.take_along_axis(probs_w, ids_w, -1)
    np.testing.assert_allclose(chosen, expected, rtol=2e-2, atol=1e-6)  # same experts up to near-ties
    ids16, _ = env.ref.router(bf16_round(x), bf16_round(w), top_k, renormalize)
    ref32_ids, _ = case.reference(w)
    same = (ids == ids16).all(-1) | (ids == ref32_ids).all(-1) | (ids == ids_w).all(-1)
    assert same.mean() >= 0.9, f"top-k ids differ from every reference on {(~same).sum()} tokens"
    check_router_weights(env.model, case, ids, weights)


def test_staging_reads_an_unaligned_x(env: Env, rng: np.random.Generator) -> None:
    """The one-token GEMV and the router stage x by cp.async when it is 16-byte aligned and element
    by element when not (stage.cuh): an x 4 bytes past alignment gives the same bits as an aligned
    copy of it."""
    h, e, top_k = env.d("hidden_size"), env.d("num_experts"), env.d("num_experts_per_tok")
    x = normal(rng, 1, h)
    aligned = env.gpu.upload(x, "f32")
    padded = env.gpu.upload(np.concatenate([normal(rng, 1, 1), x], axis=1), "f32")  # [1, 1 + H]
    shifted = padded.elements(1, 1 + h).reshape(1, h)
    assert aligned.ptr % 16 == 0 and shifted.ptr % 16 == 4
    linear_w, router_w = env.gpu.upload(weight(rng, 3 * 64 + 5, h), "bf16"), env.gpu.upload(weight(rng, e, h) * 4, "bf16")

    def outputs(x_dev: Any) -> list[np.ndarray]:
        env.gpu.rt.reset_step()
        env.gpu.rt.poison_scratch()
        ids, weights = env.gpu.router(x_dev, router_w, top_k, True)
        return [env.gpu.to_numpy(env.gpu.linear(x_dev, linear_w)), env.gpu.to_numpy(ids), env.gpu.to_numpy(weights)]

    for want, got in zip(outputs(aligned), outputs(shifted), strict=True):
        assert np.isfinite(want).all()
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("tokens", [1, 4, 17, 70])
def test_moe_experts(env: Env, rng: np.random.Generator, tokens: int) -> None:
    e, top_k, h = env.d("num_experts"), env.d("num_experts_per_tok"), env.d("hidden_size")
    inter = env.d("moe_intermediate_size")
    pool = min(e, EXPERT_POOL)
    gate_up = ExpertPool(normal(rng, pool, 2 * inter, h, scale=1 / math.sqrt(h)), e)
    down = ExpertPool(normal(rng, pool, h, inter, scale=1 / math.sqrt(inter)), e)
    ids = np.stack([rng.permutation(e)[:top_k] for _ in range(tokens)]).astype(np.int32)  # [T, k]
    hot = int(rng.integers(0, e))
    ids[:, 0] = hot  # one expert serves every token: its M tiles must all run
    for t in range(tokens):
        rest = [i for i in rng.permutation(e) if i != hot][: top_k - 1]
        ids[t, 1:] = rest
    routing = rng.uniform(0.1, 1.0, size=(tokens, top_k)).astype(np.float32)
    routing /= routing.sum(-1, keepdims=True)
    run_op(env, "moe_experts",
           [In(normal(rng, tokens, h), "f32", rounds=True), In(ids, "i32"), In(routing, "f32"),
            In(gate_up), In(down)], BF16_FLOOR)


def _decode_outputs(env: Env, prefetch: bool, args: dict[str, Any]) -> list[np.ndarray]:
    """The one-token GEMVs (wide and narrow) and MoE experts of `args`, with L2 prefetch on or off."""
    rt, gpu = env.gpu.rt, env.gpu
    before, rt.prefetch = getattr(rt, "prefetch", False), prefetch
    try:
        rt.reset_step()
        rt.poison_scratch()
        outs = [gpu.linear(args["x"], w) for w in args["weights"]]
        outs.append(gpu.moe_experts(args["x"], args["ids"], args["routing"], args["gate_up"], args["down"]))
        return [gpu.to_numpy(t) for t in outs]
    finally:
        rt.prefetch = before


def test_weight_prefetch_changes_no_bit(env: Env, rng: np.random.Generator) -> None:
    """ATLAS_PREFETCH=l2 adds L2 prefetches and nothing else: the decode GEMVs and MoE experts give
    the same bits with it as without (on the host emulator each prefetch span is also checked to
    stay inside its tensor: the last expert and the last rows are in the case)."""
    from atlas.backends.cuda.ops_dense import GEMV_WIDE_MIN_WAVES, GEMV_WIDE_ROWS_PER_BLOCK

    e, top_k, h = env.d("num_experts"), env.d("num_experts_per_tok"), env.d("hidden_size")
    inter, pool = env.d("moe_intermediate_size"), min(e, EXPERT_POOL)
    ids = np.concatenate([[e - 1], rng.permutation(e - 1)[: top_k - 1]]).astype(np.int32)[None]  # [1, k]
    routing = rng.uniform(0.1, 1.0, size=(1, top_k)).astype(np.float32)
    wide_rows = GEMV_WIDE_MIN_WAVES * env.gpu.rt.sm_count * GEMV_WIDE_ROWS_PER_BLOCK + int(rng.integers(1, 100))
    args = {
        "x": env.gpu.upload(normal(rng, 1, h), "f32"),
        "weights": [env.gpu.upload(weight(rng, n, h), "bf16") for n in (int(rng.integers(1, 200)), wide_rows)],
        "ids": env.gpu.upload(ids, "i32"), "routing": env.gpu.upload(routing / routing.sum(), "f32"),
        "gate_up": ExpertPool(normal(rng, pool, 2 * inter, h, scale=1 / math.sqrt(h)), e).upload(env.gpu),
        "down": ExpertPool(normal(rng, pool, h, inter, scale=1 / math.sqrt(inter)), e).upload(env.gpu),
    }
    plain, prefetched = _decode_outputs(env, False, args), _decode_outputs(env, True, args)
    for a, b in zip(plain, prefetched, strict=True):
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a, b)


# --- sampling -------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", [1, 3])
def test_argmax_lowest_index_on_ties(env: Env, rng: np.random.Generator, tokens: int) -> None:
    v = env.d("vocab_size")
    logits = normal(rng, tokens, v, scale=3)
    for t in range(tokens):
        first, second = np.sort(rng.choice(v, size=2, replace=False))
        logits[t, first] = logits[t, second] = logits[t].max() + 1
    device_logits = env.gpu.upload(logits, "f32")
    env.gpu.rt.reset_step()
    env.gpu.rt.poison_scratch()
    out = env.gpu.to_numpy(env.gpu.argmax(device_logits))
    np.testing.assert_array_equal(out, env.ref.argmax(logits))


def test_a_row_of_nan_alone_picks_no_token(sampler: Env, rng: np.random.Generator) -> None:
    """argmax and sample over a row of NaN alone (a model state gone NaN) give NO_TOKEN for the host
    to report, into poisoned outputs; a row with one number among the NaN, or of -inf alone, still
    picks (the number; greedy the first, sampled any, as the reference)."""
    env = sampler
    v = env.d("vocab_size")
    logits = np.full((3, v), np.nan, np.float32)  # [3, V] rows: NaN alone, one number, -inf alone
    number = int(rng.integers(v))
    logits[1, number] = rng.standard_normal()
    logits[2] = -np.inf
    env.gpu.rt.reset_step()
    env.gpu.rt.poison_scratch()
    np.testing.assert_array_equal(env.gpu.to_numpy(env.gpu.argmax(env.gpu.upload(logits, "f32"))), [NO_TOKEN, number, 0])
    params = SamplingParams(float(rng.uniform(0.5, 1.5)), int(rng.choice([0, 20])), float(rng.choice([1.0, 0.9])))
    for row, want in ((0, NO_TOKEN), (1, number)):
        env.gpu.rt.reset_step()
        env.gpu.rt.poison_scratch()
        got = env.gpu.to_numpy(env.gpu.sample(env.gpu.upload(logits[row : row + 1], "f32"), params, draw_uniform(rng)))
        assert int(got[0]) == want == int(env.ref.sample(logits[row : row + 1], params, 0.5)[0]), (row, params)
    check_sample(env, logits[2:], params, draw_uniform(rng), "-inf alone")


def test_sample_matches_reference(sampler: Env, rng: np.random.Generator) -> None:
    env = sampler
    v = env.d("vocab_size")
    settings = [SamplingParams(0.7, 0, 1.0), SamplingParams(1.0, 40, 1.0), SamplingParams(1.0, 0, 0.9),
                SamplingParams(1.5, 50, 0.5), SamplingParams(0.8, 1, 1.0), SamplingParams(1.0, 0, 0.05),
                SamplingParams(1.0, 0, 1.0, min_p=0.02), SamplingParams(0.7, 20, 0.95, min_p=0.1)]
    for params in settings:
        for _ in range(3):
            logits = normal(rng, 1, v, scale=4)
            check_sample(env, logits, params, draw_uniform(rng), "")


@pytest.mark.parametrize("vocab", [1, 7, 1023, 1025, 5000])
def test_sample_over_any_row_length(sampler: Env, rng: np.random.Generator, vocab: int) -> None:
    """Rows shorter than the split form's 1024 units (most units empty), just past them (units of
    2, the last short) and longer: the reference's token for a cut and an uncut row."""
    env = sampler
    for params in (SamplingParams(0.9, 0, 1.0), SamplingParams(1.0, 20, 0.9, min_p=0.05)):
        check_sample(env, normal(rng, 1, vocab, scale=3), params, draw_uniform(rng), f"V={vocab}")


SAMPLE_TOLERANCE = 1e-6  # of the kept mass: the device's expf and sums move each CDF step by ~1e-7


def check_sample(env: Env, logits: np.ndarray, params: SamplingParams, uniform: float, label: str) -> None:
    """The device's token (scratch poisoned first) is the reference's for the same uniform draw,
    or one whose CDF interval (or keep threshold) the draw misses only by rounding: over a
    248K-token vocabulary a 1e-7 shift of the cumulative sum moves ~1 % of draws to a neighbour."""
    env.gpu.rt.reset_step()
    env.gpu.rt.poison_scratch()
    got = env.gpu.to_numpy(env.gpu.sample(env.gpu.upload(logits, "f32"), params, uniform))
    want = env.ref.sample(logits, params, uniform)
    assert got.shape == (1,), f"{params} {label}: shape {got.shape}"
    if int(got[0]) != int(want[0]):
        assert within_rounding_of_draw(logits[0], params, uniform, int(got[0])), f"{params} {label} u={uniform}"


def within_rounding_of_draw(logits: np.ndarray, params: SamplingParams, uniform: float, token: int) -> bool:
    """Whether `token` would be chosen by the reference (atlas.sampling.choose_token's steps) for a
    draw, or a keep threshold, off by SAMPLE_TOLERANCE of the kept mass."""
    from atlas.sampling import softmax_probs, top_k_mask, top_p_mask

    probs = softmax_probs(logits, params.temperature)  # [V]
    keep = top_k_mask(probs, params.top_k) & (probs >= np.float32(params.min_p) * probs.max())
    keep = top_p_mask(probs, keep, params.top_p)
    kept = np.where(keep, probs, 0.0).astype(np.float64)  # [V]
    cumulative = np.cumsum(kept)  # [V]
    tolerance = SAMPLE_TOLERANCE * cumulative[-1]
    target = uniform * cumulative[-1]
    if not 0 <= token < probs.shape[0]:
        return False
    if not keep[token]:  # a tie at the top-k / top-p cut decided by rounding
        return bool(probs[token] >= kept[keep].min() * (1 - SAMPLE_TOLERANCE))
    return bool(cumulative[token] - kept[token] - tolerance <= target <= cumulative[token] + tolerance)


def test_penalize_matches_reference_bit_for_bit(env: Env, rng: np.random.Generator) -> None:
    """penalize does penalize_row's float32 steps (no FMA contraction: exact equality), into
    poisoned scratch, with and without logit_bias and the ending ids' mask; +-inf and NaN logits
    pass through as on the host. Then count_token adds a pick to the device counts."""
    from atlas.backends.base import PenaltyOperands
    from atlas.sampling import END_TOKEN, PROMPT_TOKEN, penalize_row

    v = env.d("vocab_size")
    logits = normal(rng, 1, v, scale=4)  # [1, V]
    logits[0, rng.choice(v, 3, replace=False)] = [np.inf, -np.inf, np.nan]
    counts = np.bincount(rng.choice(v, 60), minlength=v).astype(np.int32)  # [V]
    flags = np.zeros(v, dtype=np.int32)  # [V]
    flags[rng.choice(v, 200)] |= PROMPT_TOKEN
    flags[rng.choice(v, 3)] |= END_TOKEN
    bias = np.zeros(v, dtype=np.float32)  # [V]
    bias[rng.choice(v, 20, replace=False)] = rng.uniform(-100, 100, 20).astype(np.float32)
    device = PenaltyOperands(env.gpu.upload(counts, "i32"), env.gpu.upload(flags, "i32"), env.gpu.upload(bias, "f32"))
    cases = [(SamplingParams(presence_penalty=1.5), False, False),
             (SamplingParams(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.4, min_tokens=1), True, True),
             (SamplingParams(repetition_penalty=0.77, frequency_penalty=-1.9, logit_bias=((1, 1.0),)), False, True)]
    for params, mask_ends, biased in cases:
        operands = device if biased else PenaltyOperands(device.counts, device.flags, None)
        env.gpu.rt.reset_step()
        env.gpu.rt.poison_scratch()
        got = env.gpu.to_numpy(env.gpu.penalize(env.gpu.upload(logits, "f32"), operands, params, mask_ends))
        want = penalize_row(logits[0], counts, flags, bias if biased else None, params, mask_ends)
        assert got.shape == (1, v), params
        np.testing.assert_array_equal(got[0], want, err_msg=f"{params} mask_ends={mask_ends}")
    token = int(rng.integers(0, v))
    env.gpu.count_token(device.counts, env.gpu.upload(np.array([token], dtype=np.int32), "i32"))
    counts[token] += 1
    np.testing.assert_array_equal(env.gpu.to_numpy(device.counts), counts)


@pytest.mark.parametrize("k", [1, 64, 256])
def test_top_ids_match_reference(env: Env, rng: np.random.Generator, k: int) -> None:
    """The k largest logits' ids in order (ties the lower id first, NaN never) into a poisoned
    output; a flat row (every logit tied) lists everything on the demo, and at the Qwen3.6
    vocabulary nothing (past the kernel's 4096 candidates) or everything. (k near 1024 over a 248K row would crowd the candidates: the
    structured pick asks for 64.)"""
    v = env.d("vocab_size")
    logits = normal(rng, 1, v, scale=4)  # [1, V]
    top = np.argsort(logits[0])[-max(k, 8):]
    logits[0, rng.choice(top, 4, replace=False)] = logits[0].max()  # ties at the top
    logits[0, rng.choice(v, 5, replace=False)] = np.nan
    for row in (logits, np.zeros_like(logits)):
        env.gpu.rt.reset_step()
        env.gpu.rt.poison_scratch()
        got = env.gpu.to_numpy(env.gpu.top_ids(env.gpu.upload(row, "f32"), min(k, v)))
        want = env.ref.top_ids(row, min(k, v))
        if row is logits or v <= 4096:
            np.testing.assert_array_equal(got, want)
        else:  # the kernel lists none (its buffer would overflow); a backend may list them all
            assert np.all(got == -1) or np.array_equal(got, want), got[:8]


@pytest.mark.parametrize("top, temperature", [(0, 1.0), (5, 1.0), (20, 1.0), (256, 0.6), (20, 1e300)])
def test_logprob_rows_match_reference(env: Env, rng: np.random.Generator, top: int, temperature: float) -> None:
    """Per row: the log-sum-exp of logits / T (double, as hi + lo) within 1e-12 of the numpy op's,
    the token's logit and rank and the top ids and logits exactly, into poisoned outputs; a row with
    NaN and +-inf logits (its token a NaN: ranked as -inf), an all -inf row and one with a few -inf
    too, a row scoring its most likely token. T 0.6 with 256 ids: structured output's summary; T
    1e300 rounds to inf in float32."""
    v, rows = env.d("vocab_size"), 5
    logits = normal(rng, rows, v, scale=4)  # [R, V]
    odd = rng.choice(v, 6, replace=False)
    logits[1, odd] = [np.nan, np.nan, -np.inf, -np.inf, np.inf, logits[1].max()]
    logits[2] = -np.inf
    logits[4, rng.choice(v, 3, replace=False)] = -np.inf  # a masked row's: weight 0 at any T, never NaN
    tokens = rng.integers(0, v, rows).astype(np.int32)
    tokens[1], tokens[3] = odd[0], np.argmax(logits[3])
    env.gpu.rt.reset_step()
    env.gpu.rt.poison_scratch()
    got = env.gpu.logprob_rows(env.gpu.upload(logits, "f32"), env.gpu.upload(tokens, "i32"), top, temperature)
    want = env.ref.logprob_rows(logits, tokens, top, temperature)
    lse_got, lse_want = (env.gpu.to_numpy(got.lse).astype(np.float64), want.lse.astype(np.float64))
    np.testing.assert_array_equal(np.isfinite(lse_got[:, 0]), np.isfinite(lse_want[:, 0]))
    finite = np.isfinite(lse_want[:, 0])
    np.testing.assert_allclose(lse_got[finite].sum(-1), lse_want[finite].sum(-1), rtol=1e-12)
    np.testing.assert_array_equal(env.gpu.to_numpy(got.picked), want.picked)
    np.testing.assert_array_equal(env.gpu.to_numpy(got.ranks), want.ranks)
    listed = finite & np.isfinite(logits).any(-1)
    np.testing.assert_array_equal(env.gpu.to_numpy(got.ids)[listed], want.ids[listed])
    np.testing.assert_array_equal(env.gpu.to_numpy(got.values)[listed], want.values[listed])


def test_sample_top_p_alone_matches_reference(sampler: Env, rng: np.random.Generator) -> None:
    """top_p without top_k / min_p: a peaked row (the gathered candidates carry the top_p mass), a
    row whose mass sits in a long, nearly flat tail (the candidates fit but carry too little, so the
    full path runs) and a flat row (too many candidates): the reference's token each time."""
    env = sampler
    v = env.d("vocab_size")
    for kind in ("peaked", "tail", "flat"):
        for _ in range(3):
            if kind == "peaked":
                logits = normal(rng, 1, v, scale=4)
            elif kind == "tail":
                logits = normal(rng, 1, v, scale=0.01)
                logits[0, rng.choice(v, size=max(1, v // 250), replace=False)] += 2.0
            else:
                logits = np.zeros((1, v), dtype=np.float32)
            check_sample(env, logits, SamplingParams(0.6 if kind == "peaked" else 1.0, 0, 0.9), draw_uniform(rng), kind)


def test_sample_extremes_match_reference(sampler: Env, rng: np.random.Generator) -> None:
    """Temperatures whose logits / T overflow (1e-30 on large logits), round to a float32 denormal
    (1e-45) or to 0 (1e-60); top_p that rounds to 0; NaN and +inf logits: the reference's token,
    never an unwritten output (the scratch is poisoned)."""
    env = sampler
    v = env.d("vocab_size")
    cases: list[tuple[SamplingParams, str]] = [
        (SamplingParams(1e-30, 0, 1.0), "large"), (SamplingParams(1e-45, 5, 1.0), "plain"),
        (SamplingParams(1e-60, 0, 0.9), "plain"), (SamplingParams(1.0, 0, 1e-50), "plain"),
        (SamplingParams(0.9, 20, 0.95), "nan"), (SamplingParams(1.0, 0, 1.0), "inf"),
        (SamplingParams(1e300, 0, 1.0), "masked"),  # T rounds to inf in float32: masked stay 0, not NaN
    ]
    for params, kind in cases:
        for _ in range(3):
            logits = normal(rng, 1, v, scale=4)
            if kind == "large":
                logits *= 1e10
            elif kind in ("nan", "inf", "masked"):
                logits[0, rng.choice(v, size=7, replace=False)] = {"nan": np.nan, "inf": np.inf}.get(kind, -np.inf)
            check_sample(env, logits, params, draw_uniform(rng), kind)
