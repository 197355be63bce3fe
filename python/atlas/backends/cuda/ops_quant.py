"""Op wrappers of the quantized kernels (fp8 block W8A16, nvfp4 W4A16): `linear` and `moe_experts`
of backends/base.py with a QuantWeight (quant_weights.py) in place of the bf16 matrix. Grids come
from shapes only; the MoE reads its routing (counts, offsets, perm) from device memory, so a
captured decode step replays correctly. Geometry constants mirror the headers named beside them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from atlas.kernel_params import quant as kp

from .ops_common import INT32_MAX, ceil_div as _ceil_div, expect as _expect
from .ops_dense import GemvGeometry, gemv, gemv_taking_norm
from .ops_linear_moe import moe_combine, moe_route
from .quant_weights import CHUNK, QuantWeight

if TYPE_CHECKING:
    from .runtime import CudaRuntime
    from .tensor import DeviceTensor

GEMV_MAX_TOKENS = 8  # linear_<fmt>.cu.j2 instantiates t1 .. t8
GEMV_THREADS = 256  # gemv_quant.cuh kQGemvThreads
GEMV_WIDE_ROWS_PER_BLOCK = 32  # 8 warps x kQGemvWideRows
GEMV_NARROW_ROWS_PER_BLOCK = 8  # 8 warps x kQGemvNarrowRows
GEMV_WIDE_MIN_WAVES = 2  # as ops_dense: wide blocks only when they fill every SM twice
QUANT_GEMV = GemvGeometry(GEMV_THREADS, GEMV_WIDE_ROWS_PER_BLOCK, GEMV_NARROW_ROWS_PER_BLOCK, GEMV_WIDE_MIN_WAVES)
GEMM_THREADS = 128  # gemm.cuh kGemmThreads
GEMM_BM = 64
GEMM_BN = 128
MOE_THREADS = 128  # moe.cuh kGemmThreads
MOE_BM = 64
MOE_BN = 64
MOE_GEMV_THREADS = 256  # moe_quant.cuh decode GEMVs: kQGemvThreads, one warp per output row
MOE_GEMV_ROWS_PER_BLOCK = 8
MOE_GEMV_MAX_TOKENS = 8  # as ops_linear_moe: per-slot GEMVs up to here, the grouped GEMM above


def _check_weight(op: str, w: QuantWeight, k: int) -> None:
    _expect(w.k == k, f"{op}: x in-features {k} vs weight {w.shape}")
    _expect(k % CHUNK == 0, f"{op}: in-features {k} not a multiple of {CHUNK}")
    _expect(w.q.dtype == "u8", f"{op}: packed weight dtype {w.q.dtype}, expected u8")
    _expect(w.scale.dtype == ("f32" if w.format == "fp8" else "u8"), f"{op}: {w.format} scale dtype {w.scale.dtype}")
    _expect(w.format == "fp8" or w.row_scale is not None, f"{op}: nvfp4 weight without its row scales")


def linear(rt: CudaRuntime, x: DeviceTensor, w: QuantWeight) -> DeviceTensor:
    """out [..., n] = x [..., k] @ dequant(w).T, f32."""
    n, k = w.shape[-2:]
    _expect(len(w.shape) == 2, f"linear: weight shape {w.shape}, expected (n, k)")
    _expect(x.shape[-1] == k, f"linear: x {x.shape} vs weight {w.shape}")
    _expect(x.dtype == "f32", f"linear: x dtype {x.dtype}, expected f32")
    _check_weight("linear", w, k)
    tokens = x.numel // k
    _expect(tokens * max(n, k) <= INT32_MAX, f"linear: {tokens} x {max(n, k)} exceeds int32 indexing")
    out = rt.empty((*x.shape[:-1], n), "f32")
    if tokens == 0 or n == 0:
        return out
    params = kp.QuantLinearParams(x=x.ptr, weight=w.q.ptr, scale=w.scale.ptr, row_scale=w.row_scale_ptr,
                                  out=out.ptr, tokens=tokens, n=n, k=k)
    if tokens > GEMV_MAX_TOKENS:
        grid = (_ceil_div(n, GEMM_BN), _ceil_div(tokens, GEMM_BM), 1)
        rt.launch(f"atlas_qgemm_{w.format}", grid, (GEMM_THREADS, 1, 1), params)
    elif not (tokens == 1 and gemv_taking_norm(rt, x, params, f"atlas_qgemv_{w.format}", kp.QuantLinearNormParams,
                                               QUANT_GEMV)):
        gemv(rt, f"atlas_qgemv_{w.format}", params, QUANT_GEMV)
    return out


def _check_moe(x: DeviceTensor, ids: DeviceTensor, weights: DeviceTensor, gate_up: QuantWeight, down: QuantWeight) -> None:
    tokens, hidden = x.shape
    top_k = ids.shape[-1]
    _expect(len(gate_up.shape) == 3 and len(down.shape) == 3, f"moe_experts: stacked shapes {gate_up.shape} / {down.shape}")
    experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    _expect(gate_up.shape == (experts, 2 * inter, hidden), f"moe_experts: gate_up {gate_up.shape} vs x {x.shape}")
    _expect(down.shape == (experts, hidden, inter), f"moe_experts: down {down.shape}, expected {(experts, hidden, inter)}")
    _expect(gate_up.format == down.format, f"moe_experts: gate_up {gate_up.format} vs down {down.format}")
    _expect(ids.numel == tokens * top_k and weights.numel == tokens * top_k, f"moe_experts: ids {ids.shape} / weights {weights.shape} vs {tokens} tokens")
    for name, t, dtype in (("x", x, "f32"), ("ids", ids, "i32"), ("weights", weights, "f32")):
        _expect(t.dtype == dtype, f"moe_experts: {name} dtype {t.dtype}, expected {dtype}")
    _check_weight("moe_experts gate_up", gate_up, hidden)
    _check_weight("moe_experts down", down, inter)


def moe_experts(rt: CudaRuntime, x: DeviceTensor, ids: DeviceTensor, weights: DeviceTensor,
                gate_up: QuantWeight, down: QuantWeight) -> DeviceTensor:
    """base.py moe_experts over quantized experts. Decode: per-slot GEMVs. Prefill: route, grouped
    gate_up (silu_mul fused), grouped down (rows scaled by the routing weight), combine in slot order."""
    _check_moe(x, ids, weights, gate_up, down)
    tokens, hidden = x.shape
    out = rt.empty((tokens, hidden), "f32")
    if tokens == 0:
        return out
    if tokens <= MOE_GEMV_MAX_TOKENS:
        _moe_gemv(rt, (x, ids, weights, out), gate_up, down)
    else:
        _moe_grouped(rt, (x, ids, weights, out), gate_up, down)
    return out


def _moe_gemv(rt: CudaRuntime, io: tuple[DeviceTensor, ...], gate_up: QuantWeight, down: QuantWeight) -> None:
    x, ids, weights, out = io
    tokens, hidden = x.shape
    top_k = ids.shape[-1]
    experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    act = rt.empty((tokens * top_k, inter), "f32")  # [T*k, I]
    common = dict(ids=ids.ptr, route_weights=weights.ptr, num_tokens=tokens, top_k=top_k, hidden=hidden,
                  inter=inter, num_experts=experts)
    block = (MOE_GEMV_THREADS, 1, 1)
    gate_up_params = kp.MoeQuantGemvParams(x=x.ptr, weight=gate_up.q.ptr, scale=gate_up.scale.ptr,
                                           row_scale=gate_up.row_scale_ptr, out=act.ptr, **common)
    grid = (_ceil_div(inter, MOE_GEMV_ROWS_PER_BLOCK), tokens * top_k, 1)
    rt.launch(f"atlas_moe_qgemv_{gate_up.format}_gate_up", grid, block, gate_up_params)
    down_params = kp.MoeQuantGemvParams(x=act.ptr, weight=down.q.ptr, scale=down.scale.ptr,
                                        row_scale=down.row_scale_ptr, out=out.ptr, **common)
    grid = (_ceil_div(hidden, MOE_GEMV_ROWS_PER_BLOCK), tokens, 1)
    rt.launch(f"atlas_moe_qgemv_{down.format}_down_k{top_k}", grid, block, down_params)


def _moe_grouped(rt: CudaRuntime, io: tuple[DeviceTensor, ...], gate_up: QuantWeight, down: QuantWeight) -> None:
    x, ids, weights, out = io
    tokens, hidden = x.shape
    top_k = ids.shape[-1]
    experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    routing = moe_route(rt, ids, experts)
    act = rt.empty((tokens * top_k, inter), "f32")  # [T*k, I], expert-major rows
    y = rt.empty((tokens * top_k, hidden), "f32")  # [T*k, H], one row per slot
    rt.memset_zero(y)  # slots with an invalid expert id stay zero
    m_tiles = _ceil_div(tokens, MOE_BM)  # an expert has <= T rows; blocks loop over any extra tiles
    common = routing.gemm_fields(weights, top_k)
    fmt = gate_up.format
    gate_up_params = kp.MoeQuantGemmParams(a=x.ptr, weight=gate_up.q.ptr, scale=gate_up.scale.ptr,
                                           row_scale=gate_up.row_scale_ptr, out=act.ptr, n_out=inter, k_in=hidden, **common)
    grid = (_ceil_div(inter, MOE_BN // 2), m_tiles, experts)
    rt.launch(f"atlas_moe_qgemm_{fmt}_gate_up", grid, (MOE_THREADS, 1, 1), gate_up_params)
    down_params = kp.MoeQuantGemmParams(a=act.ptr, weight=down.q.ptr, scale=down.scale.ptr,
                                        row_scale=down.row_scale_ptr, out=y.ptr, n_out=hidden, k_in=inter, **common)
    rt.launch(f"atlas_moe_qgemm_{fmt}_down", (_ceil_div(hidden, MOE_BN), m_tiles, experts), (MOE_THREADS, 1, 1), down_params)
    moe_combine(rt, y, out, top_k)
