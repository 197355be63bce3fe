"""Op wrapper of the fused Gated DeltaNet decode kernel (kernels/include/atlas/delta_decode.cuh):
conv + delta rule + gated norm of one token in one launch, `Backend.gated_delta_net`'s T == 1
case. Opt-in (ATLAS_DELTANET_DECODE=fused) until the device confirms it; the default runs the
three kernels of ops_linear_moe."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from atlas.kernel_params.delta_decode import DeltaNetDecodeParams

from ..base import DeltaNetInputs, DeltaNetOperands
from .ops_common import FormSwitch, expect as _expect
from .ops_linear_moe import DELTA_COLS_PER_BLOCK, DELTA_THREADS

if TYPE_CHECKING:
    from .runtime import CudaRuntime
    from .tensor import DeviceTensor

DECODE_ENV = "ATLAS_DELTANET_DECODE"
DECODE_FORMS = ("separate", "fused")
DECODE_SWITCH = FormSwitch(DECODE_ENV, "DeltaNet decode form", DECODE_FORMS)
# One arrival counter per key head; the buffer is allocated before any graph capture, so it has
# room for any registry model's key heads rather than this model's.
ARRIVAL_COUNTERS = 1024


def decode_form(form: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """`form` "separate" | "fused", or None: ATLAS_DELTANET_DECODE decides (default separate)."""
    return DECODE_SWITCH.read(form, environ)


def decode_arrivals(rt: CudaRuntime) -> DeviceTensor:
    """The zeroed counters the fused kernel's last blocks reset (persistent: made before capture)."""
    return rt.zeros((ARRIVAL_COUNTERS,), "i32")


def delta_net_decode(rt: CudaRuntime, x: DeltaNetInputs, layer: DeltaNetOperands, arrivals: DeviceTensor) -> DeviceTensor:
    """One token through conv, delta rule and gated norm -> [1, Hv, Dv]; both states in place."""
    value_heads, k_dim, v_dim = layer.recurrent_state.shape
    channels, width = layer.conv_state.shape[0], layer.conv_state.shape[1] + 1
    key_heads = layer.num_k_heads
    _expect(x.mixed.shape == (1, channels), f"delta_net_decode: mixed {x.mixed.shape}, expected {(1, channels)}")
    _expect(channels == 2 * key_heads * k_dim + value_heads * v_dim,
            f"delta_net_decode: conv_state {layer.conv_state.shape} vs state {layer.recurrent_state.shape}, {key_heads} key heads")
    _expect(layer.conv_weight.numel == channels * width, f"delta_net_decode: conv weight {layer.conv_weight.shape}, expected {(channels, width)}")
    _expect(x.z.numel == value_heads * v_dim, f"delta_net_decode: z {x.z.shape}, expected {(1, value_heads, v_dim)}")
    for name, t, count in (("a", x.a, value_heads), ("b", x.b, value_heads), ("A_log", layer.A_log, value_heads),
                           ("dt_bias", layer.dt_bias, value_heads), ("norm weight", layer.norm_weight, v_dim)):
        _expect(t.numel == count, f"delta_net_decode: {name} {t.shape}, expected {count} values")
    for name, t in (("mixed", x.mixed), ("z", x.z), ("a", x.a), ("b", x.b), ("A_log", layer.A_log), ("dt_bias", layer.dt_bias),
                    ("norm weight", layer.norm_weight), ("conv_state", layer.conv_state), ("state", layer.recurrent_state)):
        _expect(t.dtype == "f32", f"delta_net_decode {name}: dtype {t.dtype}, expected f32")
    _expect(layer.conv_weight.dtype in ("f32", "bf16"), f"delta_net_decode conv weight: dtype {layer.conv_weight.dtype}, expected f32 or bf16")
    _expect(v_dim % DELTA_COLS_PER_BLOCK == 0, f"delta_net_decode: Dv {v_dim} not a multiple of {DELTA_COLS_PER_BLOCK}")
    _expect(0 < key_heads <= arrivals.numel and value_heads % key_heads == 0,
            f"delta_net_decode: {key_heads} key heads for {value_heads} value heads, {arrivals.numel} counters")
    out = rt.empty((1, value_heads, v_dim), "f32")
    params = DeltaNetDecodeParams(
        mixed=x.mixed.ptr, z=x.z.ptr, a=x.a.ptr, b=x.b.ptr, conv_weight=layer.conv_weight.ptr,
        conv_state=layer.conv_state.ptr, A_log=layer.A_log.ptr, dt_bias=layer.dt_bias.ptr,
        norm_weight=layer.norm_weight.ptr, state=layer.recurrent_state.ptr, out=out.ptr, arrivals=arrivals.ptr,
        num_k_heads=key_heads, num_v_heads=value_heads, k_head_dim=k_dim, v_head_dim=v_dim, kernel_width=width,
        weight_bf16=int(layer.conv_weight.dtype == "bf16"), eps=layer.norm_eps,
    )
    rt.launch("atlas_delta_net_decode", (value_heads, v_dim // DELTA_COLS_PER_BLOCK, 1), (DELTA_THREADS, 1, 1), params)
    return out
