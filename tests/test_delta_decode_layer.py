"""The Gated DeltaNet layer on the CUDA backend over the emulated driver of test_cuda_select.py:
with ATLAS_DELTANET_DECODE=fused a decode token runs conv + delta rule + gated norm as one
atlas_delta_net_decode launch wired to the layer's tensors (the input projection's views, both
states, the weights, the output projection's input); prefill, a dump, or the default form run
the three kernels. A bad form is one AtlasError when the backend is built. Then the GPU test's
scenarios (tests/test_gpu_delta_decode.py) run on this driver with the kernels emulated in numpy
(the fused one by test_delta_decode_abi's block emulation), so the device runs checked wiring."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from atlas.backends.cuda.backend import CudaBackend
from atlas.backends.cuda.driver import LaunchArgs
from atlas.backends.cuda.runtime import CudaRuntime, KernelImage, RuntimeOptions
from atlas.backends.numpy_backend import NumpyBackend
from atlas.errors import AtlasError
from atlas.kernel_params import dense as dense_params
from atlas.kernel_params import linear_moe
from atlas.kernel_params.delta_decode import DeltaNetDecodeParams
from atlas.layers.linear_attention import GatedDeltaNet
from atlas.layers.step import Step

import test_delta_decode_abi as abi
from _operands import delta_rule_operands
import test_gpu_delta_decode as gpu_test
from test_cuda_select import FakeDriver, make_runtime

THREE = ["atlas_causal_conv1d", "atlas_gated_delta_rule", "atlas_gated_rms_norm"]


def _demo_delta_net(be: CudaBackend) -> GatedDeltaNet:
    from atlas.config import load_spec
    from atlas.demo import DEMO_DIR
    from atlas.models import load_model
    from atlas.safetensors import Checkpoint

    model = load_model(load_spec(DEMO_DIR), Checkpoint.open(DEMO_DIR), be)
    return next(layer.mixer for layer in model.layers if isinstance(layer.mixer, GatedDeltaNet))


def _run(form: str, tokens: int, rng: np.random.Generator, dump: bool = False) -> tuple[Any, GatedDeltaNet, Any, list]:
    rt, driver = make_runtime(arena_bytes=8 << 20)
    be = CudaBackend(rt, use_graphs=False, delta_net=form)
    mixer = _demo_delta_net(be)
    state = mixer.new_state(be, 16)
    rt.reset_step()
    hidden = mixer.weights.out.shape[0]
    x = be.upload(rng.standard_normal((tokens, hidden)).astype(np.float32), "f32")
    dumped: list[str] = []
    step = Step(be, be.upload(np.arange(tokens, dtype=np.int32), "i32"), (lambda name, t: dumped.append(name)) if dump else None)
    before = len(driver.launches)
    mixer(step, x, state, "layer.0.attn")
    return driver.launches[before:], mixer, state, dumped


def _names(launches: list) -> list[str]:
    return [name for name, *_ in launches if not name.startswith(("atlas_gemv", "atlas_gemm", "atlas_linear"))]


def test_fused_decode_is_one_launch_wired_to_the_layer(rng: np.random.Generator) -> None:
    launches, mixer, state, _ = _run("fused", 1, rng)
    assert _names(launches) == ["atlas_delta_net_decode"]
    (raw,) = [raw for name, _, raw, _ in launches if name == "atlas_delta_net_decode"]
    p = DeltaNetDecodeParams.from_buffer_copy(raw)
    w, d = mixer.weights, mixer.dims
    assert (p.conv_weight, p.conv_state, p.state) == (w.conv.ptr, state.conv.ptr, state.recurrent.ptr)
    assert (p.A_log, p.dt_bias, p.norm_weight, p.eps) == (w.A_log.ptr, w.dt_bias.ptr, w.norm.weight.ptr,
                                                          pytest.approx(w.norm.eps))
    assert (p.num_k_heads, p.num_v_heads, p.k_head_dim, p.v_head_dim, p.kernel_width) == (
        d.num_k_heads, d.num_v_heads, d.k_head_dim, d.v_head_dim, d.conv_kernel)
    gemvs = [dense_params.LinearParams.from_buffer_copy(raw) for name, _, raw, _ in launches if name.startswith("atlas_gemv")]
    in_proj, out_proj = gemvs[0], gemvs[-1]
    channels, value = d.conv_channels, d.num_v_heads * d.v_head_dim
    assert p.mixed == in_proj.out  # the projection's views: [mixed | z | b | a]
    assert (p.z, p.b, p.a) == (in_proj.out + 4 * channels, in_proj.out + 4 * (channels + value),
                               in_proj.out + 4 * (channels + value + d.num_v_heads))
    assert out_proj.x == p.out and p.arrivals
    assert ctypes.sizeof(p) == len(raw)


PROJECTION = ["layer.0.attn.qkv", "layer.0.attn.z", "layer.0.attn.b", "layer.0.attn.a"]


@pytest.mark.parametrize("form,tokens,dump", [("separate", 1, False), ("fused", 5, False), ("separate", 1, True),
                                              ("fused", 5, True)])
def test_three_kernels_otherwise(form: str, tokens: int, dump: bool, rng: np.random.Generator) -> None:
    launches, _, _, dumped = _run(form, tokens, rng, dump)
    assert _names(launches) == THREE
    if dump:
        assert dumped == [*PROJECTION, "layer.0.attn.conv", "layer.0.attn.core", "layer.0.attn.gated_norm"]


def test_a_dump_keeps_the_fused_step(rng: np.random.Generator) -> None:
    """With a dump attached a fused decode step stays one kernel (atlas.compare --against cpu
    checks that kernel at its output): its inputs and output are dumped, no .conv / .core."""
    launches, _, _, dumped = _run("fused", 1, rng, dump=True)
    assert _names(launches) == ["atlas_delta_net_decode"]
    assert dumped == [*PROJECTION, "layer.0.attn.gated_norm"]


def test_a_bad_form_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATLAS_DELTANET_DECODE", "yes")
    rt, _ = make_runtime()
    with pytest.raises(AtlasError, match="ATLAS_DELTANET_DECODE='yes'"):
        CudaBackend(rt, use_graphs=False)
    monkeypatch.setenv("ATLAS_DELTANET_DECODE", "fused")
    assert CudaBackend(rt, use_graphs=False).delta_net_form == "fused"


# --- the GPU test's scenarios on the emulated driver, kernels run by their numpy emulations ------
def _f32(ptr: int, *shape: int) -> np.ndarray:
    """A writable view of device (fake heap) memory."""
    return np.ctypeslib.as_array((ctypes.c_float * math.prod(shape)).from_address(ptr)).reshape(shape)


def _taps(ptr: int, bf16: int, *shape: int) -> np.ndarray:
    if not bf16:
        return _f32(ptr, *shape)
    bits = np.ctypeslib.as_array((ctypes.c_uint16 * math.prod(shape)).from_address(ptr))
    return (bits.astype(np.uint32) << 16).view(np.float32).reshape(shape)


def _fused(p: DeltaNetDecodeParams, rng: np.random.Generator) -> None:
    """atlas_delta_net_decode by test_delta_decode_abi's emulation of its blocks, in a random order."""
    d = abi.Dims(p.num_k_heads, p.num_v_heads, p.k_head_dim, p.v_head_dim, p.kernel_width)
    values = d.hv * d.dv
    mem = abi.Memory(_f32(p.mixed, d.channels), _f32(p.z, values), _f32(p.a, d.hv), _f32(p.b, d.hv),
                     _taps(p.conv_weight, p.weight_bf16, d.channels, d.width), _f32(p.conv_state, d.channels, d.width - 1),
                     _f32(p.A_log, d.hv), _f32(p.dt_bias, d.hv), _f32(p.norm_weight, d.dv), _f32(p.state, d.hv, d.dk, d.dv),
                     _f32(p.out, values), np.ctypeslib.as_array((ctypes.c_int32 * d.hk).from_address(p.arrivals)), p.eps)
    assert (mem.arrivals == 0).all(), "a launch found its counters set"
    abi.run_launch(mem, d, rng.permutation(d.hv * (d.dv // abi.COLS_PER_BLOCK)))
    assert abi.races(mem, d) == []


def _three(name: str, raw: bytes) -> None:
    """The three kernels the fused one replaces, by the numpy backend on device memory."""
    ref = NumpyBackend()
    if name == "atlas_causal_conv1d":
        c = linear_moe.CausalConv1dParams.from_buffer_copy(raw)
        x = _f32(c.x, c.num_tokens, c.channels).copy()
        weight = _taps(c.weight, c.weight_bf16, c.channels, c.kernel_width)
        _f32(c.out, c.num_tokens, c.channels)[...] = ref.causal_conv1d(x, weight, _f32(c.state, c.channels, c.kernel_width - 1))
    elif name == "atlas_gated_delta_rule":
        r = linear_moe.GatedDeltaRuleParams.from_buffer_copy(raw)
        t, hv, dk, dv = r.num_tokens, r.num_v_heads, r.k_head_dim, r.v_head_dim
        mixed = _f32(r.mixed_qkv, t, 2 * r.num_k_heads * dk + hv * dv).copy()
        layer = delta_rule_operands(_f32(r.A_log, hv), _f32(r.dt_bias, hv), _f32(r.state, hv, dk, dv), r.num_k_heads)
        out = ref.gated_delta_rule(mixed, _f32(r.a, t, hv).copy(), _f32(r.b, t, hv).copy(), layer)
        _f32(r.out, t, hv, dv)[...] = out
    elif name == "atlas_gated_rms_norm":
        n = linear_moe.GatedRmsNormParams.from_buffer_copy(raw)
        x, z = _f32(n.x, n.rows, n.dim).copy(), _f32(n.z, n.rows, n.dim).copy()
        _f32(n.out, n.rows, n.dim)[...] = ref.gated_rms_norm(x, z, _f32(n.weight, n.dim), n.eps)


@dataclass
class EmulatingDriver(FakeDriver):
    """The emulated driver, also running the DeltaNet kernels (in stream order, and on replay)."""

    rng: np.random.Generator = field(default_factory=np.random.default_rng)

    def __post_init__(self) -> None:
        self.heap = ctypes.create_string_buffer(160 << 20)
        self.next_ptr = (ctypes.addressof(self.heap) + 255) // 256 * 256

    def launch(self, launch: LaunchArgs) -> None:
        super().launch(launch)
        raw = ctypes.string_at(launch.params_addr, launch.params_size)
        if launch.kernel == "atlas_delta_net_decode":
            self._op(lambda: _fused(DeltaNetDecodeParams.from_buffer_copy(raw), self.rng))
        else:
            self._op(lambda: _three(launch.kernel, raw))


@pytest.mark.parametrize("model", ["atlas-demo", "qwen3.6-35b-a3b"])
def test_the_gpu_tests_pass_on_the_emulated_kernels(model: str, rng: np.random.Generator,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """test_gpu_delta_decode's checks (poisoned outputs, views of one buffer, 4 steps, graph
    replays, counters) on kernels emulated in numpy: the wiring the device will run. The
    emulation's float order is not the kernels', so fused vs three is held to the numpy bound."""
    from atlas.targets import load_registry

    driver = EmulatingDriver()
    rt = CudaRuntime(driver, KernelImage("fake/model/bf16 (cubin)", b"\x7fELF", "cubin", 90), RuntimeOptions(arena_bytes=16 << 20))
    env = gpu_test.Env(model, CudaBackend(rt, use_graphs=False), dict(load_registry().models[model].constants))
    monkeypatch.setattr(gpu_test, "SAME", gpu_test.FLOOR)
    for conv_dtype in ("bf16", "f32"):
        gpu_test.test_fused_decode_matches_the_three_kernels_and_numpy(env, rng, conv_dtype)
    gpu_test.test_fused_decode_replays_from_a_cuda_graph(env, rng)
    assert driver.graph_launches == gpu_test.STEPS
