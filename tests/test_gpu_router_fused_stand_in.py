"""test_gpu_router_fused's own logic on the CPU: the split and the fused router replaced by a router
computed exactly (float64 logits and softmax on the kernel's inputs, f32 x and bf16 weights, rounded
to f32 at the end: another summation order than the numpy reference's f32). It must pass
test_fused_router_equals_the_two_launches in every draw; one whose weights are 2 % off must fail it.
The graph replay test needs a capturing driver (it skips without one) and checks the same
_check_reference."""

from __future__ import annotations

import numpy as np
import pytest

import test_gpu_router_fused
from atlas.targets import load_registry
from test_gpu_harness import StandInBackend
from test_gpu_ops import Env

DRAWS = 10


class ExactRouter(StandInBackend):
    """Routes in float64; `_router_arrivals` is the fused kernel's counter buffer, left at zero."""

    def __init__(self, scale: np.float32 = np.float32(1)) -> None:
        super().__init__(scale)
        self._router_arrivals = np.zeros(4, np.int32)

    def router(self, x, weight, top_k, renormalize, *, shared_expert=False):  # type: ignore[no-untyped-def]
        experts = weight.shape[0] - int(shared_expert)
        w64, x64 = np.asarray(weight, np.float64), np.asarray(x, np.float64)  # [E (+ 1), H], [T, H]
        logits = x64 @ w64[:experts].T  # [T, E]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k].astype(np.int32)  # [T, k]
        weights = np.take_along_axis(probs, ids, -1)
        if renormalize:
            weights /= weights.sum(-1, keepdims=True)
        if shared_expert:
            ids = np.concatenate([ids, np.full((x.shape[0], 1), experts, np.int32)], axis=-1)
            weights = np.concatenate([weights, 1 / (1 + np.exp(-(x64 @ w64[experts:].T)))], axis=-1)
        return ids, weights.astype(np.float32)


def _env(model: str, monkeypatch: pytest.MonkeyPatch, scale: np.float32 = np.float32(1)) -> Env:
    monkeypatch.setattr(test_gpu_router_fused, "_backends", lambda env: (ExactRouter(scale), ExactRouter(scale)))
    return Env(model, StandInBackend(), dict(load_registry().models[model].constants))


@pytest.mark.parametrize("model", ["atlas-demo", pytest.param("qwen3.6-35b-a3b", marks=pytest.mark.slow)])
def test_exact_router_passes_every_draw(model: str, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _env(model, monkeypatch)
    for _ in range(DRAWS):
        for tokens in (1, 3, 8):
            for shared in (False, True):
                for renormalize in (True, False):
                    test_gpu_router_fused.test_fused_router_equals_the_two_launches(env, rng, tokens, shared, renormalize)


def test_router_two_percent_off_fails(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _env("atlas-demo", monkeypatch, np.float32(1.02))
    for shared in (False, True):
        with pytest.raises(AssertionError, match="Not equal to tolerance"):
            test_gpu_router_fused.test_fused_router_equals_the_two_launches(env, rng, 3, shared, True)
