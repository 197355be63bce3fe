"""test_gpu_delta_decode's own logic on the CPU: the fused and the three-kernel forms replaced by the
Gated DeltaNet decode computed in float64 (another rounding than the numpy reference's float32,
read back as f32), on the test's own layer, inputs and [1, N] packed views. It must pass
test_fused_decode_matches_the_three_kernels_and_numpy in every draw (f64 vs the f32 reference:
~1e-6 relative at most, the bound is 1e-4); one whose output is 2 % off must fail it. The graph
replay test needs a capturing driver (it skips without one) and checks the same quantities."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import test_gpu_delta_decode
from atlas.backends.base import DeltaNetInputs, DeltaNetOperands
from atlas.targets import load_registry
from test_gpu_harness import HostArray, StandInBackend
from test_gpu_ops import Env

DRAWS = 5


class PackedHostArray(HostArray):
    def elements(self, start: int, stop: int) -> PackedHostArray:
        return self.reshape(-1)[start:stop]


class ExactDeltaNet(StandInBackend):
    """gated_delta_net in float64 on the f32 (or bf16-rounded) operands; states written back as f32."""

    def __init__(self, scale: np.float32 = np.float32(1)) -> None:
        super().__init__(scale)
        self._delta_arrivals = np.zeros(4, np.int32)

    def upload(self, array: np.ndarray, dtype: str) -> PackedHostArray:
        return super().upload(array, dtype).view(PackedHostArray)

    def gated_delta_net(self, x: DeltaNetInputs, layer: DeltaNetOperands) -> np.ndarray:
        wide = {f.name: np.asarray(getattr(layer, f.name), np.float64) if isinstance(getattr(layer, f.name), np.ndarray)
                else getattr(layer, f.name) for f in dataclasses.fields(layer)}
        layer64 = DeltaNetOperands(**wide)
        inputs64 = DeltaNetInputs(*(np.asarray(getattr(x, f.name), np.float64) for f in dataclasses.fields(x)))
        out = super().gated_delta_net(inputs64, layer64)  # [1, Hv, Dv]
        layer.conv_state[...] = layer64.conv_state
        layer.recurrent_state[...] = layer64.recurrent_state
        return np.asarray(out, np.float32)


def _env(model: str, monkeypatch: pytest.MonkeyPatch, scale: np.float32 = np.float32(1)) -> Env:
    monkeypatch.setattr(test_gpu_delta_decode, "_backend", lambda env, form, graphs=False: ExactDeltaNet(scale))
    return Env(model, StandInBackend(), dict(load_registry().models[model].constants))


@pytest.mark.parametrize("model", ["atlas-demo", pytest.param("qwen3.6-35b-a3b", marks=pytest.mark.slow)])
def test_exact_delta_net_passes_every_draw(model: str, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _env(model, monkeypatch)
    for _ in range(DRAWS):
        for conv_dtype in ("bf16", "f32"):
            test_gpu_delta_decode.test_fused_decode_matches_the_three_kernels_and_numpy(env, rng, conv_dtype)


def test_delta_net_two_percent_off_fails(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _env("atlas-demo", monkeypatch, np.float32(1.02))
    with pytest.raises(AssertionError, match="vs numpy"):
        test_gpu_delta_decode.test_fused_decode_matches_the_three_kernels_and_numpy(env, rng, "bf16")
