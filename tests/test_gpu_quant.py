"""The fp8 / nvfp4 kernels (ops_quant.py) against the numpy reference on the dequantized weights.

Weights are quantized by atlas.quant, uploaded in the device layout (quant_weights.py) and the
reference runs the numpy backend on atlas.quant's dequantization. Bound as in test_gpu_ops.py:
err(gpu vs fp32 ref) <= 2 * err(bf16 ref vs fp32 ref) + floor, the bf16 ref rounding what the
tensor-core paths round (activations, and fp8 weights times their block scale). Step scratch is
poisoned with NaN first, so an unwritten output fails. Needs a wheel holding the quant tuples
(ATLAS_TARGET_QUANT=fp8,nvfp4); skipped with the reason otherwise, failed under
ATLAS_REQUIRE_GPU_QUANT=1.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pytest

from _gpu import assert_no_op_off
from atlas.backends.numpy_backend import NumpyBackend
from atlas.errors import AtlasError
from atlas.quant.fp8_block import dequantize_fp8_block, quantize_fp8_block
from atlas.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

pytestmark = pytest.mark.gpu

MODELS = ("atlas-demo", "qwen3.6-35b-a3b")
FORMATS = ("fp8", "nvfp4")
FLOOR = 2e-4
MOE_EXPERTS = 16  # the kernels take E at run time: a slice of the 256 keeps host quantization quick


def bf16_round(x: np.ndarray) -> np.ndarray:
    from atlas.backends.cuda.upload import from_storage, to_storage

    return from_storage(to_storage(x, "bf16"), "bf16").reshape(x.shape)


def open_tuple(model: str, storage: str) -> tuple[Any, str, dict[str, int]]:
    """(CUDA backend of the model/storage tuple, storage, the model's constants), or a skip with
    the reason; a failure under ATLAS_REQUIRE_GPU (bf16) / ATLAS_REQUIRE_GPU_QUANT (fp8, nvfp4)."""
    from atlas.targets import load_registry

    try:
        from atlas.backends.cuda.select import open_backend_for_model

        backend = open_backend_for_model(model, storage)
    except (AtlasError, ImportError) as err:
        required = "ATLAS_REQUIRE_GPU" if storage == "bf16" else "ATLAS_REQUIRE_GPU_QUANT"
        if os.environ.get(required) == "1":
            raise
        pytest.skip(f"no CUDA backend with the {model}/{storage} tuple here: {err}")
    return backend, storage, dict(load_registry().models[model].constants)


@pytest.fixture(scope="module", params=[(m, f) for m in MODELS for f in FORMATS], ids=lambda p: f"{p[0]}-{p[1]}")
def gpu(request: pytest.FixtureRequest) -> tuple[Any, str, dict[str, int]]:
    return open_tuple(*request.param)


def quantize(fmt: str, w: np.ndarray) -> tuple[Any, np.ndarray]:
    """(HostQuantWeight, atlas.quant dequantization f32) of a dense [N, K] weight."""
    from atlas.backends.cuda.quant_weights import from_fp8_block, from_nvfp4

    if fmt == "fp8":
        q = quantize_fp8_block(w)
        return from_fp8_block(q.weight, q.scale_inv, q.block), dequantize_fp8_block(q.weight, q.scale_inv, q.block)
    q4 = quantize_nvfp4(w)
    return from_nvfp4(q4.weight, q4.weight_scale, q4.weight_scale_2), dequantize_nvfp4(q4.weight, q4.weight_scale, q4.weight_scale_2)


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out64, ref64 = out.astype(np.float64), ref.astype(np.float64)
    return float(np.linalg.norm(out64 - ref64) / max(np.linalg.norm(ref64), 1e-30))


def check_bound(name: str, out: np.ndarray, ref32: np.ndarray, ref16: np.ndarray) -> None:
    assert out.shape == ref32.shape, f"{name}: shape {out.shape} != {ref32.shape}"
    assert np.isfinite(out).all(), f"{name}: {int((~np.isfinite(out)).sum())} non-finite (unwritten?) values"
    err, err16 = rel_err(out, ref32), rel_err(ref16, ref32)
    assert err <= 2 * err16 + FLOOR, f"{name}: err {err:.3e} > 2 * {err16:.3e} + {FLOOR:.0e}"


def run(backend: Any, launch: Any) -> np.ndarray:
    rt = backend.rt
    rt.reset_step()
    rt.poison_scratch()
    return backend.to_numpy(launch(rt))


def normal(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)


def _linear_shapes(d: dict[str, int]) -> list[tuple[int, int]]:
    h = d["hidden_size"]
    heads_q = d["num_attention_heads"] * d["head_dim"]
    values = d["linear_num_value_heads"] * d["linear_value_head_dim"]
    conv = 2 * d["linear_num_key_heads"] * d["linear_key_head_dim"] + values
    return [(conv, h), (h, values), (2 * heads_q, h), (2 * d["shared_expert_intermediate_size"], h), (h, heads_q), (40, h)]


@pytest.mark.parametrize("tokens", [1, 3, 8, 17, 100])
def test_quant_linear(gpu: tuple[Any, str, dict[str, int]], rng: np.random.Generator, tokens: int) -> None:
    from atlas.backends.cuda import ops_quant
    from atlas.backends.cuda.quant_weights import upload

    backend, fmt, dims = gpu
    for n, k in _linear_shapes(dims):
        host, dense = quantize(fmt, normal(rng, n, k, scale=rng.uniform(0.2, 3.0) / math.sqrt(k)))
        device_w = upload(backend.uploader, host)
        x = normal(rng, tokens, k)
        device_x = backend.upload(x, "f32")
        out = run(backend, lambda rt: ops_quant.linear(rt, device_x, device_w))
        ref32 = x @ dense.T
        ref16 = bf16_round(x) @ bf16_round(dense).T
        check_bound(f"{fmt} linear {tokens}x{k} -> {n}", out, ref32, ref16)


def _routing(rng: np.random.Generator, tokens: int, experts: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    hot = int(rng.integers(0, experts))  # one expert serves every token: all its M tiles must run
    ids = np.empty((tokens, top_k), dtype=np.int32)  # [T, k]
    for t in range(tokens):
        ids[t, 0] = hot
        ids[t, 1:] = [i for i in rng.permutation(experts) if i != hot][: top_k - 1]
    routing = rng.uniform(0.1, 1.0, size=(tokens, top_k)).astype(np.float32)
    return ids, routing / routing.sum(-1, keepdims=True)


def _experts(fmt: str, rng: np.random.Generator, experts: int, rows: int, k: int) -> tuple[Any, np.ndarray]:
    """Stacked experts [E * rows, k] quantized per expert (per tensor scales differ), and [E, rows, k] f32."""
    from atlas.backends.cuda.quant_weights import stack_rows

    parts = [quantize(fmt, normal(rng, rows, k, scale=rng.uniform(0.5, 2.0) / math.sqrt(k))) for _ in range(experts)]
    return stack_rows([p[0] for p in parts]), np.stack([p[1] for p in parts])


@pytest.mark.parametrize("tokens,shared", [(1, False), (5, False), (77, False), (1, True), (5, True), (77, True)])
def test_quant_moe_experts(gpu: tuple[Any, str, dict[str, int]], rng: np.random.Generator, tokens: int,
                           shared: bool) -> None:
    """shared: the router's shared slot, slot k on expert E of E + 1 stacked (the k + 1 down entry)."""
    from atlas.backends.cuda import ops_quant
    from atlas.backends.cuda.quant_weights import stack_rows, upload

    backend, fmt, dims = gpu
    h, inter = dims["hidden_size"], dims["moe_intermediate_size"]
    routed = min(dims["num_experts"], MOE_EXPERTS)
    top_k = min(dims["num_experts_per_tok"], routed)
    experts = routed + int(shared)
    gate, gate_f32 = _experts(fmt, rng, experts, inter, h)
    up, up_f32 = _experts(fmt, rng, experts, inter, h)
    down, down_f32 = _experts(fmt, rng, experts, h, inter)
    per_expert = [stack_rows([gate.take_rows(slice(e * inter, (e + 1) * inter)), up.take_rows(slice(e * inter, (e + 1) * inter))])
                  for e in range(experts)]
    gate_up_dev = upload(backend.uploader, stack_rows(per_expert), experts)
    down_dev = upload(backend.uploader, down, experts)
    gate_up_f32 = np.concatenate([gate_f32, up_f32], axis=1)  # [E, 2I, H], gate rows first
    x = normal(rng, tokens, h)
    ids, routing = _routing(rng, tokens, routed, top_k)
    if shared:
        ids = np.concatenate([ids, np.full((tokens, 1), routed, np.int32)], axis=1)  # [T, k + 1]
        routing = np.concatenate([routing, rng.uniform(0.1, 1.0, (tokens, 1)).astype(np.float32)], axis=1)
    args = [backend.upload(x, "f32"), backend.upload(ids, "i32"), backend.upload(routing, "f32")]
    out = run(backend, lambda rt: ops_quant.moe_experts(rt, *args, gate_up_dev, down_dev))
    ref = NumpyBackend()
    ref32 = ref.moe_experts(x, ids, routing, gate_up_f32, down_f32)
    ref16 = ref.moe_experts(bf16_round(x), ids, routing, bf16_round(gate_up_f32), bf16_round(down_f32))
    check_bound(f"{fmt} moe_experts T={tokens} E={experts}", out, ref32, ref16)


def test_quant_linear_zero_tail_rows(gpu: tuple[Any, str, dict[str, int]], rng: np.random.Generator) -> None:
    """N not a multiple of any tile and K with a half K step (K % 32 == 16): bounds and zero fill."""
    from atlas.backends.cuda import ops_quant
    from atlas.backends.cuda.quant_weights import upload

    backend, fmt, _ = gpu
    n, k = 131, 16 * 41
    host, dense = quantize(fmt, normal(rng, n, k, scale=1 / math.sqrt(k)))
    device_w = upload(backend.uploader, host)
    for tokens in (2, 33):
        x = normal(rng, tokens, k)
        device_x = backend.upload(x, "f32")
        out = run(backend, lambda rt: ops_quant.linear(rt, device_x, device_w))
        check_bound(f"{fmt} ragged linear T={tokens}", out, x @ dense.T, bf16_round(x) @ bf16_round(dense).T)


def test_quant_linear_reads_unaligned_x_rows(gpu: tuple[Any, str, dict[str, int]], rng: np.random.Generator) -> None:
    """Above one token the GEMV stages x rows by cp.async when they are 16-byte aligned and element
    by element when not (stage.cuh): rows 4 bytes past alignment give the bits of aligned rows."""
    from atlas.backends.cuda import ops_quant
    from atlas.backends.cuda.quant_weights import upload

    backend, fmt, dims = gpu
    k = dims["hidden_size"]
    host, _ = quantize(fmt, normal(rng, 96, k, scale=1 / math.sqrt(k)))
    device_w = upload(backend.uploader, host)
    x = normal(rng, 3, k)
    aligned = backend.upload(x, "f32")
    padded = backend.upload(np.concatenate([normal(rng, 1), x.reshape(-1)])[None], "f32")  # [1, 1 + 3K]
    shifted = padded.elements(1, 1 + 3 * k).reshape(3, k)
    assert aligned.ptr % 16 == 0 and shifted.ptr % 16 == 4
    want = run(backend, lambda rt: ops_quant.linear(rt, aligned, device_w))
    got = run(backend, lambda rt: ops_quant.linear(rt, shifted, device_w))
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("model", MODELS)
def test_fp8_every_code_decodes_as_float8_e4m3fn(model: str, rng: np.random.Generator) -> None:
    """Weight row r holds code r in column c (other columns random finite codes, times a zero
    activation): each of the 256 codes, NaN codes 0x7f / 0xff included, must come out as ml_dtypes'
    float8_e4m3fn reads it, on the decode (1 token) and tensor-core (33 tokens) paths."""
    import ml_dtypes

    from atlas.backends.cuda import ops_quant
    from atlas.backends.cuda.quant_weights import from_fp8_block, upload

    backend, _, _ = open_tuple(model, "fp8")
    k = 48
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    codes = rng.choice(finite, size=(256, k))  # [N, K]
    column = int(rng.integers(0, k))
    codes[:, column] = np.arange(256)
    block_scale = np.exp2(rng.integers(-2, 3, size=(2, 1))).astype(np.float32)  # [N / 128, 1]
    device_w = upload(backend.uploader, from_fp8_block(codes, block_scale))
    values = codes[:, column].view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.repeat(block_scale[:, 0], 128)
    for tokens in (1, 33):
        x = np.zeros((tokens, k), dtype=np.float32)  # [T, K]
        x[:, column] = np.exp2(rng.integers(-3, 4, size=tokens))
        out = run(backend, lambda rt: ops_quant.linear(rt, backend.upload(x, "f32"), device_w))  # [T, N]
        expected = x[:, column:column + 1] * values[None, :]
        nan = np.isnan(expected)
        assert nan.sum() == 2 * tokens, "the reference lost its NaN codes"
        assert np.isnan(out[nan]).all(), f"T={tokens}: NaN codes read as {np.unique(out[nan])}"
        wrong = sorted({int(c) for c in np.nonzero((out != expected) & ~nan)[1]})
        assert not wrong, f"T={tokens}: codes {[hex(c) for c in wrong[:8]]} decode wrong"


def demo_backend_or_skip(fmt: str) -> Any:
    try:
        from atlas.backends.cuda.select import open_backend_for_model

        return open_backend_for_model("atlas-demo", fmt)
    except (AtlasError, ImportError) as err:
        if os.environ.get("ATLAS_REQUIRE_GPU_QUANT") == "1":
            raise
        pytest.skip(f"no CUDA backend with the atlas-demo/{fmt} tuple here: {err}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_demo_on_the_gpu_op_by_op(fmt: str, tmp_path: Any, rng: np.random.Generator) -> None:
    """The quantized demo's kernels (prefill GEMMs, decode GEMVs, the grouped MoE) against the numpy
    backend on the same checkpoint, every intermediate, each op given the GPU's inputs (cross_check)."""
    from atlas.config import load_spec
    from atlas.cross_check import CheckedRun, check_backend
    from atlas.demo import DEMO_DIR
    from atlas.quantize import QuantizeArgs, quantize

    demo_backend_or_skip(fmt)
    model_dir = quantize(QuantizeArgs(str(DEMO_DIR), fmt, tmp_path / fmt, 1 << 30))
    spec = load_spec(model_dir)
    ids = rng.integers(0, spec.vocab_size, size=int(rng.integers(12, 40))).tolist()
    reports, line = check_backend(model_dir, "cuda", spec, ids, run=CheckedRun(3))
    assert line.startswith("cuda")
    assert_no_op_off(reports, f"{fmt}: ")


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_demo_on_the_gpu_follows_numpy(fmt: str, tmp_path: Any) -> None:
    """The demo quantized by atlas.quantize, every quantized matrix uploaded packed: teacher-forced
    next-token choices of the GPU agree with the numpy backend on the same checkpoint."""
    from atlas.config import load_spec
    from atlas.demo import DEMO_DIR, zen_of_python
    from atlas.engine import Engine
    from atlas.quantize import QuantizeArgs, quantize
    from atlas.safetensors import Checkpoint
    from atlas.tokenizer import Tokenizer

    backend = demo_backend_or_skip(fmt)
    model_dir = quantize(QuantizeArgs(str(DEMO_DIR), fmt, tmp_path / fmt, 1 << 30))
    ids = Tokenizer.open(DEMO_DIR).encode(zen_of_python(), add_special_tokens=False)[:200]

    def top1(be: Any) -> np.ndarray:
        engine = Engine(load_spec(model_dir), Checkpoint.open(model_dir), be, max_seq_len=256)
        return np.asarray(engine.logits(ids)).argmax(axis=-1)  # [T]

    agreement = float((top1(backend) == top1(NumpyBackend())).mean())
    assert agreement >= 0.99, f"{fmt}: GPU vs numpy top-1 agreement {agreement:.3f}"
