"""The GPU router tests' rule for the routing weights (test_gpu_ops.check_router_weights), checked on
the CPU with the numpy backend standing in for the CUDA one (test_gpu_harness.StandInBackend: f32
activations, weights rounded to bf16 as uploaded: the router kernel's own inputs).

The rule's ref16 rounded x to bf16 as well, which the router kernel never does. With few values
compared (T = 1: one token's k weights, the shared slot's single sigmoid) that ref16 landed nearer
ref32 than the exact stand-in in ~10 % of draws, so the device runs of test_router and
test_router_shared_slot failed about one session in three with no kernel bug. test_router's
"same experts up to near-ties" check compared probabilities of that bf16-x reference too (~2.5 % of
Qwen3.6 T = 17 draws failed). Each draw here runs the whole GPU test functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import test_gpu_moe_shared
import test_gpu_ops
from atlas.targets import load_registry
from test_gpu_harness import StandInBackend

DRAWS = 40  # the former rule failed ~1 in 10 at T = 1: 40 clean draws per case rule it out
MODELS = ("atlas-demo", "qwen3.6-35b-a3b")


def stand_in_env(model: str, scale: np.float32 = np.float32(1)) -> test_gpu_ops.Env:
    return test_gpu_ops.Env(model, StandInBackend(scale), dict(load_registry().models[model].constants))


@pytest.mark.parametrize("model", MODELS)
def test_exact_stand_in_passes_the_router_tests_every_draw(model: str, rng: np.random.Generator) -> None:
    env = stand_in_env(model)
    for _ in range(DRAWS):
        test_gpu_ops.test_router(env, rng, 1, True)
        test_gpu_ops.test_router(env, rng, 17, False)
        test_gpu_moe_shared.test_router_shared_slot(env, rng, 1, True)
        test_gpu_moe_shared.test_router_shared_slot(env, rng, 9, False)


@dataclass(frozen=True)
class Routed:
    """A router result as the device returns it, from the exact stand-in."""

    case: test_gpu_ops.RouterCase
    ids: np.ndarray  # [T, k (+ 1)] i32
    weights: np.ndarray  # [T, k (+ 1)] f32


def routed(rng: np.random.Generator, model: str, tokens: int, shared: bool) -> Routed:
    """Drawn again until some token has the same ids in the stand-in and both references: the
    rule checks only such tokens' routed weights (a near-tie reorders the others), so with none a
    wrong weight would pass unseen (Qwen3.6's 256 experts reorder all 3 tokens in ~1 % of draws)."""
    d = load_registry().models[model].constants
    e, k, h = int(d["num_experts"]), int(d["num_experts_per_tok"]), int(d["hidden_size"])
    for _ in range(DRAWS):
        x, w = test_gpu_ops.normal(rng, tokens, h), test_gpu_ops.weight(rng, e + int(shared), h) * 4
        case = test_gpu_ops.RouterCase(x, w, k, True, shared_expert=shared)
        ids, weights = StandInBackend().router(x, test_gpu_ops.bf16_round(w), k, True, shared_expert=shared)
        ids16, ids32 = case.reference(test_gpu_ops.bf16_round(w))[0], case.reference(w)[0]
        if ((ids == ids16).all(-1) & (ids16 == ids32).all(-1)).any():
            return Routed(case, ids, weights)
    pytest.fail(f"no draw in {DRAWS} kept a token's experts in order in both references")


@pytest.mark.parametrize("model", MODELS)
def test_rule_rejects_wrong_weights(model: str, rng: np.random.Generator) -> None:
    for shared in (False, True):
        r = routed(rng, model, 3, shared)
        test_gpu_ops.check_router_weights(model, r.case, r.ids, r.weights)
        k = r.case.top_k
        off = r.weights.copy()
        off[:, 0] *= np.float32(1.05)  # the top weight 5 % off (2 % sat ~1.6x the bound: rarely inside it)
        with pytest.raises(AssertionError, match="routed weights"):
            test_gpu_ops.check_router_weights(model, r.case, r.ids, off)
        unnormalised = r.weights.copy()
        unnormalised[:, :k] *= np.float32(0.9)
        with pytest.raises(AssertionError, match="routed weights"):
            test_gpu_ops.check_router_weights(model, r.case, r.ids, unnormalised)
        if shared:
            raw = r.weights.copy()
            raw[:, k] = r.case.x @ test_gpu_ops.bf16_round(r.case.w[-1])  # the logit, not its sigmoid
            with pytest.raises(AssertionError, match="shared slot weight"):
                test_gpu_ops.check_router_weights(model, r.case, r.ids, raw)


def test_stand_in_off_by_five_percent_fails_the_router_tests(rng: np.random.Generator) -> None:
    env = stand_in_env("atlas-demo", np.float32(1.05))
    with pytest.raises(AssertionError, match="weights"):
        test_gpu_ops.test_router(env, rng, 17, True)
    with pytest.raises(AssertionError, match="weight"):
        test_gpu_moe_shared.test_router_shared_slot(env, rng, 9, False)
