"""Quantized KV cache kernels on the GPU (kernels/include/atlas/kv_quant.cuh, ops_kv.py):
the cache bytes the GPU writes equal the numpy encoder's bytes; attention through each level
matches the numpy backend over the same level (prefill, then decode steps); the tensor-core prefill
(ATLAS_PREFILL_ATTENTION=mma) over each level keeps test_gpu_attention_mma's bound; the demo recites
with its full-attention layer at fp8 and at turbo8."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from atlas.backends.base import KVCache
from atlas.backends.numpy_backend import NumpyBackend
from atlas.errors import AtlasError
from atlas.kvcache.hadamard import rotate, unrotate
from atlas.kvcache.levels import get_level
from atlas.kvcache.storage import QuantizedRows

from _gpu import assert_no_op_off, require_demo_cuda
from test_gpu_ops import BF16_FLOOR, bf16_round, check_bound, open_gpu_backend

pytestmark = pytest.mark.gpu

MODELS = ("atlas-demo", "qwen3.6-35b-a3b")
LEVELS = ("fp8", "nvfp4", "turbo8", "turbo4", "turbo3")
ATTENTION_RTOL = 2e-4  # the same decoded values on both sides: only f32 summation order differs
MMA_CAPACITY = 1536


@pytest.fixture(scope="module", params=MODELS)
def gpu(request: pytest.FixtureRequest) -> tuple[Any, dict[str, int]]:
    from atlas.targets import load_registry

    backend = open_gpu_backend(request.param)
    return backend, dict(load_registry().models[request.param].constants)


def _vectors(rng: np.random.Generator, *shape: int, largest: float = 20.0) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(rng.uniform(0.05, largest))
    if x.size:
        x.reshape(-1, shape[-1])[0] = 0.0  # one all-zero vector: zero scales
    return x


def _expected_bytes(level: str, shape: tuple[int, int, int], rows: dict[int, np.ndarray]) -> bytes:
    """The cache buffer the numpy encoder implies: its fields [S, Hkv, ...] zero except the written
    rows, concatenated in layout order."""
    from atlas.backends.cuda.ops_kv import fields_from_bytes, cache_bytes

    fields = fields_from_bytes(level, shape, np.zeros(cache_bytes(level, shape), dtype=np.uint8))
    fields = {name: array.copy() for name, array in fields.items()}
    for pos, x in rows.items():
        for name, array in get_level(level).encode(x).items():
            fields[name][pos] = array
    return b"".join(np.ascontiguousarray(a).tobytes() for a in fields.values())


@pytest.mark.parametrize("level", LEVELS)
def test_cache_bytes_equal_the_numpy_encoder(gpu: tuple[Any, dict[str, int]], level: str, rng: np.random.Generator) -> None:
    from atlas.backends.cuda import ops_kv

    backend, dims = gpu
    hkv, d = dims["num_key_value_heads"], dims["head_dim"]
    shape = (96, hkv, d)
    k_cache, v_cache = (ops_kv.quantized_cache(backend.rt, level, shape) for _ in range(2))
    k_rows: dict[int, np.ndarray] = {}
    v_rows: dict[int, np.ndarray] = {}
    for start, tokens in ((0, 37), (37, 1), (60, 3), (95, 1)):
        k, v = _vectors(rng, tokens, hkv, d), _vectors(rng, tokens, hkv, d)
        positions = np.arange(start, start + tokens, dtype=np.int32)
        backend.rt.reset_step()
        ops_kv.write(backend.rt, backend.upload(k, "f32"), backend.upload(v, "f32"), k_cache, v_cache,
                     backend.upload(positions, "i32"))
        k_rows.update({int(p): k[i] for i, p in enumerate(positions)})
        v_rows.update({int(p): v[i] for i, p in enumerate(positions)})
    for name, cache, rows in (("k", k_cache, k_rows), ("v", v_cache, v_rows)):
        got = backend.to_numpy(cache.data).tobytes()
        want = _expected_bytes(level, shape, rows)
        if got != want:
            fields_got = ops_kv.fields_from_bytes(level, shape, np.frombuffer(got, dtype=np.uint8))
            fields_want = ops_kv.fields_from_bytes(level, shape, np.frombuffer(want, dtype=np.uint8))
            bad = {f: int(np.sum(fields_got[f] != fields_want[f])) for f in fields_got}
            pytest.fail(f"{level} {name} cache differs from the numpy encoder: mismatching elements per field {bad}")


@pytest.mark.parametrize("level", LEVELS)
def test_attention_through_each_level_matches_numpy(gpu: tuple[Any, dict[str, int]], level: str,
                                                    rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SIMT kernels (whatever ATLAS_PREFILL_ATTENTION says: the mma form rounds to bf16 and has
    its own test below) on the decoded values, in f32 like numpy."""
    from atlas.backends.cuda import ops_kv

    backend, dims = gpu
    monkeypatch.setattr(backend, "prefill_attention", "simt")
    hq, hkv, d = dims["num_attention_heads"], dims["num_key_value_heads"], dims["head_dim"]
    capacity = 512
    ref = NumpyBackend()
    ref_k, ref_v = (QuantizedRows(get_level(level), (capacity, hkv, d)) for _ in range(2))
    k_cache, v_cache = (ops_kv.quantized_cache(backend.rt, level, (capacity, hkv, d)) for _ in range(2))
    start = 0
    for tokens in (70, 1, 3, 1, 40):  # prefill kernel, decode (split-K + combine), prefill again
        q, k, v = (_vectors(rng, tokens, h, d, largest=3.0) for h in (hq, hkv, hkv))  # softmax not one-hot
        positions = np.arange(start, start + tokens, dtype=np.int32)
        want = ref.attention(q, k, v, KVCache(ref_k, ref_v), positions, 1.0 / math.sqrt(d))
        backend.rt.reset_step()
        out = backend.attention(backend.upload(q, "f32"), backend.upload(k, "f32"), backend.upload(v, "f32"),
                                KVCache(k_cache, v_cache), backend.upload(positions, "i32"), 1.0 / math.sqrt(d))
        got = backend.to_numpy(out)
        err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
        assert np.all(np.isfinite(got)) and err < ATTENTION_RTOL, f"{level} at {start}+{tokens}: relative error {err:.2e}"
        start += tokens


def _mma_inputs(rng: np.random.Generator, dims: dict[str, int], tokens: int, start: int) -> dict[str, np.ndarray]:
    """A prefix of `start` rows already in the cache, then this step's q, k, v at start.."""
    hq, hkv, d = dims["num_attention_heads"], dims["num_key_value_heads"], dims["head_dim"]
    k_prefix, v_prefix = (_vectors(rng, start, hkv, d, largest=3.0) for _ in range(2))
    q, k, v = (_vectors(rng, tokens, h, d, largest=3.0) for h in (hq, hkv, hkv))
    return {"q": q, "k": k, "v": v, "k_prefix": k_prefix, "v_prefix": v_prefix,
            "positions": np.arange(start, start + tokens, dtype=np.int32)}


def kernel_basis(level: str) -> tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]:
    """(into, back): the basis the mma kernel multiplies a level's q and decoded rows in. The
    turbo levels store rotated vectors and the kernel rotates q to them (kv_quant_mma.cuh), so
    its bf16 operands are rounded there; the others, the vectors as they are."""
    return (rotate, unrotate) if level.startswith("turbo") else (np.asarray, np.asarray)


def quantized_references(level: str, x: dict[str, np.ndarray], scale: float) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """(fp32 ref, bf16 ref, decoded caches): the numpy backend over the level; the same attention
    with q and every decoded cache row rounded to bf16 where the mma kernel multiplies them (in
    kernel_basis(level), the output brought back), so it is a same-precision reference of that
    kernel: rounding the rotated vectors can cost several times what rounding them unrotated does
    (CI seed 1810714768, turbo4: 7.5e-3 against 2.6e-3); the decoded caches [end, Hkv, D]
    including this step's rows."""
    d = x["q"].shape[2]
    start, end = int(x["positions"][0]), int(x["positions"][-1]) + 1
    ref_k, ref_v = (QuantizedRows(get_level(level), (MMA_CAPACITY, x["k"].shape[1], d)) for _ in range(2))
    if start:
        ref_k[0:start], ref_v[0:start] = x["k_prefix"], x["v_prefix"]
    ref32 = NumpyBackend().attention(x["q"], x["k"], x["v"], KVCache(ref_k, ref_v), x["positions"], scale)
    decoded = {"k_cache": ref_k[0:end].copy(), "v_cache": ref_v[0:end].copy()}
    into, back = kernel_basis(level)
    k16, v16 = (bf16_round(into(decoded[name])) for name in ("k_cache", "v_cache"))
    ref16 = NumpyBackend().attention(bf16_round(into(x["q"])), k16[start:end], v16[start:end],
                                     KVCache(k16.copy(), v16.copy()), x["positions"], scale)
    return ref32, np.asarray(back(ref16), dtype=np.float32), decoded


def run_quantized_mma(backend: Any, level: str, x: dict[str, np.ndarray], scale: float) -> np.ndarray:
    """ops_kv.attention with prefill="mma" over fresh caches: every byte 0xFF first (NaN scales, so an
    unwritten row read as a key or value poisons the output), the prefix written, then the step."""
    from atlas.backends.cuda import ops_kv

    rt = backend.rt
    shape = (MMA_CAPACITY, x["k"].shape[1], x["k"].shape[2])
    k_cache, v_cache = (ops_kv.quantized_cache(rt, level, shape) for _ in range(2))
    for cache in (k_cache, v_cache):
        rt.write(cache.data, np.full(cache.nbytes, 0xFF, dtype=np.uint8))
    start = int(x["positions"][0])
    if start:
        rt.reset_step()
        ops_kv.write(rt, backend.upload(x["k_prefix"], "f32"), backend.upload(x["v_prefix"], "f32"), k_cache, v_cache,
                     backend.upload(np.arange(start, dtype=np.int32), "i32"))
    rt.reset_step()
    rt.poison_scratch()
    q, k, v = (backend.upload(x[n], "f32") for n in ("q", "k", "v"))
    out = ops_kv.attention(rt, q, k, v, KVCache(k_cache, v_cache), backend.upload(x["positions"], "i32"), scale,
                           prefill="mma")
    return backend.to_numpy(out)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(("tokens", "prefix"), [(17, False), (200, True)])
def test_prefill_mma_over_each_level_keeps_the_bf16_bound(gpu: tuple[Any, dict[str, int]], level: str, tokens: int,
                                                          prefix: bool, rng: np.random.Generator) -> None:
    """err(gpu vs the fp32 ref over the level) <= 2 * err(bf16 ref) + floor, as test_gpu_attention_mma."""
    backend, dims = gpu
    start = int(rng.integers(1, MMA_CAPACITY - tokens + 1)) if prefix else 0
    x = _mma_inputs(rng, dims, tokens, start)
    scale = 1.0 / math.sqrt(dims["head_dim"])
    ref32, ref16, _ = quantized_references(level, x, scale)
    out = run_quantized_mma(backend, level, x, scale)
    check_bound(f"{level} prefill mma T={tokens} start={start}", out, ref32, ref16, BF16_FLOOR * 5)


@pytest.mark.parametrize("level", LEVELS)
def test_demo_op_by_op_with_a_quantized_cache(level: str, rng: np.random.Generator) -> None:
    """The demo's full-attention layer on each level, prefill and decode steps, every intermediate
    against the numpy backend's on the same level, each op given the GPU's inputs (cross_check)."""
    from atlas.config import load_spec
    from atlas.cross_check import CheckedRun, check_backend
    from atlas.demo import DEMO_DIR
    from atlas.kvcache.options import KVCacheOptions

    require_demo_cuda()
    spec = load_spec(DEMO_DIR)
    ids = rng.integers(0, spec.vocab_size, size=int(rng.integers(12, 60))).tolist()
    reports, _ = check_backend(DEMO_DIR, "cuda", spec, ids, run=CheckedRun(3), kv_cache=KVCacheOptions(level, 0))
    assert_no_op_off(reports, f"{level}: ")


@pytest.mark.parametrize("level", ["fp8", "turbo8"])
def test_demo_recites_with_a_quantized_cache(level: str) -> None:
    from atlas import LLM
    from atlas.demo import DEMO_PROMPT, zen_of_python

    try:
        llm = LLM(device="cuda", kv_cache_dtype=level, kv_high_precision_layers=0)
    except (AtlasError, ImportError) as err:
        if os.environ.get("ATLAS_REQUIRE_GPU") == "1":
            raise
        pytest.skip(f"no CUDA backend here: {err}")
    assert level in llm.parts.engine.kv_plan, "the demo's full-attention layer must be quantized"
    result = llm.generate(DEMO_PROMPT, max_tokens=400, temperature=0.0)
    assert (DEMO_PROMPT + result.text)[:300] == zen_of_python()[:300]
