"""Params structs of the linear-attention (conv, delta rule, gated norm) and MoE kernels.

Dimensions that the kernels also know as compile-time model constants (conv width, head counts and
dims) are passed anyway: a kernel whose constants disagree with them writes nothing, so a wrong
tuple shows up as poisoned outputs in the tests instead of as silent garbage.
"""

from __future__ import annotations

import ctypes
from ctypes import c_float, c_int32, c_void_p

from .dense import RmsNormParams


class CausalConv1dParams(ctypes.Structure):
    """atlas_causal_conv1d: x [T, C] f32, weight [C, K] f32 or bf16, state [C, K-1] f32 (in place)."""

    _fields_ = [
        ("x", c_void_p),
        ("weight", c_void_p),
        ("state", c_void_p),
        ("out", c_void_p),
        ("num_tokens", c_int32),
        ("channels", c_int32),
        ("kernel_width", c_int32),
        ("weight_bf16", c_int32),
    ]


class GatedDeltaRuleParams(ctypes.Structure):
    """atlas_gated_delta_rule: mixed_qkv [T, 2*Hk*Dk + Hv*Dv], a, b [T, Hv], A_log, dt_bias [Hv],
    state [Hv, Dk, Dv] f32 (in place), out [T, Hv, Dv]."""

    _fields_ = [
        ("mixed_qkv", c_void_p),
        ("a", c_void_p),
        ("b", c_void_p),
        ("A_log", c_void_p),
        ("dt_bias", c_void_p),
        ("state", c_void_p),
        ("out", c_void_p),
        ("num_tokens", c_int32),
        ("num_k_heads", c_int32),
        ("num_v_heads", c_int32),
        ("k_head_dim", c_int32),
        ("v_head_dim", c_int32),
        ("pad", c_int32),
    ]


class GatedDeltaChunkParams(ctypes.Structure):
    """atlas_gated_delta_chunk_prep / _scan (prefill, chunks of 64 tokens): the inputs of
    GatedDeltaRuleParams plus f32 scratch per (value head, chunk): w [C, Dk], u [C, Dv],
    q_decayed [C, Dk], k_to_end [C, Dk], intra [C, C], chunk_decay [1]; num_chunks = ceil(T / 64)."""

    _fields_ = [
        ("mixed_qkv", c_void_p),
        ("a", c_void_p),
        ("b", c_void_p),
        ("A_log", c_void_p),
        ("dt_bias", c_void_p),
        ("state", c_void_p),
        ("out", c_void_p),
        ("w", c_void_p),
        ("u", c_void_p),
        ("q_decayed", c_void_p),
        ("k_to_end", c_void_p),
        ("intra", c_void_p),
        ("chunk_decay", c_void_p),
        ("num_tokens", c_int32),
        ("num_chunks", c_int32),
        ("num_k_heads", c_int32),
        ("num_v_heads", c_int32),
        ("k_head_dim", c_int32),
        ("v_head_dim", c_int32),
    ]


class GatedRmsNormParams(ctypes.Structure):
    """atlas_gated_rms_norm: x, z [rows, D] f32, weight [D] f32, out [rows, D]."""

    _fields_ = [
        ("x", c_void_p),
        ("z", c_void_p),
        ("weight", c_void_p),
        ("out", c_void_p),
        ("rows", c_int32),
        ("dim", c_int32),
        ("eps", c_float),
        ("pad", c_int32),
    ]


class RouterParams(ctypes.Structure):
    """atlas_router_logits: x [T, H] f32, weight [E + s, H] bf16 -> logits [T, E + s] f32;
    atlas_router_top_k: logits -> ids [T, k + s] i32, weights [T, k + s] f32, where
    s = shared_expert (0 or 1): slot k is the shared expert (id E, weight sigmoid(logit E)),
    num_experts is the routed E. atlas_router_fused: both in one launch; arrivals [>= T] u32,
    zero on entry and on exit (one counter per token; null for the two-launch entries)."""

    _fields_ = [
        ("x", c_void_p),
        ("weight", c_void_p),
        ("logits", c_void_p),
        ("ids", c_void_p),
        ("weights", c_void_p),
        ("arrivals", c_void_p),
        ("num_tokens", c_int32),
        ("hidden", c_int32),
        ("num_experts", c_int32),
        ("top_k", c_int32),
        ("renormalize", c_int32),
        ("shared_expert", c_int32),
    ]


class RouterNormParams(ctypes.Structure):
    """atlas_router_logits_norm / atlas_router_fused_norm (one token, ATLAS_NORM=fused): the
    router of add_rms_norm's output with the norm taken in, as LinearNormParams (router.x unused;
    block (0, 0) writes norm.out and norm.sum_out)."""

    _fields_ = [("router", RouterParams), ("norm", RmsNormParams)]


class MoeGateUpGemvParams(ctypes.Structure):
    """atlas_moe_gate_up_gemv (decode): per slot s = t*k + j, act[s] = silu_mul(gate_up[ids[s]] @ x[t]);
    with prefetch_down, each block pulls its share of down[ids[s]] into L2 for the down GEMV."""

    _fields_ = [
        ("x", c_void_p),
        ("ids", c_void_p),
        ("gate_up", c_void_p),
        ("act", c_void_p),
        ("down", c_void_p),  # [E, H, I] bf16: read only by the prefetch
        ("num_slots", c_int32),
        ("top_k", c_int32),
        ("hidden", c_int32),
        ("inter", c_int32),
        ("num_experts", c_int32),
        ("prefetch_down", c_int32),  # ATLAS_PREFETCH=l2
    ]


class MoeDownGemvParams(ctypes.Structure):
    """atlas_moe_down_gemv_k{k} (decode): out[t] = sum_j weights[t, j] * down[ids[t, j]] @ act[t*k + j];
    one entry per slot count k = top_k: num_experts_per_tok, and + 1 with the router's shared slot."""

    _fields_ = [
        ("act", c_void_p),
        ("ids", c_void_p),
        ("weights", c_void_p),
        ("down", c_void_p),
        ("out", c_void_p),
        ("num_tokens", c_int32),
        ("top_k", c_int32),
        ("hidden", c_int32),
        ("inter", c_int32),
        ("num_experts", c_int32),
    ]


class MoeRouteParams(ctypes.Structure):
    """atlas_moe_route (prefill): ids [T*k] -> counts [E], offsets [E+1], perm [T*k] (slot ids
    grouped by expert)."""

    _fields_ = [
        ("ids", c_void_p),
        ("counts", c_void_p),
        ("offsets", c_void_p),
        ("perm", c_void_p),
        ("num_slots", c_int32),
        ("num_experts", c_int32),
    ]


class MoeGroupedGemmParams(ctypes.Structure):
    """atlas_moe_grouped_gemm_gate_up / _down (prefill): one launch over (N tiles, M tiles, E).

    gate_up: a = x [T, H], out = act [T*k, I] (expert-major rows offsets[e] + m), n_out = I, k_in = H.
    down: a = act, out = y [T*k, H] (row = slot, scaled by the slot's routing weight), n_out = H, k_in = I.
    """

    _fields_ = [
        ("a", c_void_p),
        ("weight", c_void_p),
        ("counts", c_void_p),
        ("offsets", c_void_p),
        ("perm", c_void_p),
        ("route_weights", c_void_p),
        ("out", c_void_p),
        ("num_slots", c_int32),
        ("top_k", c_int32),
        ("n_out", c_int32),
        ("k_in", c_int32),
        ("num_experts", c_int32),
        ("pad", c_int32),
    ]


class MoeCombineParams(ctypes.Structure):
    """atlas_moe_combine (prefill): out[t] = sum_j y[t*k + j], summed in slot order."""

    _fields_ = [
        ("y", c_void_p),
        ("out", c_void_p),
        ("num_tokens", c_int32),
        ("top_k", c_int32),
        ("hidden", c_int32),
        ("pad", c_int32),
    ]


class AddSigmoidScaledParams(ctypes.Structure):
    """atlas_add_sigmoid_scaled: out = x + sigmoid(gate_logit[t]) * y, x, y [T, H], gate_logit [T, 1]."""

    _fields_ = [
        ("x", c_void_p),
        ("y", c_void_p),
        ("gate_logit", c_void_p),
        ("out", c_void_p),
        ("num_tokens", c_int32),
        ("hidden", c_int32),
    ]


ALL_PARAMS: tuple[type[ctypes.Structure], ...] = (
    CausalConv1dParams,
    GatedDeltaRuleParams,
    GatedDeltaChunkParams,
    GatedRmsNormParams,
    RouterParams,
    RouterNormParams,
    MoeGateUpGemvParams,
    MoeDownGemvParams,
    MoeRouteParams,
    MoeGroupedGemmParams,
    MoeCombineParams,
    AddSigmoidScaledParams,
)
