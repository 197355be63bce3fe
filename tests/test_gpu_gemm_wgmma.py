"""The h200 wgmma GEMM (ATLAS_GEMM=wgmma, gemm_wgmma.cuh) against numpy at the demo and the
Qwen3.6 projection shapes, T in {5, 64, 200, 1000} (the kernel launched directly, so T = 5 runs it
too; linear() sends it T > 8 only).

Bound as tests/test_gpu_ops.py: err(gpu vs fp32 ref) <= 2 * err(bf16 ref vs fp32 ref) + floor, the
bf16 ref on x and W rounded to bf16. Step scratch is poisoned with NaN first, and the output buffer
has one row more than the kernel is told about, which must stay NaN (the epilogue's bounds check).
Skips on a GPU that is not compute capability 9.0 (the kernel exists in the h200 tuple only).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from test_gpu_ops import BF16_FLOOR, MODELS, Env, _linear_shapes, bf16_round, check_bound, normal, open_gpu_backend, weight

pytestmark = pytest.mark.gpu

TOKENS = (5, 64, 200, 1000)
RAGGED = (389, 1000)  # (N, K): odd N (scalar stores), K % 64 == 40 (a partial last k-step)


@pytest.fixture(scope="module", params=MODELS)
def env(request: pytest.FixtureRequest) -> Env:
    from atlas.backends.cuda import ops_dense
    from atlas.targets import load_registry

    backend = open_gpu_backend(request.param)
    if tuple(backend.rt.info.cc) != ops_dense.WGMMA_CC:
        pytest.skip(f"atlas_gemm_wgmma is built for compute capability 9.0 only; this GPU is {backend.rt.info.cc}")
    return Env(request.param, backend, dict(load_registry().models[request.param].constants))


def _gemm_wgmma(gpu: Any, x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(out [T, N], the guard row past it), through ops_dense.gemm(..., "wgmma")."""
    from atlas.backends.cuda import ops_dense
    from atlas.kernel_params import dense as kp

    (t, k), n = x.shape, w.shape[0]
    dx, dw = gpu.upload(x, "f32"), gpu.upload(w, "bf16")
    rt = gpu.rt
    rt.reset_step()
    rt.poison_scratch()
    out = rt.empty((t + 1, n), "f32")  # [T + 1, N]: row T is a guard
    rt.driver.memset_d8(out.ptr, 0xFF, out.nbytes, rt.stream)  # NaN even where the arena grew past the poison
    ops_dense.gemm(rt, kp.LinearParams(x=dx.ptr, weight=dw.ptr, out=out.ptr, tokens=t, n=n, k=k), "wgmma")
    full = gpu.to_numpy(out)
    return full[:t], full[t]


@pytest.mark.parametrize("tokens", TOKENS)
def test_wgmma_gemm_matches_numpy(env: Env, rng: np.random.Generator, tokens: int) -> None:
    for n, k in (*_linear_shapes(env), RAGGED):
        if n * tokens < 16:
            continue  # a handful of outputs make the norm-wise error bound a coin toss
        x, w = normal(rng, tokens, k), weight(rng, n, k)
        out, guard = _gemm_wgmma(env.gpu, x, w)
        ref32 = x.astype(np.float64) @ w.astype(np.float64).T
        ref16 = bf16_round(x).astype(np.float64) @ bf16_round(w).astype(np.float64).T
        check_bound(f"{env.model} wgmma T={tokens} N={n} K={k}", out, ref32, ref16, BF16_FLOOR)
        assert np.isnan(guard).all(), f"{env.model} wgmma T={tokens} N={n} K={k}: wrote past row T"


def test_linear_dispatches_to_wgmma_and_agrees_with_mma(env: Env, rng: np.random.Generator) -> None:
    from atlas.backends.cuda import ops_dense

    rt = env.gpu.rt
    k, n = env.d("hidden_size"), env.d("num_attention_heads") * env.d("head_dim")
    x, w = normal(rng, 200, k), weight(rng, n, k)
    dx, dw = env.gpu.upload(x, "f32"), env.gpu.upload(w, "bf16")
    outs = {}
    for form in ops_dense.GEMM_FORMS:
        rt.reset_step()
        rt.poison_scratch()
        outs[form] = env.gpu.to_numpy(ops_dense.linear(rt, dx, dw, gemm_with=form))
    assert np.isfinite(outs["wgmma"]).all()
    # the same bf16 products summed in f32 in another order: far closer than the bf16 rounding bound
    scale = float(np.abs(outs["mma"]).max())
    np.testing.assert_allclose(outs["wgmma"], outs["mma"], rtol=0, atol=1e-4 * scale)
