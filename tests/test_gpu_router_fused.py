"""The fused decode router on the GPU (issue 4, ATLAS_ROUTER=fused): atlas_router_fused equal bit
for bit to the two launches (atlas_router_logits + atlas_router_top_k) and close to the numpy
reference, with and without the shared slot and renormalisation, at the demo and Qwen3.6 dims;
then replayed inside a captured graph with fresh inputs, several routers per graph sharing the
one counter buffer (each launch must leave it at zero for the next). Outputs poisoned first."""

from __future__ import annotations

import numpy as np
import pytest

from test_gpu_ops import BF16_FLOOR, Env, bf16_round, check_bound, env, normal, weight  # noqa: F401 - env is a fixture

pytestmark = pytest.mark.gpu

REPLAYS = 6
ROUTERS_PER_GRAPH = 3


def _backends(env: Env) -> tuple[object, object]:
    """Split and fused backends on the test's runtime (whatever ATLAS_ROUTER says)."""
    from atlas.backends.cuda.backend import CudaBackend

    return CudaBackend(env.gpu.rt, use_graphs=False, router="split"), CudaBackend(env.gpu.rt, use_graphs=False, router="fused")


def _route_on(backend: object, env: Env, args: tuple, shared: bool) -> tuple[np.ndarray, np.ndarray]:
    rt = env.gpu.rt
    rt.reset_step()
    rt.poison_scratch()
    ids, weights = backend.router(*args, shared_expert=shared)  # type: ignore[attr-defined]
    return backend.to_numpy(ids), backend.to_numpy(weights)  # type: ignore[attr-defined]


def _check_reference(env: Env, x: np.ndarray, w: np.ndarray, got: tuple[np.ndarray, np.ndarray], renormalize: bool,
                     shared: bool) -> None:
    """Against numpy on what the kernels read (x f32, the weight rounded to bf16): the picked
    experts' probabilities match (near-ties may swap), ids and weights match on >= 90 % of the
    tokens; and within test_gpu_ops' bound of the all-f32 reference."""
    ids, weights = got
    e, top_k = env.d("num_experts"), env.d("num_experts_per_tok")
    assert ids.shape == weights.shape == (x.shape[0], top_k + shared)
    assert ((ids[:, :top_k] >= 0) & (ids[:, :top_k] < e)).all() and np.isfinite(weights).all()
    if shared:
        assert (ids[:, top_k] == e).all()
    logits = x.astype(np.float64) @ bf16_round(w[:e]).astype(np.float64).T  # [T, E]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids_w, ref_w = env.ref.router(x, bf16_round(w), top_k, renormalize, shared_expert=shared)
    chosen = np.take_along_axis(probs, ids[:, :top_k], -1)
    np.testing.assert_allclose(chosen, np.take_along_axis(probs, ids_w[:, :top_k], -1), rtol=1e-4, atol=1e-7)
    same = (ids == ids_w).all(-1)
    assert same.mean() >= 0.9, f"ids differ from the reference on {(~same).sum()} of {len(same)} tokens"
    np.testing.assert_allclose(weights[same], ref_w[same], rtol=1e-4, atol=1e-7)
    ids32, ref32_w = env.ref.router(x, w, top_k, renormalize, shared_expert=shared)
    keep = same & (ids_w == ids32).all(-1)
    check_bound(f"{env.model} fused router weights", weights[keep], ref32_w[keep], ref_w[keep], BF16_FLOOR)


@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_router_equals_the_two_launches(env: Env, rng: np.random.Generator, tokens: int, shared: bool,
                                              renormalize: bool) -> None:
    e, top_k, h = env.d("num_experts"), env.d("num_experts_per_tok"), env.d("hidden_size")
    x, w = normal(rng, tokens, h), weight(rng, e + int(shared), h) * 4  # [T, H], [E (+ 1), H]
    split, fused = _backends(env)
    args = (env.gpu.upload(x, "f32"), env.gpu.upload(w, "bf16"), top_k, renormalize)
    want = _route_on(split, env, args, shared)
    got = _route_on(fused, env, args, shared)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1].view(np.uint32), want[1].view(np.uint32))  # bit for bit
    _check_reference(env, x, w, got, renormalize, shared)
    assert not fused.to_numpy(fused._router_arrivals).any(), "arrival counters not reset"


@pytest.mark.parametrize("shared", [False, True])
def test_fused_router_replays_in_a_captured_graph(env: Env, rng: np.random.Generator, shared: bool) -> None:
    from atlas.backends.cuda.graph import GraphedDecodeStep

    rt = env.gpu.rt
    if not rt.driver.graphs:
        pytest.skip(f"{rt.driver.binding} cannot capture CUDA graphs")
    e, top_k, h = env.d("num_experts"), env.d("num_experts_per_tok"), env.d("hidden_size")
    split, fused = _backends(env)
    x_dev = rt.persistent((1, h), "f32")  # [1, H], rewritten before each replay
    routers = [weight(rng, e + int(shared), h) * 4 for _ in range(ROUTERS_PER_GRAPH)]
    routers_dev = [fused.upload(w, "bf16") for w in routers]
    step = GraphedDecodeStep(rt, lambda ids, positions: [
        fused.router(x_dev, w, top_k, True, shared_expert=shared) for w in routers_dev
    ])
    for replay in range(REPLAYS):
        x = normal(rng, 1, h)
        rt.write(x_dev, x)
        rt.poison_scratch()  # the graph's outputs live in the arena
        outputs = step(np.zeros(1, np.int32), np.full(1, replay, np.int32))
        got = [(fused.to_numpy(ids), fused.to_numpy(weights)) for ids, weights in outputs]
        for (ids, weights), w_host, w_dev in zip(got, routers, routers_dev):
            want_ids, want_weights = _route_on(split, env, (x_dev, w_dev, top_k, True), shared)
            assert (ids == want_ids).all(), f"replay {replay}: ids {ids} != {want_ids}"
            np.testing.assert_array_equal(weights.view(np.uint32), want_weights.view(np.uint32))
            _check_reference(env, x, w_host, (ids, weights), True, shared)
        assert not fused.to_numpy(fused._router_arrivals).any(), f"replay {replay}: arrival counters not reset"
    assert step.captures == 1, "the graph was captured again (arena moved): replays untested"
