"""Op wrappers of the Gated DeltaNet and MoE kernels: `op(rt, ...)` with the arguments and
semantics of backends/base.py. Each computes its grid, fills the kernel's params struct and
launches; launch geometry constants mirror the kernel headers (the kernels refuse a block size
they were not written for, so a drift shows up as poisoned outputs in the GPU tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from atlas.kernel_params import linear_moe as kp

from . import norm_fusion
from .ops_common import FormSwitch, ceil_div as _ceil_div, expect as _expect

if TYPE_CHECKING:
    from ..base import DeltaNetOperands
    from .runtime import CudaRuntime
    from .tensor import DeviceTensor

# kernels/include/atlas/conv1d.cuh
CONV_THREADS = 128
CONV_TOKENS_PER_BLOCK = 64
# delta_rule.cuh
DELTA_THREADS = 128
DELTA_COLS_PER_BLOCK = 32
# delta_chunked.cuh
DELTA_CHUNK = 64
DELTA_PREP_THREADS = 256
# Prefill form of the delta rule: "recurrent" (default: walks the tokens) or "chunked" (the
# 64-token WY form; opt-in until the device has confirmed it).
DELTA_RULE_ENV = "ATLAS_DELTA_RULE"
DELTA_RULE_SWITCH = FormSwitch(DELTA_RULE_ENV, "delta rule form", ("recurrent", "chunked"))
# gated_norm.cuh
GATED_NORM_WARPS = 8
# router.cuh
ROUTER_WARPS = 8
# moe.cuh
GEMV_WARPS = 8
ROUTE_THREADS = 1024
GEMM_THREADS = 128
GEMM_BM = 64
GEMM_BN = 64
ELEMENTWISE_THREADS = 256
# Up to this many tokens the MoE runs as per-slot GEMVs (weights streamed once per slot);
# beyond, the grouped GEMM reads each routed expert once per 64-token tile.
MOE_GEMV_MAX_TOKENS = 8
# Router form: "split" (default: atlas_router_logits + atlas_router_top_k) or "fused" (one
# atlas_router_fused launch for steps of up to ROUTER_FUSED_MAX_TOKENS tokens: decode and
# speculative verify; longer prefills keep the split form). Opt-in until the device confirms it.
ROUTER_ENV = "ATLAS_ROUTER"
ROUTER_FORMS = ("split", "fused")
ROUTER_SWITCH = FormSwitch(ROUTER_ENV, "router form", ROUTER_FORMS)
ROUTER_FUSED_MAX_TOKENS = MOE_GEMV_MAX_TOKENS


@dataclass(frozen=True)
class _MoeCall:
    x: DeviceTensor  # [T, H] f32
    ids: DeviceTensor  # [T, k] i32
    weights: DeviceTensor  # [T, k] f32
    gate_up: DeviceTensor  # [E, 2I, H] bf16
    down: DeviceTensor  # [E, H, I] bf16
    out: DeviceTensor  # [T, H] f32

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        """(T, H, k, E, I)."""
        tokens, hidden = self.x.shape
        return tokens, hidden, self.ids.shape[-1], self.gate_up.shape[0], self.gate_up.shape[1] // 2


def _expect_dtype(name: str, t: DeviceTensor, *allowed: str) -> None:
    _expect(t.dtype in allowed, f"{name}: dtype {t.dtype}, expected {' or '.join(allowed)}")


def causal_conv1d(rt: CudaRuntime, x: DeviceTensor, weight: DeviceTensor, conv_state: DeviceTensor) -> DeviceTensor:
    tokens, channels = x.shape
    width = weight.shape[-1]
    _expect(weight.numel == channels * width, f"causal_conv1d: weight {weight.shape} vs x {x.shape}")
    _expect(conv_state.shape == (channels, width - 1), f"causal_conv1d: conv_state {conv_state.shape}, expected {(channels, width - 1)}")
    _expect_dtype("causal_conv1d x", x, "f32")
    _expect_dtype("causal_conv1d weight", weight, "f32", "bf16")
    _expect_dtype("causal_conv1d conv_state", conv_state, "f32")
    out = rt.empty((tokens, channels), "f32")
    params = kp.CausalConv1dParams(
        x=x.ptr, weight=weight.ptr, state=conv_state.ptr, out=out.ptr, num_tokens=tokens,
        channels=channels, kernel_width=width, weight_bf16=int(weight.dtype == "bf16"),
    )
    grid = (_ceil_div(channels, CONV_THREADS), _ceil_div(tokens, CONV_TOKENS_PER_BLOCK), 1)
    rt.launch("atlas_causal_conv1d", grid, (CONV_THREADS, 1, 1), params)
    return out


def gated_delta_rule(rt: CudaRuntime, mixed_qkv: DeviceTensor, a: DeviceTensor, b: DeviceTensor,
                     layer: DeltaNetOperands, *, chunked: bool | None = None) -> DeviceTensor:
    """Backend.gated_delta_rule (of `layer`: A_log, dt_bias, recurrent_state, num_k_heads).
    `chunked` None: the ATLAS_DELTA_RULE environment variable decides (prefill only)."""
    A_log, dt_bias, state, num_k_heads = layer.A_log, layer.dt_bias, layer.recurrent_state, layer.num_k_heads
    value_heads, k_dim, v_dim = state.shape
    tokens = mixed_qkv.shape[0]
    width = 2 * num_k_heads * k_dim + value_heads * v_dim
    _expect(mixed_qkv.shape == (tokens, width), f"gated_delta_rule: mixed_qkv {mixed_qkv.shape}, expected {(tokens, width)}")
    for name, t in (("a", a), ("b", b)):
        _expect(t.numel == tokens * value_heads, f"gated_delta_rule: {name} {t.shape}, expected {(tokens, value_heads)}")
    for name, t in (("mixed_qkv", mixed_qkv), ("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias), ("state", state)):
        _expect_dtype(f"gated_delta_rule {name}", t, "f32")
    _expect(v_dim % DELTA_COLS_PER_BLOCK == 0, f"gated_delta_rule: Dv {v_dim} not a multiple of {DELTA_COLS_PER_BLOCK}")
    out = rt.empty((tokens, value_heads, v_dim), "f32")
    if tokens > 1 and _delta_rule_chunked(chunked):
        _expect(k_dim % 32 == 0, f"gated_delta_rule: Dk {k_dim} not a multiple of 32 (chunked form)")
        _delta_chunked(rt, kp.GatedDeltaChunkParams(
            mixed_qkv=mixed_qkv.ptr, a=a.ptr, b=b.ptr, A_log=A_log.ptr, dt_bias=dt_bias.ptr, state=state.ptr,
            out=out.ptr, num_tokens=tokens, num_k_heads=num_k_heads, num_v_heads=value_heads,
            k_head_dim=k_dim, v_head_dim=v_dim,
        ))
        return out
    params = kp.GatedDeltaRuleParams(
        mixed_qkv=mixed_qkv.ptr, a=a.ptr, b=b.ptr, A_log=A_log.ptr, dt_bias=dt_bias.ptr, state=state.ptr,
        out=out.ptr, num_tokens=tokens, num_k_heads=num_k_heads, num_v_heads=value_heads,
        k_head_dim=k_dim, v_head_dim=v_dim,
    )
    grid = (value_heads, v_dim // DELTA_COLS_PER_BLOCK, 1)
    rt.launch("atlas_gated_delta_rule", grid, (DELTA_THREADS, 1, 1), params)
    return out


def _delta_rule_chunked(chunked: bool | None) -> bool:
    if chunked is not None:
        return chunked
    return DELTA_RULE_SWITCH.read() == "chunked"


def delta_prep_smem_bytes(k_dim: int) -> int:
    """delta_chunked.cuh chunk_prep_smem_bytes: k, q rows (stride Dk + 1), A (stride C + 1), cum, beta."""
    return 4 * (2 * DELTA_CHUNK * (k_dim + 1) + DELTA_CHUNK * (DELTA_CHUNK + 1) + 2 * DELTA_CHUNK)


def _delta_chunked(rt: CudaRuntime, p: kp.GatedDeltaChunkParams) -> None:
    """Scratch per (value head, chunk), then prep over all chunks and the scan over them in order."""
    heads, chunks, k_dim, v_dim = p.num_v_heads, _ceil_div(p.num_tokens, DELTA_CHUNK), p.k_head_dim, p.v_head_dim
    scratch = lambda *tail: rt.empty((heads, chunks, *tail), "f32").ptr  # noqa: E731
    p.num_chunks = chunks
    p.w, p.u, p.q_decayed = scratch(DELTA_CHUNK, k_dim), scratch(DELTA_CHUNK, v_dim), scratch(DELTA_CHUNK, k_dim)
    p.k_to_end, p.intra, p.chunk_decay = scratch(DELTA_CHUNK, k_dim), scratch(DELTA_CHUNK, DELTA_CHUNK), scratch(1)
    rt.launch("atlas_gated_delta_chunk_prep", (heads, chunks, 1), (DELTA_PREP_THREADS, 1, 1), p,
              delta_prep_smem_bytes(k_dim))
    rt.launch("atlas_gated_delta_chunk_scan", (heads, v_dim // DELTA_COLS_PER_BLOCK, 1), (DELTA_THREADS, 1, 1), p)


def gated_rms_norm(rt: CudaRuntime, x: DeviceTensor, z: DeviceTensor, weight: DeviceTensor, eps: float) -> DeviceTensor:
    dim = x.shape[-1]
    _expect(z.shape == x.shape, f"gated_rms_norm: z {z.shape} vs x {x.shape}")
    _expect(weight.numel == dim, f"gated_rms_norm: weight {weight.shape}, expected ({dim},)")
    for name, t in (("x", x), ("z", z), ("weight", weight)):
        _expect_dtype(f"gated_rms_norm {name}", t, "f32")
    rows = x.numel // dim
    out = rt.empty(x.shape, "f32")
    params = kp.GatedRmsNormParams(x=x.ptr, z=z.ptr, weight=weight.ptr, out=out.ptr, rows=rows, dim=dim, eps=eps)
    rt.launch("atlas_gated_rms_norm", (_ceil_div(rows, GATED_NORM_WARPS), 1, 1), (GATED_NORM_WARPS * 32, 1, 1), params)
    return out


def router_form(form: str | None = None) -> str:
    """`form`, or with None the ATLAS_ROUTER environment variable (default "split"), checked."""
    return ROUTER_SWITCH.read(form)


def router_arrivals(rt: CudaRuntime) -> DeviceTensor:
    """The fused router's per-token arrival counters [ROUTER_FUSED_MAX_TOKENS]: zeroed once here,
    persistent (a captured graph holds their address), and left at zero by every launch."""
    return rt.zeros((ROUTER_FUSED_MAX_TOKENS,), "i32")


def router(
    rt: CudaRuntime,
    x: DeviceTensor,
    weight: DeviceTensor,
    top_k: int,
    renormalize: bool,
    *,
    shared_expert: bool = False,
    arrivals: DeviceTensor | None = None,
) -> tuple[DeviceTensor, DeviceTensor]:
    """`shared_expert`: weight [E + 1, H], row E the shared expert's gate -> one more slot per token
    (id E, weight sigmoid(logit E)) after the k routed ones (base.py). `arrivals` (router_arrivals):
    steps of at most arrivals.numel tokens run as one atlas_router_fused launch."""
    tokens, hidden = x.shape
    shared = int(shared_expert)
    columns = weight.shape[0]  # E (+ 1 with the shared gate)
    experts = columns - shared
    _expect(weight.shape == (columns, hidden), f"router: weight {weight.shape}, expected (E, {hidden})")
    _expect(0 < top_k <= experts, f"router: top_k {top_k} outside 1..{experts}")
    _expect(hidden % 8 == 0, f"router: hidden {hidden} not a multiple of 8 (16-byte weight loads)")
    _expect_dtype("router x", x, "f32")
    _expect_dtype("router weight", weight, "bf16")
    fused = arrivals is not None and tokens <= arrivals.numel
    if arrivals is not None:
        _expect_dtype("router arrivals", arrivals, "i32")
    logits = rt.empty((tokens, columns), "f32")  # [T, E (+ 1)]
    ids = rt.empty((tokens, top_k + shared), "i32")
    weights = rt.empty((tokens, top_k + shared), "f32")
    params = kp.RouterParams(
        x=x.ptr, weight=weight.ptr, logits=logits.ptr, ids=ids.ptr, weights=weights.ptr,
        arrivals=arrivals.ptr if fused else None, num_tokens=tokens, hidden=hidden, num_experts=experts,
        top_k=top_k, renormalize=int(renormalize), shared_expert=shared,
    )
    grid = (tokens, _ceil_div(columns, ROUTER_WARPS), 1)
    entry = "atlas_router_fused" if fused else "atlas_router_logits"
    # One token of a deferred add_rms_norm's output: the norm taken in (norm_fusion.py).
    norm = norm_fusion.take_norm(rt, x, ROUTER_WARPS * 32) if tokens == 1 else None
    if norm is None:
        rt.launch(entry, grid, (ROUTER_WARPS * 32, 1, 1), params)
    else:
        rt.launch(f"{entry}_norm", grid, (ROUTER_WARPS * 32, 1, 1), kp.RouterNormParams(router=params, norm=norm))
    if not fused:
        rt.launch("atlas_router_top_k", (tokens, 1, 1), (32, 1, 1), params)
    return ids, weights


def moe_experts(
    rt: CudaRuntime, x: DeviceTensor, ids: DeviceTensor, weights: DeviceTensor, gate_up: DeviceTensor, down: DeviceTensor
) -> DeviceTensor:
    tokens, hidden = x.shape
    top_k = ids.shape[-1]
    experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    _expect(gate_up.shape == (experts, 2 * inter, hidden), f"moe_experts: gate_up {gate_up.shape} vs x {x.shape}")
    _expect(down.shape == (experts, hidden, inter), f"moe_experts: down {down.shape}, expected {(experts, hidden, inter)}")
    _expect(ids.numel == tokens * top_k and weights.numel == tokens * top_k, f"moe_experts: ids {ids.shape} / weights {weights.shape} vs {tokens} tokens")
    _expect(hidden % 8 == 0 and inter % 8 == 0, f"moe_experts: hidden {hidden} and inter {inter} must be multiples of 8")
    for name, t, dtype in (("x", x, "f32"), ("ids", ids, "i32"), ("weights", weights, "f32"), ("gate_up", gate_up, "bf16"), ("down", down, "bf16")):
        _expect_dtype(f"moe_experts {name}", t, dtype)
    out = rt.empty((tokens, hidden), "f32")
    call = _MoeCall(x, ids, weights, gate_up, down, out)  # decode: the down GEMV entry of k = ids width
    if tokens <= MOE_GEMV_MAX_TOKENS:
        _moe_gemv(rt, call)
    else:
        _moe_grouped(rt, call)
    return out


def _moe_gemv(rt: CudaRuntime, c: _MoeCall) -> None:
    tokens, hidden, top_k, experts, inter = c.dims
    slots = tokens * top_k
    act = rt.empty((slots, inter), "f32")  # [T*k, I]
    block = (GEMV_WARPS * 32, 1, 1)
    gate_up_params = kp.MoeGateUpGemvParams(
        x=c.x.ptr, ids=c.ids.ptr, gate_up=c.gate_up.ptr, act=act.ptr, down=c.down.ptr, num_slots=slots, top_k=top_k,
        hidden=hidden, inter=inter, num_experts=experts, prefetch_down=int(rt.prefetch),
    )
    rt.launch("atlas_moe_gate_up_gemv", (_ceil_div(inter, GEMV_WARPS), slots, 1), block, gate_up_params)
    down_params = kp.MoeDownGemvParams(
        act=act.ptr, ids=c.ids.ptr, weights=c.weights.ptr, down=c.down.ptr, out=c.out.ptr, num_tokens=tokens,
        top_k=top_k, hidden=hidden, inter=inter, num_experts=experts,
    )
    rt.launch(f"atlas_moe_down_gemv_k{top_k}", (_ceil_div(hidden, GEMV_WARPS), tokens, 1), block, down_params)


@dataclass(frozen=True)
class MoeRouting:
    """The slots grouped by expert on the device (atlas_moe_route), read by the grouped GEMMs."""

    counts: DeviceTensor  # [E] i32
    offsets: DeviceTensor  # [E + 1] i32
    perm: DeviceTensor  # [T*k] i32: slots in expert-major order

    def gemm_fields(self, route_weights: DeviceTensor, top_k: int) -> dict[str, int]:
        """The routing fields of a grouped GEMM's params (MoeGroupedGemmParams, MoeQuantGemmParams)."""
        return dict(counts=self.counts.ptr, offsets=self.offsets.ptr, perm=self.perm.ptr, route_weights=route_weights.ptr,
                    num_slots=self.perm.numel, top_k=top_k, num_experts=self.counts.numel)


def moe_route(rt: CudaRuntime, ids: DeviceTensor, experts: int) -> MoeRouting:
    """Group the [T, k] expert ids by expert (device memory only, so a captured step replays)."""
    routing = MoeRouting(rt.empty((experts,), "i32"), rt.empty((experts + 1,), "i32"), rt.empty((ids.numel,), "i32"))
    route = kp.MoeRouteParams(ids=ids.ptr, counts=routing.counts.ptr, offsets=routing.offsets.ptr, perm=routing.perm.ptr,
                              num_slots=ids.numel, num_experts=experts)
    rt.launch("atlas_moe_route", (1, 1, 1), (ROUTE_THREADS, 1, 1), route, 2 * experts * 4)
    return routing


def moe_combine(rt: CudaRuntime, y: DeviceTensor, out: DeviceTensor, top_k: int) -> None:
    """out [T, H] = the sum of each token's k weighted slot rows y [T*k, H], in slot order."""
    tokens, hidden = out.shape
    combine = kp.MoeCombineParams(y=y.ptr, out=out.ptr, num_tokens=tokens, top_k=top_k, hidden=hidden)
    quads = tokens * hidden // 4
    rt.launch("atlas_moe_combine", (_ceil_div(quads, ELEMENTWISE_THREADS), 1, 1), (ELEMENTWISE_THREADS, 1, 1), combine)


def _moe_grouped(rt: CudaRuntime, c: _MoeCall) -> None:
    tokens, hidden, top_k, experts, inter = c.dims
    routing = moe_route(rt, c.ids, experts)
    act = rt.empty((tokens * top_k, inter), "f32")  # [T*k, I], expert-major rows
    y = rt.empty((tokens * top_k, hidden), "f32")  # [T*k, H], one row per slot
    rt.memset_zero(y)  # slots with an invalid expert id stay zero
    m_tiles = _ceil_div(tokens, GEMM_BM)  # an expert has <= T rows; blocks loop over any extra tiles
    common = routing.gemm_fields(c.weights, top_k)
    gate_up_params = kp.MoeGroupedGemmParams(a=c.x.ptr, weight=c.gate_up.ptr, out=act.ptr, n_out=inter, k_in=hidden, **common)
    grid = (_ceil_div(inter, GEMM_BN // 2), m_tiles, experts)
    rt.launch("atlas_moe_grouped_gemm_gate_up", grid, (GEMM_THREADS, 1, 1), gate_up_params)
    down_params = kp.MoeGroupedGemmParams(a=act.ptr, weight=c.down.ptr, out=y.ptr, n_out=hidden, k_in=inter, **common)
    rt.launch("atlas_moe_grouped_gemm_down", (_ceil_div(hidden, GEMM_BN), m_tiles, experts), (GEMM_THREADS, 1, 1), down_params)
    moe_combine(rt, y, c.out, top_k)


def add_sigmoid_scaled(rt: CudaRuntime, x: DeviceTensor, y: DeviceTensor, gate_logit: DeviceTensor) -> DeviceTensor:
    tokens, hidden = x.shape
    _expect(y.shape == x.shape, f"add_sigmoid_scaled: y {y.shape} vs x {x.shape}")
    _expect(gate_logit.numel == tokens, f"add_sigmoid_scaled: gate_logit {gate_logit.shape}, expected ({tokens}, 1)")
    _expect(hidden % 4 == 0, f"add_sigmoid_scaled: hidden {hidden} not a multiple of 4")
    for name, t in (("x", x), ("y", y), ("gate_logit", gate_logit)):
        _expect_dtype(f"add_sigmoid_scaled {name}", t, "f32")
    out = rt.empty((tokens, hidden), "f32")
    params = kp.AddSigmoidScaledParams(x=x.ptr, y=y.ptr, gate_logit=gate_logit.ptr, out=out.ptr, num_tokens=tokens, hidden=hidden)
    quads = tokens * hidden // 4
    rt.launch("atlas_add_sigmoid_scaled", (_ceil_div(quads, ELEMENTWISE_THREADS), 1, 1), (ELEMENTWISE_THREADS, 1, 1), params)
    return out
