"""The fused Gated DeltaNet decode kernel (atlas_delta_net_decode, ATLAS_DELTANET_DECODE=fused) on
the GPU: several tokens in a row, against the three kernels it replaces and the numpy reference,
outputs and both states; then replayed from a captured CUDA graph (its arrival counters must be
back at zero after every launch). Inputs are views of one [1, N] buffer, as the layer's fused
input projection hands them over; step scratch is poisoned with NaN before every launch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from atlas.backends.base import DeltaNetInputs, DeltaNetOperands
from atlas.backends.numpy_backend import NumpyBackend

from test_gpu_ops import Env, bf16_round, normal, rel_err
from test_gpu_ops import env as env  # noqa: F401  (the module-scoped GPU fixture)

pytestmark = pytest.mark.gpu

FLOOR = 1e-4  # test_gpu_ops' bound for the delta rule: f32 throughout, different summation order
SAME = 1e-5  # fused vs three kernels: the same per-element code, but nvcc may contract FMAs differently in each
EPS = 1e-6
STEPS = 4


@dataclass
class Layer:
    """A layer's weights and states on the host (numpy reference) and their device copies."""

    host: DeltaNetOperands
    device: DeltaNetOperands


def _make_layer(env: Env, rng: np.random.Generator, backend: Any, conv_dtype: str) -> Layer:
    hk, hv = env.d("linear_num_key_heads"), env.d("linear_num_value_heads")
    dk, dv, width = env.d("linear_key_head_dim"), env.d("linear_value_head_dim"), env.d("linear_conv_kernel_dim")
    conv = normal(rng, env.conv_channels, width, scale=0.5)
    conv = bf16_round(conv) if conv_dtype == "bf16" else conv  # the reference sees the stored weight
    host = DeltaNetOperands(conv, np.log(rng.uniform(1, 16, size=hv)).astype(np.float32), normal(rng, hv, scale=0.5),
                            normal(rng, dv, scale=0.1) + 1, EPS, normal(rng, env.conv_channels, width - 1),
                            normal(rng, hv, dk, dv, scale=0.1), hk)
    up = lambda a, dtype="f32": backend.upload(a, dtype)  # noqa: E731
    device = DeltaNetOperands(up(host.conv_weight, conv_dtype), up(host.A_log), up(host.dt_bias), up(host.norm_weight),
                              EPS, up(host.conv_state), up(host.recurrent_state), hk)
    return Layer(host, device)


def _copy_layer(backend: Any, layer: Layer) -> DeltaNetOperands:
    """Device copies of the layer's states (same weights): a second backend starts where the first did."""
    d = layer.device
    return DeltaNetOperands(d.conv_weight, d.A_log, d.dt_bias, d.norm_weight, d.norm_eps,
                            backend.upload(layer.host.conv_state, "f32"), backend.upload(layer.host.recurrent_state, "f32"),
                            d.num_k_heads)


def _inputs(env: Env, rng: np.random.Generator) -> DeltaNetInputs:
    hv, dv = env.d("linear_num_value_heads"), env.d("linear_value_head_dim")
    return DeltaNetInputs(normal(rng, 1, env.conv_channels), normal(rng, 1, hv, dv, scale=2), normal(rng, 1, hv),
                          normal(rng, 1, hv, scale=2))


def _upload_inputs(backend: Any, x: DeltaNetInputs) -> DeltaNetInputs:
    """One [1, N] buffer [mixed | z | b | a], cut into views as linear_split cuts its output."""
    parts = [x.mixed, x.z.reshape(1, -1), x.b, x.a]
    packed = backend.upload(np.concatenate(parts, axis=1), "f32")
    bounds = np.cumsum([0, *(p.shape[1] for p in parts)]).tolist()
    mixed, z, b, a = (packed.elements(lo, hi).reshape(1, hi - lo) for lo, hi in zip(bounds, bounds[1:]))
    return DeltaNetInputs(mixed, z.reshape(*x.z.shape), a, b)


def _backend(env: Env, form: str, graphs: bool = False) -> Any:
    from atlas.backends.cuda.backend import CudaBackend

    return CudaBackend(env.gpu.rt, use_graphs=graphs, delta_net=form)


def _states(backend: Any, layer: DeltaNetOperands) -> tuple[np.ndarray, np.ndarray]:
    return backend.to_numpy(layer.conv_state), backend.to_numpy(layer.recurrent_state)


def _check_arrivals_reset(backend: Any) -> None:
    assert (backend.to_numpy(backend._delta_arrivals) == 0).all(), "arrival counters not back at zero"


@pytest.mark.parametrize("conv_dtype", ["bf16", "f32"])
def test_fused_decode_matches_the_three_kernels_and_numpy(env: Env, rng: np.random.Generator, conv_dtype: str) -> None:
    fused, separate, ref = _backend(env, "fused"), _backend(env, "separate"), NumpyBackend()
    layer = _make_layer(env, rng, fused, conv_dtype)
    separate_layer = _copy_layer(separate, layer)
    host = layer.host
    for step in range(STEPS):
        x = _inputs(env, rng)
        expected = ref.gated_delta_net(x, host)  # [1, Hv, Dv]; advances the host states
        outs = []
        for backend, operands in ((fused, layer.device), (separate, separate_layer)):
            env.gpu.rt.reset_step()
            env.gpu.rt.poison_scratch()
            outs.append(backend.to_numpy(backend.gated_delta_net(_upload_inputs(backend, x), operands)))
        (out_f, out_s), name = outs, f"{env.model} step {step}"
        assert np.isfinite(out_f).all(), f"{name}: {int((~np.isfinite(out_f)).sum())} unwritten / non-finite outputs"
        assert rel_err(out_f, expected) <= FLOOR and rel_err(out_s, expected) <= FLOOR, \
            f"{name}: fused {rel_err(out_f, expected):.2e}, three kernels {rel_err(out_s, expected):.2e} vs numpy"
        assert rel_err(out_f, out_s) <= SAME, f"{name}: fused vs three kernels {rel_err(out_f, out_s):.2e}"
        (conv_f, rec_f), (conv_s, rec_s) = _states(fused, layer.device), _states(separate, separate_layer)
        np.testing.assert_array_equal(conv_f, host.conv_state, err_msg=f"{name}: fused conv state")
        np.testing.assert_array_equal(conv_s, host.conv_state, err_msg=f"{name}: three kernels' conv state")
        assert rel_err(rec_f, host.recurrent_state) <= FLOOR, f"{name}: fused recurrent state {rel_err(rec_f, host.recurrent_state):.2e}"
        assert rel_err(rec_f, rec_s) <= SAME, f"{name}: recurrent state, fused vs three kernels {rel_err(rec_f, rec_s):.2e}"
        _check_arrivals_reset(fused)


def test_fused_decode_replays_from_a_cuda_graph(env: Env, rng: np.random.Generator) -> None:
    backend, ref = _backend(env, "fused", graphs=True), NumpyBackend()
    if not backend.use_graphs:
        pytest.skip(f"{env.gpu.rt.driver.binding} cannot capture CUDA graphs")
    layer = _make_layer(env, rng, backend, "bf16")
    x = _inputs(env, rng)
    device_x = _upload_inputs(backend, x)  # persistent: the same inputs every replay
    step = backend.make_decode_step(lambda ids, positions: backend.gated_delta_net(device_x, layer.device))
    ids = positions = np.zeros(1, np.int32)
    for replay in range(STEPS):
        expected = ref.gated_delta_net(x, layer.host)
        out = backend.to_numpy(step(ids, positions))
        name = f"{env.model} replay {replay}"
        assert rel_err(out, expected) <= FLOOR, f"{name}: output {rel_err(out, expected):.2e} vs numpy"
        conv, recurrent = _states(backend, layer.device)
        np.testing.assert_array_equal(conv, layer.host.conv_state, err_msg=f"{name}: conv state")
        assert rel_err(recurrent, layer.host.recurrent_state) <= FLOOR, f"{name}: recurrent state"
        _check_arrivals_reset(backend)
    assert step.captures == 1
