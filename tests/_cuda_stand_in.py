"""A CPU stand-in for the CUDA backend in the engine-level GPU tests (LLM(device="cuda"), create_backend,
atlas.run/compare --device cuda): the numpy backend, rounding to bf16 where the CUDA backend's default
kernels round (ops_dense.linear, ops_linear_moe.moe_experts, attention.cuh, gemm_quant/moe_quant):

- x of a linear / linear_split / moe_experts past 8 tokens (the GEMMs convert it to bf16 while staging
  it; the decode GEMVs read f32), and the MoE grouped down GEMM's activation;
- an fp8 weight times its block scale in those GEMMs (an nvfp4 value times its fp8 scale is exact in bf16);
- the bf16 KV cache: k and v stored as bf16, then read by every later step.

It does not model summation order or expf, which move logits by ~1e-6 relative, far less than the
bf16 rounding above. A test that compares the GPU with the numpy backend and fails on this stand-in
would fail on a correct GPU."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from atlas.backends.host_weights import HostQuantized, dense, expert_matrix
from atlas.backends.numpy_backend import NumpyBackend

GEMV_MAX_TOKENS = 8  # ops_dense.GEMV_MAX_TOKENS, ops_linear_moe.MOE_GEMV_MAX_TOKENS


def bf16_round(x: np.ndarray) -> np.ndarray:
    from atlas.backends.cuda.upload import from_storage, to_storage

    return from_storage(to_storage(np.ascontiguousarray(x, np.float32), "bf16"), "bf16").reshape(x.shape)


def _fp8(weight: object) -> bool:
    return isinstance(weight, HostQuantized) and weight.weights[0].method == "fp8"


def _gemm_weight(weight: object) -> object:
    """The weight as a GEMM's bf16 tiles hold it: fp8 times its block scale rounded, others as stored."""
    return bf16_round(dense(weight)) if _fp8(weight) else weight


def _gemm_expert(stack: object, expert: int) -> np.ndarray:
    matrix = expert_matrix(stack, expert)  # [N, K] f32
    return bf16_round(matrix) if _fp8(stack) else matrix


class CudaRounding(NumpyBackend):
    """The numpy backend with the CUDA kernels' bf16 roundings (module docstring)."""

    use_graphs = True  # read and set by tests that switch graph replay; nothing to replay here

    def linear(self, x: np.ndarray, weight: object) -> np.ndarray:
        if x.shape[0] <= GEMV_MAX_TOKENS:
            return super().linear(x, weight)
        return super().linear(bf16_round(x), _gemm_weight(weight))

    def linear_split(self, x: np.ndarray, weight: object, widths: Sequence[int]) -> list[np.ndarray]:
        if x.shape[0] <= GEMV_MAX_TOKENS:
            return super().linear_split(x, weight, widths)
        return super().linear_split(bf16_round(x), _gemm_weight(weight), widths)

    def attention(self, q, k, v, cache, positions, scale):  # type: ignore[no-untyped-def]
        if isinstance(cache.k, np.ndarray):  # a bf16 cache; a quantized level encodes the f32 rows
            k, v = bf16_round(k), bf16_round(v)
        return super().attention(q, k, v, cache, positions, scale)

    def moe_experts(self, x, ids, weights, gate_up, down):  # type: ignore[no-untyped-def]
        if x.shape[0] <= GEMV_MAX_TOKENS:
            return super().moe_experts(x, ids, weights, gate_up, down)
        x16 = bf16_round(x)  # [T, H]
        out = np.zeros_like(x)
        for expert in np.unique(ids):
            tokens, slots = np.nonzero(ids == expert)
            act = bf16_round(self.silu_mul(x16[tokens] @ _gemm_expert(gate_up, int(expert)).T))  # [n, I]
            out[tokens] += (act @ _gemm_expert(down, int(expert)).T) * weights[tokens, slots, None]
        return out


def stand_in_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """--device cuda / auto and open_backend_for_model give a CudaRounding backend for this test."""
    import atlas.backends as backends
    from atlas.backends.cuda import select

    monkeypatch.setattr(backends, "open_cuda_backend", lambda model_dir, spec, run: CudaRounding())
    monkeypatch.setattr(select, "open_backend_for_model", lambda model, quant="bf16": CudaRounding())
    monkeypatch.delenv("ATLAS_REQUIRE_GPU", raising=False)
