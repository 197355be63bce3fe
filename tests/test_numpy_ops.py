"""Every op of the numpy reference backend against torch / transformers' own implementation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from atlas.backends.base import NO_TOKEN, KVCache, SamplingParams
from atlas.backends.numpy_backend import NumpyBackend
from atlas.config import spec_from_config
from atlas.layers.rotary import default_inv_freq, rope_frequencies
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

from _operands import delta_rule_operands

be = NumpyBackend()


def randn(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def t(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x))


def close(ours: np.ndarray, ref: torch.Tensor | np.ndarray, tol: float = 1e-5) -> None:
    ref = ref.detach().numpy() if isinstance(ref, torch.Tensor) else ref
    assert ours.shape == ref.shape
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, rtol=tol, atol=tol)


def test_upload_zeros_to_numpy(rng: np.random.Generator) -> None:
    x = rng.standard_normal((3, 4))
    up = be.upload(x, "bf16")
    assert up.dtype == np.float32 and up.flags.c_contiguous
    x[0, 0] = 99.0
    assert up[0, 0] != 99.0
    ids = be.upload(np.array([1, 2], dtype=np.int64), "i32")
    assert ids.dtype == np.int32
    assert be.zeros((2, 3), "f32").sum() == 0 and be.zeros((2,), "i32").dtype == np.int32
    assert be.to_numpy(ids).dtype == np.int32


def test_embedding_linear_elementwise(rng: np.random.Generator) -> None:
    table = randn(rng, 50, 16)
    ids = rng.integers(0, 50, 7).astype(np.int32)
    close(be.embedding(table, ids), F.embedding(t(ids).long(), t(table)))
    x, w = randn(rng, 7, 16), randn(rng, 24, 16)
    close(be.linear(x, w), F.linear(t(x), t(w)), 1e-4)
    gu = randn(rng, 7, 24)
    close(be.silu_mul(gu), F.silu(t(gu[:, :12])) * t(gu[:, 12:]))
    y, gate = randn(rng, 7, 16), randn(rng, 7, 16)
    close(be.sigmoid_mul(y, gate), t(y) * torch.sigmoid(t(gate)))
    close(be.add(x, y), t(x) + t(y))
    logit = randn(rng, 7, 1)
    close(be.add_sigmoid_scaled(x, y, logit), t(x) + torch.sigmoid(t(logit)) * t(y))


def test_rms_norms_match_transformers(rng: np.random.Generator) -> None:
    x, res, w = randn(rng, 5, 32), randn(rng, 5, 32), randn(rng, 32, scale=0.3)
    norm = hf.Qwen3_5MoeRMSNorm(32, eps=1e-6)
    norm.weight.data = t(w)
    close(be.rms_norm(x, 1.0 + w, 1e-6), norm(t(x)))
    normed, total = be.add_rms_norm(x, res, 1.0 + w, 1e-6)
    close(total, t(x) + t(res))
    close(normed, norm(t(x) + t(res)))
    gated = hf.Qwen3_5MoeRMSNormGated(16, eps=1e-6)
    gated.weight.data = t(w[:16])
    xs, zs = randn(rng, 5, 3, 16), randn(rng, 5, 3, 16)
    ref = gated(t(xs).reshape(-1, 16), t(zs).reshape(-1, 16)).reshape(5, 3, 16)
    close(be.gated_rms_norm(xs, zs, w[:16], 1e-6), ref)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 65_536}


@pytest.mark.parametrize("head_dim,factor,max_position,yarn", [
    (64, 0.25, 500, False), (32, 0.5, 300_000, False), (16, 1.0, 40_000, False), (64, 0.25, 262_144, True),
    (32, 0.5, 3_000, True),
])  # fmt: skip
def test_head_norm_rope_matches_transformers(
    rng: np.random.Generator, head_dim: int, factor: float, max_position: int, yarn: bool
) -> None:
    rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": factor, **(YARN if yarn else {})}
    config = hf.Qwen3_5MoeTextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rope_parameters=rope,
        max_position_embeddings=262_144,
    )
    rotary = hf.Qwen3_5MoeTextRotaryEmbedding(config)
    norm = hf.Qwen3_5MoeRMSNorm(head_dim, eps=1e-6)
    w = randn(rng, head_dim, scale=0.3)
    norm.weight.data = t(w)
    x = randn(rng, 9, 4, head_dim)
    positions = np.sort(rng.choice(max_position, 9, replace=False)).astype(np.int32)
    cos, sin = rotary(t(x), t(positions).long()[None])
    normed = norm(t(x)).transpose(0, 1)[None]  # [1, heads, T, D]
    ref, _ = hf.apply_rotary_pos_emb(normed, normed, cos, sin)
    inv_freq, scaling = rope_frequencies(spec_from_config(config.to_dict(), Path("config.json")))
    assert (scaling != 1.0) == yarn
    ours = be.head_norm_rope(x, 1.0 + w, positions, inv_freq, scaling, 1e-6)
    close(ours, ref[0].transpose(0, 1), 1e-4)


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_attention_prefill_and_decode_match_sdpa(rng: np.random.Generator, q_heads: int, kv_heads: int) -> None:
    tokens, dim, capacity = 300, 32, 320
    q, k, v = randn(rng, tokens, q_heads, dim), randn(rng, tokens, kv_heads, dim), randn(rng, tokens, kv_heads, dim)
    scale = dim**-0.5
    ref = F.scaled_dot_product_attention(
        t(q).transpose(0, 1), t(k).transpose(0, 1), t(v).transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True
    ).transpose(0, 1)
    k_cache, v_cache = be.zeros((capacity, kv_heads, dim), "bf16"), be.zeros((capacity, kv_heads, dim), "bf16")
    cache = KVCache(k_cache, v_cache)
    split = 290
    for lo, hi in ((0, 100), (100, split)):  # a prefill continued from a filled cache
        chunk = be.attention(q[lo:hi], k[lo:hi], v[lo:hi], cache, np.arange(lo, hi, dtype=np.int32), scale)
        close(chunk, ref[lo:hi], 1e-5)
    for pos in range(split, tokens):
        step = be.attention(q[pos : pos + 1], k[pos : pos + 1], v[pos : pos + 1], cache, np.array([pos], np.int32), scale)
        close(step, ref[pos : pos + 1], 1e-5)
    close(k_cache[:tokens], k)
    assert not v_cache[tokens:].any()


def test_causal_conv1d_matches_transformers_fn_and_update(rng: np.random.Generator) -> None:
    channels, width, tokens = 24, 4, 11
    x, w = randn(rng, tokens + 3, channels), randn(rng, channels, width)
    ref = hf.causal_conv1d_fn(t(x).T[None], t(w), None, activation="silu")[0].T  # [T, C]
    state = be.zeros((channels, width - 1), "f32")
    close(be.causal_conv1d(x[:tokens], w, state), ref[:tokens])
    close(state, x[tokens - width + 1 : tokens].T)
    hf_state = t(state.copy())[None]
    for i in range(tokens, tokens + 3):
        ours = be.causal_conv1d(x[i : i + 1], w, state)
        step = hf.causal_conv1d_update(t(x[i : i + 1]).T[None].contiguous(), hf_state, t(w), None, "silu")[0].T
        close(ours, step)
        close(ours, ref[i : i + 1])
    close(state, hf_state[0])


def delta_inputs(rng: np.random.Generator, tokens: int, hk: int, hv: int, dk: int, dv: int) -> dict[str, np.ndarray]:
    return {
        "mixed_qkv": randn(rng, tokens, 2 * hk * dk + hv * dv),
        "a": randn(rng, tokens, hv),
        "b": randn(rng, tokens, hv),
        "A_log": np.log(rng.uniform(0.01, 16, hv)).astype(np.float32),
        "dt_bias": randn(rng, hv, scale=0.5),
    }


def delta_rule(inputs: dict[str, np.ndarray], state: np.ndarray, hk: int, rows: slice = slice(None)) -> np.ndarray:
    """The reference gated delta rule on `delta_inputs` (tokens `rows`), updating `state`."""
    layer = delta_rule_operands(inputs["A_log"], inputs["dt_bias"], state, hk)
    return be.gated_delta_rule(inputs["mixed_qkv"][rows], inputs["a"][rows], inputs["b"][rows], layer)


def hf_delta(inputs: dict[str, np.ndarray], hk: int, dk: int, state: np.ndarray, chunked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    mixed = t(inputs["mixed_qkv"])
    tokens, hv = inputs["a"].shape
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, mixed.shape[1] - 2 * hk * dk], dim=-1)
    g = -t(inputs["A_log"]).exp() * F.softplus(t(inputs["a"]) + t(inputs["dt_bias"]))
    fn = hf.torch_chunk_gated_delta_rule if chunked else hf.torch_recurrent_gated_delta_rule
    out, final = fn(
        q.reshape(1, tokens, hk, dk), k.reshape(1, tokens, hk, dk), v.reshape(1, tokens, hv, -1),
        g=g[None], beta=torch.sigmoid(t(inputs["b"]))[None], initial_state=t(state.copy())[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    return out[0], final[0]


@pytest.mark.parametrize("tokens,hk,hv", [(1, 2, 2), (1, 2, 4), (5, 2, 4), (70, 2, 4), (150, 1, 3), (64, 2, 2)])
def test_gated_delta_rule_matches_transformers(rng: np.random.Generator, tokens: int, hk: int, hv: int) -> None:
    dk, dv = 16, 8
    inputs = delta_inputs(rng, tokens, hk, hv, dk, dv)
    initial = randn(rng, hv, dk, dv, scale=0.5)
    state = initial.copy()
    ours = delta_rule(inputs, state, hk)
    for chunked in (False, True):
        ref, final = hf_delta(inputs, hk, dk, initial, chunked)
        close(ours, ref, 2e-4)
        close(state, final, 2e-4)


def test_chunked_prefill_equals_token_by_token(rng: np.random.Generator) -> None:
    tokens, hk, hv, dk, dv = 130, 2, 4, 16, 16
    inputs = delta_inputs(rng, tokens, hk, hv, dk, dv)
    chunked_state = be.zeros((hv, dk, dv), "f32")
    chunked = delta_rule(inputs, chunked_state, hk)
    step_state = be.zeros((hv, dk, dv), "f32")
    steps = [delta_rule(inputs, step_state, hk, slice(i, i + 1)) for i in range(tokens)]
    close(chunked, np.concatenate(steps), 2e-4)
    close(chunked_state, step_state, 2e-4)


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_matches_transformers(rng: np.random.Generator, renormalize: bool) -> None:
    experts, top_k, hidden = 16, 4, 32
    x, w = randn(rng, 9, hidden), randn(rng, experts, hidden)
    ids, weights = be.router(x, w, top_k, renormalize)
    assert ids.dtype == np.int32 and ids.shape == (9, top_k)
    probs = torch.softmax(F.linear(t(x), t(w)), dim=-1)
    ref_weights, ref_ids = torch.topk(probs, top_k, dim=-1)
    np.testing.assert_array_equal(ids, ref_ids.numpy())
    if renormalize:
        config = hf.Qwen3_5MoeTextConfig(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k)
        router = hf.Qwen3_5MoeTopKRouter(config)
        router.weight.data = t(w)
        _, ref_weights, _ = router(t(x))
    close(weights, ref_weights)


def test_moe_experts_match_transformers(rng: np.random.Generator) -> None:
    experts, top_k, hidden, inter, tokens = 8, 3, 32, 16, 10
    config = hf.Qwen3_5MoeTextConfig(hidden_size=hidden, num_experts=experts, moe_intermediate_size=inter)
    module = hf.Qwen3_5MoeExperts(config)
    gate_up, down = randn(rng, experts, 2 * inter, hidden, scale=0.2), randn(rng, experts, hidden, inter, scale=0.2)
    module.gate_up_proj.data, module.down_proj.data = t(gate_up), t(down)
    x = randn(rng, tokens, hidden)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = rng.uniform(0, 1, (tokens, top_k)).astype(np.float32)
    ref = module(t(x), t(ids).long(), t(weights))
    close(be.moe_experts(x, ids, weights, gate_up, down), ref, 1e-4)


def test_moe_empty_slots_add_nothing(rng: np.random.Generator) -> None:
    """id -1 (the CUDA router's slot for a NaN token) is skipped, not read as expert E - 1."""
    experts, top_k, hidden, inter, tokens = 6, 2, 16, 8, 5
    gate_up, down = randn(rng, experts, 2 * inter, hidden, scale=0.2), randn(rng, experts, hidden, inter, scale=0.2)
    x = randn(rng, tokens, hidden)
    ids = np.stack([rng.choice(experts - 1, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1, (tokens, top_k)).astype(np.float32)
    emptied = ids.copy()
    emptied[:, -1] = -1
    kept = be.moe_experts(x, ids[:, :-1], weights[:, :-1], gate_up, down)
    close(be.moe_experts(x, emptied, weights, gate_up, down), kept, 1e-6)


def test_argmax_lowest_index_on_ties(rng: np.random.Generator) -> None:
    logits = randn(rng, 4, 30)
    logits[2, [5, 17]] = logits.max() + 1.0
    out = be.argmax(logits)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, torch.argmax(t(logits), dim=-1).numpy())
    assert out[2] == 5


def test_argmax_reads_nan_as_minus_infinity(rng: np.random.Generator) -> None:
    """As the device's argmax does: NaN never wins, an all-NaN row gives NO_TOKEN."""
    logits = randn(rng, 3, 40)
    logits[0, rng.integers(0, 40, size=5)] = np.nan
    logits[1, :] = np.nan
    logits[2, 7] = np.nan
    out = be.argmax(logits)
    np.testing.assert_array_equal(out, [np.nanargmax(logits[0]), NO_TOKEN, np.nanargmax(logits[2])])


def sort_based_choice(logits: np.ndarray, params: SamplingParams, uniform: float) -> int:
    """An independent sort-based reading of the sample contract."""
    probs = torch.softmax(t(logits).double() / params.temperature, dim=-1).numpy()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(probs.shape, dtype=bool)
    k = params.top_k if params.top_k > 0 else probs.shape[0]
    keep[probs >= probs[order[k - 1]]] = True
    kept_sorted = np.sort(probs[keep])[::-1]
    mass = np.cumsum(kept_sorted)
    for value, reached in zip(kept_sorted, mass):
        if reached >= params.top_p * mass[-1] * (1 - 1e-9):
            keep &= probs >= value
            break
    cumulative = np.cumsum(np.where(keep, probs, 0.0))
    return int(np.argmax(cumulative > uniform * cumulative[-1]))


@pytest.mark.parametrize("params", [SamplingParams(0.7, 0, 1.0), SamplingParams(1.0, 5, 1.0), SamplingParams(1.3, 0, 0.6), SamplingParams(0.9, 8, 0.8)])
def test_sample_matches_sort_based_reading(rng: np.random.Generator, params: SamplingParams) -> None:
    logits = randn(rng, 1, 200, scale=2.0)
    for uniform in rng.uniform(0, 1, 200):
        token = be.sample(logits, params, float(uniform))
        assert token.dtype == np.int32 and token.shape == (1,)
        assert token[0] == sort_based_choice(logits[0], params, float(uniform))


def test_sample_top_k_one_is_argmax(rng: np.random.Generator) -> None:
    logits = randn(rng, 1, 100)
    for uniform in rng.uniform(0, 1, 20):
        assert be.sample(logits, SamplingParams(1.0, 1, 1.0), float(uniform))[0] == np.argmax(logits[0])


@pytest.mark.parametrize("temperature", [1e-30, 1e-38, 1e-45, 1e-60])
def test_sample_tiny_temperature_is_greedy(rng: np.random.Generator, temperature: float) -> None:
    """logits / T overflows for T this small: the softmax must still be finite (the max gets it all)."""
    from atlas.sampling import softmax_probs

    logits = randn(rng, 1, 300, scale=5.0)
    probs = softmax_probs(logits[0], temperature)
    assert np.all(np.isfinite(probs)) and probs[np.argmax(logits[0])] == 1.0
    for uniform in rng.uniform(0, 1, 20):
        for top_k, top_p in [(0, 1.0), (7, 1.0), (0, 0.5), (3, 0.9)]:
            token = be.sample(logits, SamplingParams(temperature, top_k, top_p), float(uniform))
            assert token[0] == np.argmax(logits[0]), (top_k, top_p, uniform)


def test_sample_nan_and_infinite_logits(rng: np.random.Generator) -> None:
    """NaN logits are never drawn, +inf logits share all the mass, an all -inf row stays in range."""
    from atlas.sampling import softmax_probs

    logits = randn(rng, 1, 64)
    nan_at = rng.choice(64, size=5, replace=False)
    logits[0, nan_at] = np.nan
    inf_at = np.sort(rng.choice(np.setdiff1d(np.arange(64), nan_at), size=2, replace=False))
    for uniform in rng.uniform(0, 1, 50):
        token = int(be.sample(logits, SamplingParams(0.8, 0, 0.95), float(uniform))[0])
        assert token not in nan_at
    logits[0, inf_at] = np.inf
    probs = softmax_probs(logits[0], 1.0)
    np.testing.assert_array_equal(probs[inf_at], [0.5, 0.5])
    for uniform in rng.uniform(0, 1, 20):
        assert int(be.sample(logits, SamplingParams(1.0, 0, 1.0), float(uniform))[0]) in inf_at
    dead = np.full((1, 64), -np.inf, dtype=np.float32)
    dead[0, nan_at] = np.nan
    assert np.all(np.isfinite(softmax_probs(dead[0], 0.5)))
    assert 0 <= int(be.sample(dead, SamplingParams(0.5, 4, 0.5), float(rng.random()))[0]) < 64


def test_sample_extreme_top_p_and_temperature(rng: np.random.Generator) -> None:
    """top_p that rounds to 0 in float32 keeps the most likely token; a temperature past float32's
    range is uniform, never NaN."""
    logits = randn(rng, 1, 50, scale=3.0)
    for uniform in rng.uniform(0, 1, 20):
        assert be.sample(logits, SamplingParams(1.0, 0, 1e-50), float(uniform))[0] == np.argmax(logits[0])
    draws = {int(be.sample(logits, SamplingParams(1e300, 0, 1.0), float(u))[0]) for u in rng.uniform(0, 1, 400)}
    assert len(draws) > 40
    masked = rng.choice(50, size=10, replace=False)  # structured output's and min_tokens' -inf logits
    logits[0, masked] = -np.inf
    draws = {int(be.sample(logits, SamplingParams(1e300, 0, 1.0), float(u))[0]) for u in rng.uniform(0, 1, 400)}
    assert not draws & set(masked.tolist()) and len(draws) > 30
    lse = be.logprob_rows(logits, np.zeros(1, np.int32), 5, 1e300).lse  # structured output's summary at T
    assert np.all(np.isfinite(lse[:, 0])), lse


def test_ops_leave_their_inputs_unchanged(rng: np.random.Generator) -> None:
    x, res, w = randn(rng, 6, 16), randn(rng, 6, 16), randn(rng, 16)
    heads = randn(rng, 6, 2, 16)
    inputs = delta_inputs(rng, 70, 1, 2, 8, 8)
    arrays = [x, res, w, heads, *inputs.values()]
    before = [a.copy() for a in arrays]
    be.rms_norm(x, w, 1e-6)
    be.add_rms_norm(x, res, w, 1e-6)
    be.silu_mul(x)
    be.sigmoid_mul(x, res)
    be.head_norm_rope(heads, w, np.arange(6, dtype=np.int32), default_inv_freq(8, 1e4), 1.0, 1e-6)
    be.gated_rms_norm(heads, heads, w, 1e-6)
    delta_rule(inputs, be.zeros((2, 8, 8), "f32"), 1)
    be.router(x, randn(rng, 4, 16), 2, True)
    for array, copy in zip(arrays, before):
        np.testing.assert_array_equal(array, copy)
