"""The fused attention prep (atlas_attention_prep, ATLAS_ATTENTION_PREP=fused) on the GPU: q and k
head norm + rotary and the cache write of the rotated k and of v in one launch, then attention,
and the output gate inside atlas_attention_combine when decoding. Bit for bit the separate form's
result (two atlas_head_norm_rope launches, atlas_kv_cache_write and atlas_sigmoid_mul run the same
per-element arithmetic): the output and both caches, at decode and prefill sizes, gated or not, and
within the flash-attention bound of the numpy reference. Step scratch is
poisoned with NaN before each run and the cache rows the step writes start as NaN, so a row or
element left unwritten shows."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from atlas.backends.base import AttentionInputs, AttentionOperands, KVCache
from atlas.backends.numpy_backend import NumpyBackend
from atlas.layers.rotary import default_inv_freq

from test_gpu_ops import BF16_FLOOR, Env, bf16_round, check_bound, normal
from test_gpu_ops import env as env  # noqa: F401  (the module-scoped GPU fixture)

pytestmark = pytest.mark.gpu

CAPACITY = 1024
EPS = (1e-6, 0.5)  # q_norm's and k_norm's: far apart, so a swapped eps shows through bf16 rounding


def _host_case(env: Env, rng: np.random.Generator, tokens: int, start: int, gated: bool) -> dict[str, np.ndarray]:
    hq, hkv, d = env.d("num_attention_heads"), env.d("num_key_value_heads"), env.d("head_dim")
    case = {"q": normal(rng, tokens, hq, d, scale=2), "k": normal(rng, tokens, hkv, d, scale=2),
            "v": normal(rng, tokens, hkv, d), "q_norm": normal(rng, d) + 1, "k_norm": normal(rng, d) + 1,
            "k_cache": normal(rng, CAPACITY, hkv, d), "v_cache": normal(rng, CAPACITY, hkv, d),
            "inv_freq": default_inv_freq(env.d("rotary_dim"), 10_000_000.0),
            "positions": np.arange(start, start + tokens, dtype=np.int32)}
    for cache in (case["k_cache"], case["v_cache"]):
        cache[start : start + tokens] = np.nan  # the rows this step writes
    if gated:
        case["gate"] = normal(rng, tokens, hq, d, scale=3)
    return case


def _run(backend: Any, case: dict[str, np.ndarray], scaling: float) -> tuple[AttentionOperands, Any]:
    """Backend.full_attention on the case -> (the operands it ran with, its output). The numpy
    reference takes the host arrays themselves (its caches are written in place)."""
    up = (lambda a, dtype: a) if isinstance(backend, NumpyBackend) else backend.upload  # noqa: E731
    caches = KVCache(up(case["k_cache"], "bf16"), up(case["v_cache"], "bf16"))
    gate = up(case["gate"], "f32") if "gate" in case else None
    x = AttentionInputs(up(case["q"], "f32"), up(case["k"], "f32"), up(case["v"], "f32"), up(case["positions"], "i32"), gate)
    layer = AttentionOperands(up(case["q_norm"], "f32"), up(case["k_norm"], "f32"), *EPS, up(case["inv_freq"], "f32"),
                              scaling, caches, 1.0 / math.sqrt(case["q"].shape[-1]))
    if hasattr(backend, "rt"):
        backend.rt.reset_step()
        backend.rt.poison_scratch()
    return layer, backend.full_attention(x, layer)


def _reference(case: dict[str, np.ndarray], scaling: float, rounded: bool) -> np.ndarray:
    stored = {name: bf16_round(a) if rounded and name in ("k_cache", "v_cache", "q", "k", "v") else a.copy()
              for name, a in case.items()}
    return np.asarray(_run(NumpyBackend(), stored, scaling)[1])


@pytest.mark.parametrize("tokens,start,gated", [(1, 0, True), (1, 700, False), (3, 64, True), (17, 0, True),
                                                (40, 300, False)])
@pytest.mark.parametrize("scaling", [1.0, 1.25])
def test_fused_prep_equals_the_separate_ops(env: Env, rng: np.random.Generator, tokens: int, start: int, gated: bool,
                                            scaling: float) -> None:
    from atlas.backends.cuda.backend import CudaBackend

    case = _host_case(env, rng, tokens, start, gated)
    results = {}
    for form in ("separate", "fused"):
        backend = CudaBackend(env.gpu.rt, use_graphs=False, attention_prep=form)
        layer, out = _run(backend, case, scaling)
        assert backend.fuses_full_attention(layer.cache) == (form == "fused")
        results[form] = [backend.to_numpy(t) for t in (out, layer.cache.k, layer.cache.v)]
    for name, fused, separate in zip(("output", "k cache", "v cache"), results["fused"], results["separate"]):
        assert np.isfinite(fused).all(), f"{env.model} {name}: {int((~np.isfinite(fused)).sum())} unwritten values"
        np.testing.assert_array_equal(fused, separate, err_msg=f"{env.model} {name}: fused != separate")
    ref32, ref16 = _reference(case, scaling, False), _reference(case, scaling, True)
    check_bound(f"{env.model} fused attention", results["fused"][0], ref32, ref16, BF16_FLOOR * 5)


def test_quantized_caches_keep_the_separate_ops(env: Env) -> None:
    from atlas.backends.cuda.backend import CudaBackend

    backend = CudaBackend(env.gpu.rt, use_graphs=False, attention_prep="fused")
    shape = (CAPACITY, env.d("num_key_value_heads"), env.d("head_dim"))
    quantized = KVCache(backend.quantized_kv_cache("fp8", shape), backend.quantized_kv_cache("fp8", shape))
    assert not backend.fuses_full_attention(quantized)
    assert backend.fuses_full_attention(KVCache(backend.zeros(shape, "bf16"), backend.zeros(shape, "bf16")))
