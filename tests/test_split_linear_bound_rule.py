"""test_gpu_split_linear's references, checked on the CPU: a bf16 decode GEMV computed exactly as
the kernel does (f32 x, bf16 weights; sums in float64 here) must pass the bound on every part, and
one 2 % off must fail it.

The former ref16 rounded x to bf16 for the GEMVs too, which they never do; on the demo's 4-wide
DeltaNet b and a parts at T = 1 that ref16 landed nearer ref32 than the exact kernel in ~0.7 % of
draws per part, a device failure with no kernel bug.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from atlas.backends.cuda.ops_dense import GEMV_MAX_TOKENS
from atlas.targets import load_registry
from test_gpu_ops import bf16_round, check_bound, normal
from test_gpu_split_linear import FLOOR, projection_widths, references

DRAWS = 1500  # the former rule failed ~1.4 % of these draws (two 4-wide parts): ~20 expected failures


def exact_gemv_parts(x: np.ndarray, weight: np.ndarray, widths: tuple[int, ...]) -> list[np.ndarray]:
    out = x.astype(np.float64) @ bf16_round(weight).astype(np.float64).T  # [T, N]
    bounds = np.cumsum([0, *widths])
    return [out[:, a:b].astype(np.float32) for a, b in zip(bounds, bounds[1:])]


def demo_decode_case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    dims = {name: int(v) for name, v in load_registry().models["atlas-demo"].constants.items()}
    widths = projection_widths(dims)[1]  # DeltaNet qkv, z, b, a: b and a are num_v_heads = 4 wide
    k = dims["hidden_size"]
    weight = normal(rng, sum(widths), k, scale=rng.uniform(0.2, 3.0) / math.sqrt(k))
    return normal(rng, 1, k), weight, widths


def test_exact_gemv_passes_every_draw(rng: np.random.Generator) -> None:
    assert GEMV_MAX_TOKENS >= 1
    for _ in range(DRAWS):
        x, weight, widths = demo_decode_case(rng)
        ref32, ref16 = references(x, weight, widths)
        for i, (part, r32, r16) in enumerate(zip(exact_gemv_parts(x, weight, widths), ref32, ref16)):
            check_bound(f"part {i}", part, r32, r16, FLOOR)


def test_two_percent_off_fails(rng: np.random.Generator) -> None:
    x, weight, widths = demo_decode_case(rng)
    ref32, ref16 = references(x, weight, widths)
    part = exact_gemv_parts(x, weight, widths)[2] * np.float32(1.02)
    with pytest.raises(AssertionError, match="err"):
        check_bound("b", part, ref32[2], ref16[2], FLOOR)


def test_gemm_reference_rounds_x(rng: np.random.Generator) -> None:
    x, weight, widths = demo_decode_case(rng)
    x = np.repeat(x, GEMV_MAX_TOKENS + 1, axis=0)  # [T, K] past the GEMVs: the GEMM rounds x
    _, ref16 = references(x, weight, widths)
    want = bf16_round(x) @ bf16_round(weight).T
    np.testing.assert_allclose(np.concatenate(ref16, axis=1), want, rtol=1e-5, atol=1e-5)
