"""The shared expert as routed slot k on the GPU (issue 4): the router's shared slot and the MoE
over k + 1 slots of E + 1 stacked experts (decode GEMVs: the k + 1 down entry; prefill: the
grouped GEMMs over E + 1 experts), against the numpy reference with test_gpu_ops' bound."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from test_gpu_ops import (  # noqa: F401 - env is a fixture
    BF16_FLOOR,
    EXPERT_POOL,
    Env,
    ExpertPool,
    In,
    RouterCase,
    _gpu_args,
    bf16_round,
    check_router_weights,
    env,
    normal,
    run_op,
    weight,
)

pytestmark = pytest.mark.gpu


class StackedPool(ExpertPool):
    """E pooled experts (as ExpertPool) and one more, the shared expert, as expert E."""

    def __init__(self, pool: np.ndarray, experts: int, shared: np.ndarray) -> None:
        super().__init__(pool, experts)
        self.shared = shared
        self.shape = (experts + 1, *pool.shape[1:])

    def __getitem__(self, expert: Any) -> np.ndarray:
        return self.shared if int(expert) == self.experts else super().__getitem__(expert)

    def rounded(self) -> StackedPool:
        return StackedPool(bf16_round(self.pool), self.experts, bf16_round(self.shared))

    def upload(self, gpu: Any) -> Any:
        routed = ExpertPool(self.pool, self.experts).upload(gpu)  # [E, ...]
        out = gpu.rt.persistent(self.shape, "bf16")  # [E + 1, ...]
        gpu.rt.copy(out.rows(0, self.experts), routed)
        gpu.rt.copy(out.rows(self.experts, self.experts + 1), gpu.upload(self.shared[None], "bf16"))
        return out


def routed_ids_agree(ids: np.ndarray, x: np.ndarray, w: np.ndarray, top_k: int, renormalize: bool) -> np.ndarray:
    """Per token: the router's ids [T, k + 1] equal, in slot order, those of the reference on bf16 x
    and w, on f32 x and w, or on f32 x with bf16 w (the kernel's own arithmetic: without it a
    near-tie among E = 256 logits fails about one draw of 9 tokens in four, test_router_ids_rule.py)."""
    return np.logical_or.reduce([(ids == r).all(-1) for r in reference_ids(x, w, top_k, renormalize)])


def reference_ids(x: np.ndarray, w: np.ndarray, top_k: int, renormalize: bool) -> list[np.ndarray]:
    """The router's ids [T, k + 1] on the numpy backend at the three roundings routed_ids_agree accepts."""
    from atlas.backends.numpy_backend import NumpyBackend

    ref = NumpyBackend()
    return [ref.router(a, b, top_k, renormalize, shared_expert=True)[0]
            for a, b in ((bf16_round(x), bf16_round(w)), (x, w), (x, bf16_round(w)))]


@pytest.mark.parametrize("tokens,renormalize", [(1, True), (17, True), (9, False)])
def test_router_shared_slot(env: Env, rng: np.random.Generator, tokens: int, renormalize: bool) -> None:
    e, top_k, h = env.d("num_experts"), env.d("num_experts_per_tok"), env.d("hidden_size")
    x, w = normal(rng, tokens, h), weight(rng, e + 1, h) * 4  # [T, H], [E + 1, H]: row E the shared gate
    gpu_args = _gpu_args(env, [In(x, "f32"), In(w, "bf16"), top_k, renormalize])
    env.gpu.rt.reset_step()
    env.gpu.rt.poison_scratch()
    ids_dev, weights_dev = env.gpu.router(*gpu_args, shared_expert=True)
    ids, weights = env.gpu.to_numpy(ids_dev), env.gpu.to_numpy(weights_dev)
    assert ids.shape == weights.shape == (tokens, top_k + 1)
    assert (ids[:, top_k] == e).all() and ((ids[:, :top_k] >= 0) & (ids[:, :top_k] < e)).all()
    assert np.isfinite(weights).all()
    same = routed_ids_agree(ids, x, w, top_k, renormalize)
    assert same.mean() >= 0.9, f"routed ids differ from every reference on {(~same).sum()} tokens"
    check_router_weights(env.model, RouterCase(x, w, top_k, renormalize, shared_expert=True), ids, weights)


@pytest.mark.parametrize("tokens", [1, 3, 8, 70])
def test_moe_experts_with_the_shared_slot(env: Env, rng: np.random.Generator, tokens: int) -> None:
    e, top_k, h = env.d("num_experts"), env.d("num_experts_per_tok"), env.d("hidden_size")
    inter = env.d("moe_intermediate_size")
    pool = min(e, EXPERT_POOL)
    gate_up = StackedPool(normal(rng, pool, 2 * inter, h, scale=1 / math.sqrt(h)), e,
                          normal(rng, 2 * inter, h, scale=1 / math.sqrt(h)))
    down = StackedPool(normal(rng, pool, h, inter, scale=1 / math.sqrt(inter)), e,
                       normal(rng, h, inter, scale=1 / math.sqrt(inter)))
    ids = np.stack([np.append(rng.permutation(e)[:top_k], e) for _ in range(tokens)]).astype(np.int32)  # [T, k + 1]
    routing = rng.uniform(0.1, 1.0, size=(tokens, top_k + 1)).astype(np.float32)
    routing[:, :top_k] /= routing[:, :top_k].sum(-1, keepdims=True)
    run_op(env, "moe_experts",
           [In(normal(rng, tokens, h), "f32", rounds=True), In(ids, "i32"), In(routing, "f32"),
            In(gate_up), In(down)], BF16_FLOOR)
