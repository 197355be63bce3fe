"""The tensor-core prefill attention (ATLAS_PREFILL_ATTENTION=mma, attention_mma.cuh) against the
numpy reference, at the demo and the Qwen3.6 dimensions, with a prefix already in the cache.

Bound as tests/test_gpu_ops.py: err(gpu vs fp32 ref) <= 2 * err(bf16 ref vs fp32 ref) + floor, the
bf16 ref on q, k, v and the caches rounded to bf16. Step scratch (the output) is poisoned with NaN
first; cache rows past the live keys hold NaN, so a read past them fails too. Fresh random inputs.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from atlas.backends.base import KVCache
from atlas.backends.numpy_backend import NumpyBackend

from test_gpu_ops import BF16_FLOOR, MODELS, bf16_round, check_bound, normal, open_gpu_backend

pytestmark = pytest.mark.gpu

CAPACITY = 2048


@pytest.fixture(scope="module", params=MODELS)
def gpu(request: pytest.FixtureRequest) -> tuple[str, Any, dict[str, int]]:
    from atlas.targets import load_registry

    backend = open_gpu_backend(request.param)
    return request.param, backend, dict(load_registry().models[request.param].constants)


def _inputs(rng: np.random.Generator, dims: dict[str, int], tokens: int, start: int) -> dict[str, np.ndarray]:
    hq, hkv, d = dims["num_attention_heads"], dims["num_key_value_heads"], dims["head_dim"]
    k_cache, v_cache = normal(rng, CAPACITY, hkv, d), normal(rng, CAPACITY, hkv, d)
    k_cache[start + tokens:], v_cache[start + tokens:] = np.nan, np.nan
    return {"q": normal(rng, tokens, hq, d), "k": normal(rng, tokens, hkv, d), "v": normal(rng, tokens, hkv, d),
            "k_cache": k_cache, "v_cache": v_cache, "positions": np.arange(start, start + tokens, dtype=np.int32)}


def _reference(x: dict[str, np.ndarray], rounded: bool, scale: float) -> np.ndarray:
    arrays = {name: bf16_round(a) if rounded and name != "positions" else a.copy() for name, a in x.items()}
    return NumpyBackend().attention(arrays["q"], arrays["k"], arrays["v"], KVCache(arrays["k_cache"], arrays["v_cache"]),
                                    arrays["positions"], scale)


def _run_mma(backend: Any, x: dict[str, np.ndarray], scale: float) -> np.ndarray:
    from atlas.backends.cuda import ops_dense

    storage = {"k_cache": "bf16", "v_cache": "bf16", "positions": "i32"}
    dev = {name: backend.upload(a, storage.get(name, "f32")) for name, a in x.items()}
    rt = backend.rt
    rt.reset_step()
    rt.poison_scratch()
    out = ops_dense.attention(rt, dev["q"], dev["k"], dev["v"], KVCache(dev["k_cache"], dev["v_cache"]), dev["positions"],
                              scale, prefill="mma")
    return backend.to_numpy(out)


@pytest.mark.parametrize("tokens", [1, 17, 64, 200, 1000])
@pytest.mark.parametrize("prefix", [False, True])
def test_prefill_mma_matches_the_reference(gpu: tuple[str, Any, dict[str, int]], rng: np.random.Generator,
                                           tokens: int, prefix: bool) -> None:
    if tokens == 1:
        pytest.skip("T = 1 is decode: the split-K kernel (tests/test_gpu_ops.py)")
    model, backend, dims = gpu
    start = int(rng.integers(1, CAPACITY - tokens + 1)) if prefix else 0
    x = _inputs(rng, dims, tokens, start)
    scale = 1.0 / math.sqrt(dims["head_dim"])
    out = _run_mma(backend, x, scale)
    check_bound(f"{model} prefill mma T={tokens} start={start}", out, _reference(x, False, scale),
                _reference(x, True, scale), BF16_FLOOR * 5)


def test_backend_takes_the_form_it_was_built_with(gpu: tuple[str, Any, dict[str, int]], rng: np.random.Generator,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaBackend reads ATLAS_PREFILL_ATTENTION once; its attention then equals the mma op."""
    from atlas.backends.cuda.backend import CudaBackend

    model, backend, dims = gpu
    monkeypatch.setenv("ATLAS_PREFILL_ATTENTION", "mma")
    mma_backend = CudaBackend(backend.rt, use_graphs=False)
    assert mma_backend.prefill_attention == "mma"
    x = _inputs(rng, dims, 300, int(rng.integers(1, 700)))
    scale = 1.0 / math.sqrt(dims["head_dim"])
    want = _run_mma(backend, x, scale)
    storage = {"k_cache": "bf16", "v_cache": "bf16", "positions": "i32"}
    dev = {name: mma_backend.upload(a, storage.get(name, "f32")) for name, a in x.items()}
    backend.rt.reset_step()
    backend.rt.poison_scratch()
    got = mma_backend.to_numpy(mma_backend.attention(dev["q"], dev["k"], dev["v"], KVCache(dev["k_cache"], dev["v_cache"]),
                                                     dev["positions"], scale))
    np.testing.assert_array_equal(got, want, err_msg=f"{model}: backend attention is not the mma kernel's")
