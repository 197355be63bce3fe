"""Params struct of the fused Gated DeltaNet decode kernel (T == 1): conv + delta rule + gated norm."""

from __future__ import annotations

import ctypes
from ctypes import c_float, c_int32, c_void_p


class DeltaNetDecodeParams(ctypes.Structure):
    """atlas_delta_net_decode (one token): mixed [C] f32 (q, k, v before the conv), z [Hv*Dv],
    a, b [Hv], conv_weight [C, K] f32 or bf16, conv_state [C, K-1] f32 (in place), A_log, dt_bias
    [Hv], norm_weight [Dv], state [Hv, Dk, Dv] f32 (in place), out [Hv*Dv] (the gated norm's
    output), arrivals [>= Hk] u32: one counter per key head, zero on entry and on exit."""

    _fields_ = [
        ("mixed", c_void_p),
        ("z", c_void_p),
        ("a", c_void_p),
        ("b", c_void_p),
        ("conv_weight", c_void_p),
        ("conv_state", c_void_p),
        ("A_log", c_void_p),
        ("dt_bias", c_void_p),
        ("norm_weight", c_void_p),
        ("state", c_void_p),
        ("out", c_void_p),
        ("arrivals", c_void_p),
        ("num_k_heads", c_int32),
        ("num_v_heads", c_int32),
        ("k_head_dim", c_int32),
        ("v_head_dim", c_int32),
        ("kernel_width", c_int32),
        ("weight_bf16", c_int32),
        ("eps", c_float),
        ("pad", c_int32),
    ]


ALL_PARAMS: tuple[type[ctypes.Structure], ...] = (DeltaNetDecodeParams,)
