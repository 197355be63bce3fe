"""test_gpu_quant's kernel tests on the CPU: ops_quant.linear / moe_experts replaced by a numpy model of
the kernels' rounding on the test's own uploads (decode GEMVs, T <= 8: f32 x and the dequantized
weight; GEMMs: x and the MoE activation rounded to bf16, the weight tile bf16(code x block scale),
nvfp4's per-row scale applied after). It must pass test_quant_linear, test_quant_linear_zero_tail_rows
and test_quant_moe_experts in every draw; a result 2 % off must fail them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import test_gpu_quant
from atlas.backends.cuda import ops_quant, quant_weights
from atlas.backends.cuda.quant_weights import HostQuantWeight
from atlas.targets import load_registry
from test_gpu_harness import StandInBackend
from test_gpu_ops import bf16_round

GEMV_MAX_TOKENS = 8


@dataclass(frozen=True)
class Uploaded:
    host: HostQuantWeight
    experts: int


def _tile(host: HostQuantWeight, gemm: bool) -> tuple[np.ndarray, np.ndarray]:
    """(the weight [rows, K] as the kernel multiplies it, the per-row scale applied to its sums)."""
    rows_scale = np.ones(host.rows) if host.row_scale is None else host.row_scale.astype(np.float64)
    raw = host.dequantize().astype(np.float64) / rows_scale[:, None]  # fp8: code x block scale
    return (bf16_round(raw.astype(np.float32)).astype(np.float64) if gemm else raw), rows_scale


def model_linear(x: np.ndarray, host: HostQuantWeight, off: float) -> np.ndarray:
    gemm = x.shape[0] > GEMV_MAX_TOKENS
    tile, row_scale = _tile(host, gemm)
    xs = bf16_round(np.asarray(x)) if gemm else np.asarray(x)
    return (xs.astype(np.float64) @ tile.T * row_scale * off).astype(np.float32)  # [T, N]


def model_moe(x: np.ndarray, ids: np.ndarray, routing: np.ndarray, gate_up: Uploaded, down: Uploaded,
              off: float) -> np.ndarray:
    x, ids, routing = np.asarray(x), np.asarray(ids), np.asarray(routing)
    gemm = x.shape[0] > GEMV_MAX_TOKENS
    two_inter, hidden = gate_up.host.rows // gate_up.experts, x.shape[1]
    out = np.zeros(x.shape, np.float64)
    xs = (bf16_round(x) if gemm else x).astype(np.float64)
    for e in np.unique(ids):
        tokens, slots = np.nonzero(ids == e)
        gu, gu_scale = _tile(gate_up.host.take_rows(slice(e * two_inter, (e + 1) * two_inter)), gemm)
        dn, dn_scale = _tile(down.host.take_rows(slice(e * hidden, (e + 1) * hidden)), gemm)
        h = xs[tokens] @ gu.T * gu_scale  # [n, 2I]
        inter = two_inter // 2
        act = (h[:, :inter] / (1 + np.exp(-h[:, :inter])) * h[:, inter:]).astype(np.float32)
        act = (bf16_round(act) if gemm else act).astype(np.float64)
        out[tokens] += (act @ dn.T * dn_scale) * routing[tokens, slots, None]
    return (out * off).astype(np.float32)


def _gpu(model: str, fmt: str, monkeypatch: pytest.MonkeyPatch, off: float = 1.0) -> tuple[Any, str, dict[str, int]]:
    monkeypatch.setattr(quant_weights, "upload", lambda uploader, host, experts=0: Uploaded(host, experts))
    monkeypatch.setattr(ops_quant, "linear", lambda rt, x, w: model_linear(x, w.host, off))
    monkeypatch.setattr(ops_quant, "moe_experts", lambda rt, x, ids, routing, gu, dn: model_moe(x, ids, routing, gu, dn, off))
    backend = StandInBackend()
    backend.uploader = None  # type: ignore[attr-defined]
    return backend, fmt, dict(load_registry().models[model].constants)


@pytest.mark.parametrize("fmt", test_gpu_quant.FORMATS)
@pytest.mark.parametrize("model", ["atlas-demo", pytest.param("qwen3.6-35b-a3b", marks=pytest.mark.slow)])
def test_kernel_model_passes_the_quant_tests(model: str, fmt: str, rng: np.random.Generator,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = _gpu(model, fmt, monkeypatch)
    for tokens in (1, 3, 8, 17, 100):
        test_gpu_quant.test_quant_linear(gpu, rng, tokens)
    test_gpu_quant.test_quant_linear_zero_tail_rows(gpu, rng)
    for tokens in (1, 5, 77):
        for shared in (False, True):
            test_gpu_quant.test_quant_moe_experts(gpu, rng, tokens, shared)


@pytest.mark.parametrize("fmt", test_gpu_quant.FORMATS)
def test_two_percent_off_fails(fmt: str, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = _gpu("atlas-demo", fmt, monkeypatch, 1.02)
    with pytest.raises(AssertionError, match="err"):
        test_gpu_quant.test_quant_linear(gpu, rng, 1)
    with pytest.raises(AssertionError, match="err"):
        test_gpu_quant.test_quant_moe_experts(gpu, rng, 77, True)
