"""The Gated DeltaNet layer on the CUDA backend over the emulated driver of test_cuda_select.py:
with ATLAS_DELTANET_DECODE=fused a decode token runs conv + delta rule + gated norm as one
atlas_delta_net_decode launch wired to the layer's tensors (the input projection's views, both
states, the weights, the output projection's input); prefill, a dump, or the default form run
the three kernels. A bad form is one AtlasError when the backend is built."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

from atlas.backends.cuda.backend import CudaBackend
from atlas.errors import AtlasError
from atlas.kernel_params import dense as dense_params
from atlas.kernel_params.delta_decode import DeltaNetDecodeParams
from atlas.layers.linear_attention import GatedDeltaNet
from atlas.layers.step import Step

from test_cuda_select import make_runtime

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


@pytest.mark.parametrize("form,tokens,dump", [("separate", 1, False), ("fused", 5, False), ("fused", 1, True)])
def test_three_kernels_otherwise(form: str, tokens: int, dump: bool, rng: np.random.Generator) -> None:
    launches, _, _, dumped = _run(form, tokens, rng, dump)
    assert _names(launches) == THREE
    if dump:
        assert dumped == ["layer.0.attn.conv", "layer.0.attn.core", "layer.0.attn.gated_norm"]


def test_a_bad_form_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATLAS_DELTANET_DECODE", "yes")
    rt, _ = make_runtime()
    with pytest.raises(AtlasError, match="ATLAS_DELTANET_DECODE='yes'"):
        CudaBackend(rt, use_graphs=False)
    monkeypatch.setenv("ATLAS_DELTANET_DECODE", "fused")
    assert CudaBackend(rt, use_graphs=False).delta_net_form == "fused"
