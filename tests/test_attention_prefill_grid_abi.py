"""Prefill attention launches stay inside the grid limit (gridDim.z <= 65535 row tiles).

atlas_attention_prefill puts its 16-row tiles in grid z: a Qwen3.6 prompt of more than 131070
tokens (8 q heads per kv head) needs more tiles than one launch may have (its context is 262144).
ops_dense.attend launches it over token ranges instead; each launch is checked here against the
recording runtime, and the ranges' results (the kernel's arithmetic emulated in numpy) against
the numpy backend.
"""

from __future__ import annotations

import numpy as np
import pytest

from atlas.backends.base import KVCache
from atlas.backends.cuda import ops_dense, ops_kv

from _abi import RecordingRuntime, model_dims
from test_kernel_math_abi import emulate_attention

MAX_GRID_Z = 65535


def causal_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """q [T, Hq, D] over cache rows keys, values [S, Hkv, D], row t seeing keys 0..positions[t]."""
    group = q.shape[1] // keys.shape[1]
    k, v = (np.repeat(a.astype(np.float64), group, axis=1) for a in (keys, values))  # [S, Hq, D]
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(q.shape[2])  # [Hq, T, S]
    scores[:, np.arange(keys.shape[0])[None, :] > positions[:, None]] = -np.inf
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return np.einsum("hts,shd->thd", probs / probs.sum(axis=-1, keepdims=True), v)


def _prefill_launches(rt: RecordingRuntime) -> list:
    return [launch for launch in rt.launches if launch.kernel.startswith("atlas_attention_prefill")]


def _check_ranges(rt: RecordingRuntime, q: object, out: object, positions: object, tokens: int) -> list[tuple[int, int]]:
    """Each prefill launch within the grid limit; its q, out and positions are one token range's
    views; the ranges tile [0, tokens). Returns the ranges in launch order."""
    row_bytes = q.shape[1] * q.shape[2] * 4  # type: ignore[attr-defined]
    ranges = []
    for launch in _prefill_launches(rt):
        p = launch.params
        group = p.q_heads // p.kv_heads
        assert launch.grid[2] <= MAX_GRID_Z and launch.grid[2] * ops_dense.ATTN_PREFILL_ROWS >= p.tokens * group
        first, rest = divmod(p.q - q.ptr, row_bytes)  # type: ignore[attr-defined]
        assert rest == 0 and p.out == out.ptr + first * row_bytes  # type: ignore[attr-defined]
        assert p.positions == positions.ptr + 4 * first  # type: ignore[attr-defined]
        ranges.append((first, first + p.tokens))
    bounds = [first for first, _ in ranges] + [ranges[-1][1]]
    assert bounds[0] == 0 and bounds[-1] == tokens and all(a < b for a, b in zip(bounds, bounds[1:]))
    assert all(stop == first for (_, stop), (first, _) in zip(ranges, ranges[1:]))
    return ranges


@pytest.mark.parametrize("level", ["bf16", "turbo4"])
def test_a_long_qwen_prompt_fits_the_grid(level: str, rng: np.random.Generator) -> None:
    dims = model_dims("qwen3.6-35b-a3b")
    hq, hkv, d = dims["num_attention_heads"], dims["num_key_value_heads"], dims["head_dim"]
    tokens = int(rng.integers(131_071, 262_144))
    rt = RecordingRuntime()
    f = lambda *s: rt.empty(s, "f32")  # noqa: E731
    q, positions = f(tokens, hq, d), rt.empty((tokens,), "i32")
    if level == "bf16":
        caches = [rt.empty((262_144, hkv, d), "bf16") for _ in range(2)]
        out = ops_dense.attention(rt, q, f(tokens, hkv, d), f(tokens, hkv, d), KVCache(*caches), positions, d**-0.5)
    else:
        shape = (262_144, hkv, d)
        caches = [ops_kv.QuantizedKVCache(level, shape, rt.empty((ops_kv.cache_bytes(level, shape),), "u8"))
                  for _ in range(2)]
        out = ops_kv.attention(rt, q, f(tokens, hkv, d), f(tokens, hkv, d), KVCache(*caches), positions, d**-0.5)
    assert len(_check_ranges(rt, q, out, positions, tokens)) == 2


def test_token_ranges_give_the_reference_attention(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    q_heads, kv_heads, dim, capacity = 4, 2, 64, 300
    monkeypatch.setattr(ops_dense, "ATTN_MAX_ROW_TILES", 3)  # 24 tokens per launch at G = 2
    tokens = int(rng.integers(53, 68))  # three launches, the last over more than 4 tokens
    start = int(rng.integers(0, capacity - tokens + 1))
    positions = np.arange(start, start + tokens, dtype=np.int32)
    q = rng.standard_normal((tokens, q_heads, dim)).astype(np.float32)
    k, v = (rng.standard_normal((tokens, kv_heads, dim)).astype(np.float32) for _ in range(2))
    k_cache, v_cache = (rng.standard_normal((capacity, kv_heads, dim)).astype(np.float32) for _ in range(2))
    k_cache[positions], v_cache[positions] = k, v  # what the kv write does before the launches
    want = causal_attention(q, k_cache, v_cache, positions)

    rt = RecordingRuntime()
    q_dev, positions_dev = rt.empty(q.shape, "f32"), rt.empty((tokens,), "i32")
    caches = [rt.empty((capacity, kv_heads, dim), "bf16") for _ in range(2)]
    out_dev = ops_dense.attention(rt, q_dev, rt.empty(k.shape, "f32"), rt.empty(v.shape, "f32"), KVCache(*caches),
                                  positions_dev, dim**-0.5)
    ranges = _check_ranges(rt, q_dev, out_dev, positions_dev, tokens)
    assert len(ranges) == 3
    got = np.concatenate([emulate_attention(q[a:b], k_cache, v_cache, positions[a:b]) for a, b in ranges])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
