"""Prefill attention over each KV cache level on the GPU: one full-attention layer's op (the cache
write, then causal attention) for a PROMPT_TOKENS prompt at the model's dimensions, with each
prefill attention form (ATLAS_PREFILL_ATTENTION: the SIMT kernels and the tensor-core ones), in
device microseconds between a pair of events around REPEATS back-to-back calls. bench/decode.py
--prefill-only runs it on its loaded backend: the number that says whether the tensor-core form
pays over a quantized cache too (kernels/include/atlas/kv_quant_mma.cuh)."""

from __future__ import annotations

from typing import Any

import numpy as np

PROMPT_TOKENS = 2048
REPEATS = 3


def _caches(backend: Any, level: str, shape: tuple[int, int, int]) -> Any:
    from atlas.backends.base import KVCache

    if level == "bf16":
        return KVCache(backend.rt.zeros(shape, "bf16"), backend.rt.zeros(shape, "bf16"))
    return KVCache(*(backend.quantized_kv_cache(level, shape) for _ in range(2)))


def _attend(backend: Any, form: str, step: dict[str, Any], cache: Any, scale: float) -> None:
    """The backend's own attention op with `form` as its prefill form (restored afterwards)."""
    own, backend.prefill_attention = backend.prefill_attention, form
    try:
        backend.rt.reset_step()
        backend.attention(step["q"], step["k"], step["v"], cache, step["positions"], scale)
    finally:
        backend.prefill_attention = own


def time_op(backend: Any, form: str, step: dict[str, Any], cache: Any, scale: float) -> float:
    """Device microseconds of one call, the mean of REPEATS after a warm-up call."""
    rt = backend.rt
    driver = rt.driver
    _attend(backend, form, step, cache, scale)
    start, end = driver.event_create(), driver.event_create()
    driver.event_record(start, rt.stream)
    for _ in range(REPEATS):
        _attend(backend, form, step, cache, scale)
    driver.event_record(end, rt.stream)
    driver.event_synchronize(end)
    return 1e3 * driver.event_elapsed_ms(start, end) / REPEATS


def time_levels(backend: Any, spec: Any, rng: np.random.Generator) -> dict[str, Any]:
    """{level: {form: microseconds}} for bf16 and every quantized level, and the prompt length."""
    from atlas.backends.cuda.ops_dense import PREFILL_ATTENTION_FORMS
    from atlas.backends.cuda.ops_kv import QUANTIZED_LEVELS

    tokens = PROMPT_TOKENS
    hq, hkv, d = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    step = {"q": backend.upload(normal(tokens, hq, d), "f32"), "k": backend.upload(normal(tokens, hkv, d), "f32"),
            "v": backend.upload(normal(tokens, hkv, d), "f32"),
            "positions": backend.upload(np.arange(tokens, dtype=np.int32), "i32")}
    us: dict[str, dict[str, float]] = {}
    for level in ("bf16", *QUANTIZED_LEVELS):
        cache = _caches(backend, level, (tokens, hkv, d))
        us[level] = {form: time_op(backend, form, step, cache, d**-0.5) for form in PREFILL_ATTENTION_FORMS}
    return {"prompt_tokens": tokens, "us_by_level": us}


def summary_line(result: dict[str, Any]) -> str:
    cells = ", ".join(f"{level} " + " / ".join(f"{form} {t:.0f}" for form, t in forms.items())
                      for level, forms in result["us_by_level"].items())
    return f"prefill attention us per layer at {result['prompt_tokens']} tokens: {cells}"
