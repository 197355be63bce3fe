"""Params structs of the quantized (fp8 block, nvfp4) linear and MoE kernels.

A quantized weight reaches the kernels as three device arrays (kernels/include/atlas/quant_common.cuh):
`weight` u8 [rows, k] (fp8 e4m3) or [rows, k / 2] (nvfp4, element 2i in the low nibble);
`scale` f32 [rows, ceil(k / 128)] (fp8 block scales repeated per row) or e4m3 u8 [rows, k / 16]
(nvfp4 group scales); `row_scale` f32 [rows] (nvfp4 weight_scale_2 per row) or NULL (= 1).
"""

from __future__ import annotations

import ctypes
from ctypes import c_int32, c_void_p

from .dense import RmsNormParams


class QuantLinearParams(ctypes.Structure):
    """atlas_qgemv_{fp8,nvfp4}[_narrow]_t{1..8} (tokens <= 8) and atlas_qgemm_{fp8,nvfp4}
    (tokens > 8): out = x @ dequant(weight).T."""

    _fields_ = [
        ("x", c_void_p),  # [tokens, k] f32
        ("weight", c_void_p),  # u8, see above
        ("scale", c_void_p),
        ("row_scale", c_void_p),  # f32 [n] or NULL
        ("out", c_void_p),  # [tokens, n] f32
        ("tokens", c_int32),
        ("n", c_int32),
        ("k", c_int32),  # a multiple of 16
        ("pad", c_int32),
    ]


class QuantLinearNormParams(ctypes.Structure):
    """atlas_qgemv_{fp8,nvfp4}_norm_t1 (one token, ATLAS_NORM=fused): the quantized linear of
    add_rms_norm's output with the norm taken in, as dense.LinearNormParams (linear.x unused;
    block 0 writes norm.out and norm.sum_out)."""

    _fields_ = [("linear", QuantLinearParams), ("norm", RmsNormParams)]


class MoeQuantGemmParams(ctypes.Structure):
    """atlas_moe_qgemm_{fp8,nvfp4}_{gate_up,down}: the grouped expert GEMM of moe.cuh over
    quantized experts, one launch over (N tiles, M tiles, E). Rows of the stacked weight:
    gate_up [E * 2 * n_out] (per expert n_out gate rows, then n_out up rows), down [E * n_out].
    a, out, counts, offsets, perm and route_weights as in MoeGroupedGemmParams."""

    _fields_ = [
        ("a", c_void_p),
        ("weight", c_void_p),
        ("scale", c_void_p),
        ("row_scale", c_void_p),
        ("counts", c_void_p),
        ("offsets", c_void_p),
        ("perm", c_void_p),
        ("route_weights", c_void_p),
        ("out", c_void_p),
        ("num_slots", c_int32),
        ("top_k", c_int32),
        ("n_out", c_int32),
        ("k_in", c_int32),  # a multiple of 16
        ("num_experts", c_int32),
        ("pad", c_int32),
    ]


class MoeQuantGemvParams(ctypes.Structure):
    """atlas_moe_qgemv_{fp8,nvfp4}_gate_up (grid (ceil(inter / 8), T * k)): act[s] =
    silu_mul(gate_up[ids[s]] @ x[s / k]); atlas_moe_qgemv_{fp8,nvfp4}_down_k{k} (grid (ceil(hidden / 8), T)):
    out[t] = sum_j route_weights[t, j] * down[ids[t, j]] @ act[t * k + j]. Decode (T <= 8); the down
    entries exist for k = num_experts_per_tok and k + 1 (the router's shared slot)."""

    _fields_ = [
        ("x", c_void_p),  # gate_up: x [T, hidden] f32; down: act [T * k, inter] f32
        ("ids", c_void_p),  # [T, k] i32
        ("route_weights", c_void_p),  # [T, k] f32 (down)
        ("weight", c_void_p),  # stacked experts, as MoeQuantGemmParams
        ("scale", c_void_p),
        ("row_scale", c_void_p),
        ("out", c_void_p),  # gate_up: act [T * k, inter]; down: [T, hidden] f32
        ("num_tokens", c_int32),
        ("top_k", c_int32),  # slots per token; down: the entry's k
        ("hidden", c_int32),
        ("inter", c_int32),
        ("num_experts", c_int32),
        ("pad", c_int32),
    ]


ALL_PARAMS: tuple[type[ctypes.Structure], ...] = (QuantLinearParams, QuantLinearNormParams, MoeQuantGemmParams,
                                                  MoeQuantGemvParams)
