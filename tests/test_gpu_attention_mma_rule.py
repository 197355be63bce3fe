"""test_gpu_attention_mma's bound, checked on the CPU against a numpy model of attention_mma.cuh's
rounding: q, k, v and the caches in bf16, scores in f32, an online softmax over 32-key tiles in the
log2 domain whose P is rounded to bf16 for the P V product and for the row sum. That P rounding is
not in the test's ref16; it must still pass the bound in every draw (one-off: 0 failures in 20 draws
x T in 17, 64, 200, 1000 x 2 prefixes x 2 models, err / bound <= ~0.5), and a result 2 % off must
fail it. The same for the quantized levels (test_gpu_kv's mma test): the model runs on the decoded
cache, rotated into the keys' basis for the turbo levels (q too) and the output rotated back; their
ref16 rounds in that basis too (test_gpu_kv.kernel_basis). One-off, 2026-12-05: 0 failures in 25
draws x 4 (T, prefix) x 5 levels, err / bound <= ~0.55; a 2 % off output at T = 64 failed every
one of 60 draws per level, at >= 1.09 x the bound."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import test_gpu_attention_mma
import test_gpu_kv
from atlas.targets import load_registry
from test_gpu_ops import bf16_round

KEY_TILE = 32  # kMmaAttnKeys


def _heads_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, last: np.ndarray, scale: float) -> np.ndarray:
    """rows q [R, D] of one kv head over keys / values [L, D] (bf16 values, f64 here), each row
    seeing keys 0..last[row]: the kernel's online softmax with bf16 P."""
    rows, dim = q.shape
    m, l, o = np.full(rows, -np.inf), np.zeros(rows), np.zeros((rows, dim))
    for k0 in range(0, keys.shape[0], KEY_TILE):
        key = np.arange(k0, min(k0 + KEY_TILE, keys.shape[0]))
        s = (q @ keys[key].T).astype(np.float32).astype(np.float64) * (scale * math.log2(math.e))  # [R, 32]
        s = np.where(key[None] <= last[:, None], s, -np.inf)
        top = np.maximum(m, s.max(1))
        base = np.where(top == -np.inf, 0.0, top)
        alpha = np.exp2(m - base)
        p = bf16_round(np.exp2(s - base[:, None]).astype(np.float32)).astype(np.float64)  # [R, 32]
        m, l, o = top, l * alpha + p.sum(1), o * alpha[:, None] + p @ values[key]
    return o / l[:, None]


def mma_model(x: dict[str, np.ndarray], scale: float, off: float = 1.0) -> np.ndarray:
    q, k, v = (bf16_round(x[n]).astype(np.float64) for n in ("q", "k", "v"))  # [T, H*, D]
    k_cache, v_cache = (bf16_round(x[n]).astype(np.float64) for n in ("k_cache", "v_cache"))
    positions = x["positions"]
    k_cache[positions], v_cache[positions] = k, v
    end = int(positions[-1]) + 1
    tokens, q_heads, dim = q.shape
    group = q_heads // k.shape[1]
    out = np.empty((tokens, q_heads, dim))
    for h in range(k.shape[1]):
        rows = q[:, h * group : (h + 1) * group].reshape(tokens * group, dim)  # row = token * G + g
        seen = _heads_attention(rows, k_cache[:end, h], v_cache[:end, h], np.repeat(positions, group), scale)
        out[:, h * group : (h + 1) * group] = seen.reshape(tokens, group, dim)
    return (out * off).astype(np.float32)


def _gpu(model: str) -> tuple[str, Any, dict[str, int]]:
    return model, None, dict(load_registry().models[model].constants)


@pytest.mark.parametrize("model", ["atlas-demo", pytest.param("qwen3.6-35b-a3b", marks=pytest.mark.slow)])
def test_mma_rounding_passes_the_bound(model: str, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_gpu_attention_mma, "_run_mma", lambda backend, x, scale: mma_model(x, scale))
    for tokens in (17, 64, 200):
        for prefix in (False, True):
            test_gpu_attention_mma.test_prefill_mma_matches_the_reference(_gpu(model), rng, tokens, prefix)


def test_two_percent_off_fails(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_gpu_attention_mma, "_run_mma", lambda backend, x, scale: mma_model(x, scale, 1.02))
    with pytest.raises(AssertionError, match="err"):
        test_gpu_attention_mma.test_prefill_mma_matches_the_reference(_gpu("atlas-demo"), rng, 64, True)


def quantized_mma_model(level: str, x: dict[str, np.ndarray], scale: float, off: float = 1.0) -> np.ndarray:
    """KvqMmaKv's arithmetic: mma_model over the decoded cache (kv_quant_mma.cuh decodes each tile
    and rounds it to bf16), in the rotated basis for the turbo levels."""
    decoded = test_gpu_kv.quantized_references(level, x, scale)[2]
    basis, back = test_gpu_kv.kernel_basis(level)
    positions = x["positions"]
    model_x = {"q": basis(x["q"]), "k": basis(decoded["k_cache"][positions]), "v": basis(decoded["v_cache"][positions]),
               "k_cache": basis(decoded["k_cache"]), "v_cache": basis(decoded["v_cache"]), "positions": positions}
    return np.asarray(back(mma_model(model_x, scale, off)), dtype=np.float32)


@pytest.mark.parametrize("level", test_gpu_kv.LEVELS)
def test_quantized_mma_rounding_passes_the_bound(level: str, rng: np.random.Generator,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_gpu_kv, "run_quantized_mma", lambda backend, lv, x, scale: quantized_mma_model(lv, x, scale))
    gpu = (None, dict(load_registry().models["atlas-demo"].constants))
    for tokens in (17, 200):
        for prefix in (False, True):
            test_gpu_kv.test_prefill_mma_over_each_level_keeps_the_bf16_bound(gpu, level, tokens, prefix, rng)


@pytest.mark.parametrize("level", ["fp8", "turbo3"])
def test_quantized_two_percent_off_fails(level: str, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_gpu_kv, "run_quantized_mma",
                        lambda backend, lv, x, scale: quantized_mma_model(lv, x, scale, 1.02))
    gpu = (None, dict(load_registry().models["atlas-demo"].constants))
    with pytest.raises(AssertionError, match="err"):
        test_gpu_kv.test_prefill_mma_over_each_level_keeps_the_bf16_bound(gpu, level, 64, True, rng)
