"""linear_split on the GPU (bf16, fp8, nvfp4 weights) against the numpy reference, at the demo and
the Qwen3.6 dimensions of the fused input projections: T == 1 (one GEMV, parts are views of its
output) and T > 1 (one linear per part on a row view of the weight). Bound as test_gpu_ops.py;
step scratch poisoned with NaN first, so an unwritten or misaddressed part fails."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from atlas.backends.numpy_backend import NumpyBackend
from test_gpu_ops import bf16_round, check_bound, normal

pytestmark = pytest.mark.gpu

MODELS = ("atlas-demo", "qwen3.6-35b-a3b")
STORAGES = ("bf16", "fp8", "nvfp4")
FLOOR = 2e-4


@pytest.fixture(scope="module", params=[(m, s) for m in MODELS for s in STORAGES], ids=lambda p: f"{p[0]}-{p[1]}")
def gpu(request: pytest.FixtureRequest) -> tuple[Any, str, dict[str, int]]:
    from test_gpu_quant import open_tuple

    return open_tuple(*request.param)


def projection_widths(d: dict[str, int]) -> list[tuple[int, ...]]:
    """The loader's fused groups: attention q, gate, k, v; DeltaNet qkv, z, b, a (one bf16 group)
    and, for quantized checkpoints, qkv + z (b and a stay bf16)."""
    q, kv = d["num_attention_heads"] * d["head_dim"], d["num_key_value_heads"] * d["head_dim"]
    values, heads = d["linear_num_value_heads"] * d["linear_value_head_dim"], d["linear_num_value_heads"]
    conv = 2 * d["linear_num_key_heads"] * d["linear_key_head_dim"] + values
    return [(q, q, kv, kv), (conv, values, heads, heads), (conv, values)]


def references(x: np.ndarray, weight: np.ndarray, widths: tuple[int, ...]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(ref32, ref16) parts of x [T, K] @ weight.T. ref16 on what the kernels read: weights in bf16,
    x rounded to bf16 only past GEMV_MAX_TOKENS (the GEMMs round it; the decode GEMVs read f32).
    Rounding x for a GEMV adds an error the kernel does not make: on a 4-wide part (the demo's
    DeltaNet b, a at T = 1) that ref16 lands nearer ref32 than an exact kernel in ~0.7 % of draws
    (tests/test_split_linear_bound_rule.py)."""
    from atlas.backends.cuda.ops_dense import GEMV_MAX_TOKENS

    x16 = x if x.shape[0] <= GEMV_MAX_TOKENS else bf16_round(x)
    return NumpyBackend().linear_split(x, weight, widths), NumpyBackend().linear_split(x16, bf16_round(weight), widths)


def device_weight(backend: Any, storage: str, dense: np.ndarray) -> tuple[Any, np.ndarray]:
    """(device weight, the f32 matrix it holds) for bf16, fp8 or nvfp4 storage."""
    if storage == "bf16":
        return backend.upload(dense, "bf16"), dense
    from test_gpu_quant import quantize

    from atlas.backends.cuda.quant_weights import upload

    host, dequantized = quantize(storage, dense)
    return upload(backend.uploader, host), dequantized


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_linear_split_matches_numpy(gpu: tuple[Any, str, dict[str, int]], rng: np.random.Generator, tokens: int) -> None:
    backend, storage, dims = gpu
    k = dims["hidden_size"]
    for widths in projection_widths(dims):
        dense = normal(rng, sum(widths), k, scale=rng.uniform(0.2, 3.0) / math.sqrt(k))
        weight, reference = device_weight(backend, storage, dense)
        x = normal(rng, tokens, k)
        device_x = backend.upload(x, "f32")
        ref32, ref16 = references(x, reference, widths)
        rt = backend.rt
        rt.reset_step()
        rt.poison_scratch()
        parts = backend.linear_split(device_x, weight, widths)
        assert len(parts) == len(widths)
        for i, (part, r32, r16) in enumerate(zip(parts, ref32, ref16)):
            check_bound(f"{storage} linear_split {tokens}x{k} -> {widths} part {i}", backend.to_numpy(part), r32, r16,
                        FLOOR)
