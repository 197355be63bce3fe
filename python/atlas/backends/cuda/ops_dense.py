"""Op wrappers of the dense kernels: `op(rt, ...)` with the arguments and semantics of
backends/base.py. Each checks shapes and dtypes, computes its grid from shapes only (never from
device data, so a captured decode step replays correctly), fills the kernel's params struct and
launches. Launch geometry constants mirror the kernel headers named beside them."""

from __future__ import annotations

import ctypes

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from atlas.errors import AtlasError
from atlas.kernel_params import dense as kp
from atlas.sampling import check_sampling

from ..base import LogprobTensors, SamplingParams
from . import norm_fusion
from .ops_common import INT32_MAX, FormSwitch, ceil_div as _ceil_div, expect as _expect

if TYPE_CHECKING:
    from ..base import AttentionInputs, AttentionOperands, KVCache, PenaltyOperands
    from .runtime import CudaRuntime
    from .tensor import DeviceTensor

WARP = 32
ELEMENTWISE_THREADS = 256  # elementwise.cu.j2 launch bounds
ELEMENTWISE_MAX_BLOCKS = 1 << 16  # grid-stride loops cover the rest
EMBEDDING_THREADS = 256  # embedding.cu.j2
NORM_THREADS = 256  # norm.cuh: one block per row, more for long rows
NORM_MAX_THREADS = 512  # norm.cuh kNormMaxThreads (launch bound)
NORM_VECS = 4  # norm.cuh kNormVecs: a thread holds 4 float4 of its row in registers
GEMV_MAX_TOKENS = 8  # linear.cu.j2 instantiates atlas_gemv_t1 .. t8
GEMV_THREADS = 256  # gemv.cuh kGemvThreads
GEMV_WIDE_ROWS_PER_BLOCK = 32  # gemv.cuh: 8 warps x kGemvWideRows
GEMV_NARROW_ROWS_PER_BLOCK = 8  # 8 warps x kGemvNarrowRows
GEMV_WIDE_MIN_WAVES = 2  # wide blocks only when they fill every SM at least this many times
# Under ATLAS_PREFETCH=l2 a bf16 GEMV's first blocks pull their weight rows into L2 before their
# pdl_enter (gemv.cuh gemv_prefetch): the rows stream in while x is staged, and under
# ATLAS_LAUNCH=pdl while the previous kernel still runs. As many blocks as this many bytes cover, a
# third of an H200's L2 (more, and the prefetched rows of later blocks would evict each other).
PREFETCH_BYTES = 16 << 20
GEMM_THREADS = 128  # gemm.cuh kGemmThreads
GEMM_BM = 64
GEMM_BN = 128
# Prefill GEMM (T > GEMV_MAX_TOKENS): "mma" (default: atlas_gemm_bf16, mma.sync, every target) or
# "wgmma" (atlas_gemm_wgmma, warpgroup MMA; h200 tuples only; opt-in until the device confirms it).
GEMM_ENV = "ATLAS_GEMM"
GEMM_FORMS = ("mma", "wgmma")
GEMM_SWITCH = FormSwitch(GEMM_ENV, "prefill GEMM form", GEMM_FORMS)
WGMMA_CC = (9, 0)  # sm_90a cubin: the h200 tuple (h100 is its alias)
WGMMA_THREADS = 256  # gemm_wgmma.cuh kWgmmaThreads: 2 warpgroups
WGMMA_BM = 128  # kWgmmaBM
WGMMA_BN = 128  # kWgmmaBN
WGMMA_BK = 64  # kWgmmaBK
WGMMA_STAGES = 6  # kWgmmaStages: W tiles in the cp.async ring
# kWgmmaSmemBytes: 2 A tiles and the W ring (bf16 [128][64] each), 1024 B to realign the base
WGMMA_SMEM = (2 + WGMMA_STAGES) * WGMMA_BM * WGMMA_BK * 2 + 1024
ROPE_THREADS = 128  # rope.cuh kRopeThreads
ATTN_KEYS = 32  # attention.cuh kAttnKeys
ATTN_DECODE_MAX_TOKENS = 4  # up to here: split-K flash-decoding + combine
ATTN_DECODE_THREADS = 128  # attention.cu.j2: 4 warps x 1 row
ATTN_DECODE_ROWS = 4
ATTN_PREFILL_THREADS = 256  # 8 warps x 2 rows
ATTN_PREFILL_ROWS = 16
ATTN_MAX_SPLITS = 256
ATTN_MAX_ROW_TILES = 65535  # the prefill grid's z (row tiles): the launch limit of gridDim.z
ATTN_HEAD_DIMS = (64, 128, 256)
ATTN_MMA_ROWS = 64  # attention_mma.cuh kMmaAttnRows: 4 warps x 16 rows
ATTN_MMA_THREADS = 128  # kMmaAttnThreads
ATTN_MMA_KEYS = 32  # kMmaAttnKeys
ATTN_MMA_PAD = 8  # kMmaAttnPad (bf16 per smem row)
# Prefill attention for T > ATTN_DECODE_MAX_TOKENS: "mma" (tensor cores; the default since an H200
# confirmed it, 2026-12-04: 184 against 1825 us per Qwen3.6 layer at 2048 tokens) or "simt"
# (atlas_attention_prefill, f32 FMA).
PREFILL_ATTENTION_ENV = "ATLAS_PREFILL_ATTENTION"
PREFILL_ATTENTION_FORMS = ("mma", "simt")
PREFILL_ATTENTION_SWITCH = FormSwitch(PREFILL_ATTENTION_ENV, "prefill attention form", PREFILL_ATTENTION_FORMS)
# Full attention's head norms, rotary and cache write over a bf16 cache: "separate" (default: two
# atlas_head_norm_rope launches and atlas_kv_cache_write) or "fused" (atlas_attention_prep, one
# launch; opt-in until the device has confirmed it).
ATTENTION_PREP_ENV = "ATLAS_ATTENTION_PREP"
ATTENTION_PREP_FORMS = ("separate", "fused")
ATTENTION_PREP_SWITCH = FormSwitch(ATTENTION_PREP_ENV, "attention prep form", ATTENTION_PREP_FORMS)
ARGMAX_THREADS = 256  # sampling.cuh kArgmaxThreads
ARGMAX_CHUNK = 2048
SAMPLE_THREADS = 1024  # sampling.cuh kSampleThreads
# The sampled draw: "block" (default: atlas_sample, one block over the row) or "split" (five
# launches whose whole-row passes run over the GPU, sampling_split.cuh; opt-in until the device has
# timed and confirmed it: the H200 sampled at 150 tok/s against greedy's 279, 2026-12-04).
SAMPLE_ENV = "ATLAS_SAMPLE"
SAMPLE_FORMS = ("block", "split")
SAMPLE_SWITCH = FormSwitch(SAMPLE_ENV, "sampling form", SAMPLE_FORMS)
SAMPLE_UNITS = 1024  # sampling_split.cuh kSampleUnits
SAMPLE_UNIT_WARPS = 8  # kSampleUnitWarps: units per block of the grid launches
SAMPLE_SCRATCH_BYTES = 65536  # kSampleScratchBytes
PENALIZE_THREADS = 256  # sampling.cuh kPenalizeThreads


def _expect_dtype(op: str, name: str, t: DeviceTensor, *allowed: str) -> None:
    _expect(t.dtype in allowed, f"{op}: {name} dtype {t.dtype}, expected {' or '.join(allowed)}")


def _expect_int32(op: str, count: int) -> None:
    _expect(count <= INT32_MAX, f"{op}: {count} elements exceed the kernels' int32 indexing")


def _elementwise_grid(n: int) -> tuple[int, int, int]:
    return (max(1, min(_ceil_div(n, ELEMENTWISE_THREADS), ELEMENTWISE_MAX_BLOCKS)), 1, 1)


def embedding(rt: CudaRuntime, table: DeviceTensor, ids: DeviceTensor) -> DeviceTensor:
    vocab, hidden = table.shape
    _expect_dtype("embedding", "table", table, "bf16", "f32")
    _expect_dtype("embedding", "ids", ids, "i32")
    tokens = ids.numel
    out = rt.empty((tokens, hidden), "f32")
    if tokens == 0:
        return out
    params = kp.EmbeddingParams(table=table.ptr, ids=ids.ptr, out=out.ptr, tokens=tokens, hidden=hidden, vocab=vocab)
    rt.launch(f"atlas_embedding_{table.dtype}", (tokens, 1, 1), (EMBEDDING_THREADS, 1, 1), params)
    return out


def norm_threads(dim: int) -> int:
    """NORM_THREADS, or up to NORM_MAX_THREADS so that a row of `dim` floats fits in the threads'
    registers."""
    return min(NORM_MAX_THREADS, max(NORM_THREADS, _ceil_div(dim, 4 * NORM_VECS * 32) * 32))


def _rms_norm_launch(rt: CudaRuntime, kernel: str, params: kp.RmsNormParams) -> None:
    if params.rows:
        rt.launch(kernel, (params.rows, 1, 1), (norm_threads(params.dim), 1, 1), params)


def rms_norm(rt: CudaRuntime, x: DeviceTensor, weight: DeviceTensor, eps: float) -> DeviceTensor:
    dim = x.shape[-1]
    _expect(weight.numel == dim, f"rms_norm: weight {weight.shape} vs x {x.shape}")
    _expect_dtype("rms_norm", "x", x, "f32")
    _expect_dtype("rms_norm", "weight", weight, "f32")
    out = rt.empty(x.shape, "f32")
    params = kp.RmsNormParams(x=x.ptr, residual=None, weight=weight.ptr, out=out.ptr, sum_out=None,
                              rows=x.numel // dim, dim=dim, eps=eps)
    _rms_norm_launch(rt, "atlas_rms_norm", params)
    return out


def add_rms_norm(
    rt: CudaRuntime, x: DeviceTensor, residual: DeviceTensor, weight: DeviceTensor, eps: float, *, defer: bool = False
) -> tuple[DeviceTensor, DeviceTensor]:
    """defer (ATLAS_NORM=fused): one row held in registers waits for the kernel that reads it
    (norm_fusion.py)."""
    dim = x.shape[-1]
    _expect(residual.shape == x.shape, f"add_rms_norm: residual {residual.shape} vs x {x.shape}")
    _expect(weight.numel == dim, f"add_rms_norm: weight {weight.shape} vs x {x.shape}")
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        _expect_dtype("add_rms_norm", name, t, "f32")
    out = rt.empty(x.shape, "f32")
    total = rt.empty(x.shape, "f32")
    params = kp.RmsNormParams(x=x.ptr, residual=residual.ptr, weight=weight.ptr, out=out.ptr, sum_out=total.ptr,
                              rows=x.numel // dim, dim=dim, eps=eps)
    tensors = (out, total, x, residual, weight)
    if defer and params.rows == 1 and _norm_in_registers(dim, tensors):
        norm_fusion.defer_add_rms_norm(rt, params, norm_threads(dim), tensors)
    else:
        _rms_norm_launch(rt, "atlas_add_rms_norm", params)
    return out, total


def _norm_in_registers(dim: int, tensors: tuple[DeviceTensor, ...]) -> bool:
    """norm.cuh norm_fits_registers: the path a consumer's stage_add_rms_norm takes."""
    aligned = all(t.ptr % 16 == 0 for t in tensors)
    return aligned and dim % 4 == 0 and dim <= 4 * NORM_VECS * norm_threads(dim)


def add(rt: CudaRuntime, x: DeviceTensor, y: DeviceTensor) -> DeviceTensor:
    _expect(x.shape == y.shape, f"add: shapes {x.shape} and {y.shape}")
    _expect_dtype("add", "x", x, "f32")
    _expect_dtype("add", "y", y, "f32")
    _expect_int32("add", x.numel)
    out = rt.empty(x.shape, "f32")
    if x.numel:
        params = kp.AddParams(x=x.ptr, y=y.ptr, out=out.ptr, n=x.numel)
        rt.launch("atlas_add", _elementwise_grid(x.numel), (ELEMENTWISE_THREADS, 1, 1), params)
    return out


def silu_mul(rt: CudaRuntime, gate_up: DeviceTensor) -> DeviceTensor:
    _expect(gate_up.shape[-1] % 2 == 0, f"silu_mul: last dim of {gate_up.shape} is odd")
    _expect_dtype("silu_mul", "gate_up", gate_up, "f32")
    _expect_int32("silu_mul", gate_up.numel)
    width = gate_up.shape[-1] // 2
    out = rt.empty((*gate_up.shape[:-1], width), "f32")
    if out.numel:
        params = kp.SiluMulParams(gate_up=gate_up.ptr, out=out.ptr, rows=out.numel // width, width=width)
        rt.launch("atlas_silu_mul", _elementwise_grid(out.numel), (ELEMENTWISE_THREADS, 1, 1), params)
    return out


def sigmoid_mul(rt: CudaRuntime, x: DeviceTensor, gate: DeviceTensor) -> DeviceTensor:
    _expect(x.shape == gate.shape, f"sigmoid_mul: shapes {x.shape} and {gate.shape}")
    _expect_dtype("sigmoid_mul", "x", x, "f32")
    _expect_dtype("sigmoid_mul", "gate", gate, "f32")
    _expect_int32("sigmoid_mul", x.numel)
    out = rt.empty(x.shape, "f32")
    if x.numel:
        params = kp.SigmoidMulParams(x=x.ptr, gate=gate.ptr, out=out.ptr, n=x.numel)
        rt.launch("atlas_sigmoid_mul", _elementwise_grid(x.numel), (ELEMENTWISE_THREADS, 1, 1), params)
    return out


def nonfinite_count(rt: CudaRuntime, x: DeviceTensor) -> DeviceTensor:
    _expect_dtype("nonfinite_count", "x", x, "f32")
    _expect(x.numel < 1 << 24, f"nonfinite_count: {x.numel} values; the kernel counts in f32, exact below 2^24")
    out = rt.empty((1,), "i32")
    params = kp.NonfiniteCountParams(x=x.ptr, out=out.ptr, n=x.numel)
    rt.launch("atlas_nonfinite_count", (1, 1, 1), (ELEMENTWISE_THREADS, 1, 1), params)
    return out


def gemm_form(rt: CudaRuntime, form: str | None = None) -> str:
    """`form`, or with None the ATLAS_GEMM environment variable (default "mma"), checked; "wgmma"
    also against the device's compute capability. The CUDA backend reads it once, when it is built."""
    chosen = GEMM_SWITCH.read(form)
    if chosen != "wgmma":
        return chosen
    cc = tuple(rt.info.cc)
    if cc != WGMMA_CC:
        raise AtlasError(f"{GEMM_ENV}=wgmma needs an h200/h100 GPU (compute capability 9.0), this one is "
                         f"{cc[0]}.{cc[1]}; unset {GEMM_ENV}")
    if rt.image.sm != WGMMA_CC[0] * 10:  # another tuple's PTX JIT-compiled for this GPU: no wgmma kernel in it
        raise AtlasError(f"{GEMM_ENV}=wgmma needs the h200 tuple's kernels; the loaded {rt.image.label} is built "
                         f"for sm_{rt.image.sm}; unset {GEMM_ENV}, or install the h200 tuple")
    return chosen


def gemm(rt: CudaRuntime, params: kp.LinearParams, form: str = "mma") -> None:
    """The prefill GEMM of `params` (any tokens >= 1; linear() sends it tokens > GEMV_MAX_TOKENS)."""
    _expect(form in GEMM_FORMS, f"linear: GEMM form {form!r}, expected one of {GEMM_FORMS}")
    if form == "wgmma":
        grid = (_ceil_div(params.n, WGMMA_BN), _ceil_div(params.tokens, WGMMA_BM), 1)
        rt.launch("atlas_gemm_wgmma", grid, (WGMMA_THREADS, 1, 1), params, smem=WGMMA_SMEM)
    else:
        grid = (_ceil_div(params.n, GEMM_BN), _ceil_div(params.tokens, GEMM_BM), 1)
        rt.launch("atlas_gemm_bf16", grid, (GEMM_THREADS, 1, 1), params)


def linear(rt: CudaRuntime, x: DeviceTensor, weight: DeviceTensor, *, gemm_with: str = "mma") -> DeviceTensor:
    """out = x @ weight.T: GEMV kernels up to GEMV_MAX_TOKENS tokens, else the GEMM `gemm_with`
    ("mma" | "wgmma", gemm_form)."""
    n, k = weight.shape
    _expect(x.shape[-1] == k, f"linear: x {x.shape} vs weight {weight.shape}")
    _expect(k % 8 == 0, f"linear: in features {k} not a multiple of 8 (16-byte bf16 loads)")
    _expect_dtype("linear", "x", x, "f32")
    _expect_dtype("linear", "weight", weight, "bf16")
    tokens = x.numel // k
    _expect_int32("linear", tokens * max(n, k))
    out = rt.empty((*x.shape[:-1], n), "f32")
    if tokens == 0 or n == 0:
        return out
    params = kp.LinearParams(x=x.ptr, weight=weight.ptr, out=out.ptr, tokens=tokens, n=n, k=k)
    if tokens > GEMV_MAX_TOKENS:
        gemm(rt, params, gemm_with)
    elif not (tokens == 1 and gemv_taking_norm(rt, x, params, "atlas_gemv", kp.LinearNormParams,
                                               weight_row_bytes=2 * k)):
        gemv(rt, "atlas_gemv", params, weight_row_bytes=2 * k)
    return out


def gemv_taking_norm(rt: CudaRuntime, x: DeviceTensor, params: ctypes.Structure, entry: str, fused_type: type,
                     shape: GemvGeometry | None = None, weight_row_bytes: int = 0) -> bool:
    """One token's x is a deferred add_rms_norm's output: `entry`_norm_t1, the wide GEMV, takes the
    norm in (norm_fusion.py) with `fused_type`(linear=params, norm=...), when its blocks are few
    enough. False: nothing launched. shape and weight_row_bytes as gemv()'s."""
    shape = shape or DENSE_GEMV
    taken = norm_fusion.take_norm_into_gemv(rt, x, params.n, shape)
    if taken is None:
        return False
    norm, blocks = taken
    fused = fused_type(linear=params, norm=norm)
    if weight_row_bytes:
        fused.linear.prefetch_blocks = prefetch_blocks(rt, blocks, shape.wide_rows * weight_row_bytes)
    rt.launch(f"{entry}_norm_t1", (blocks, 1, 1), (shape.threads, 1, 1), fused)
    return True


@dataclass(frozen=True)
class GemvGeometry:
    """Block shape of a family of decode GEMV kernels (mirrors its header's constants)."""

    threads: int
    wide_rows: int  # output rows per block of the wide form
    narrow_rows: int
    wide_min_waves: int  # the wide form only when its blocks fill every SM this many times


DENSE_GEMV = GemvGeometry(GEMV_THREADS, GEMV_WIDE_ROWS_PER_BLOCK, GEMV_NARROW_ROWS_PER_BLOCK, GEMV_WIDE_MIN_WAVES)


def gemv(rt: CudaRuntime, entry: str, params: ctypes.Structure, shape: GemvGeometry | None = None,
         weight_row_bytes: int = 0) -> None:
    """The decode GEMV `entry`_t{T} (or `entry`_narrow_t{T}) of a LinearParams-shaped `params`:
    the wide form (more rows per block) when it still fills the SMs `wide_min_waves` times.
    shape: DENSE_GEMV when None. weight_row_bytes: set for the kernels that take prefetch_blocks
    (prefetch_blocks)."""
    shape = shape or DENSE_GEMV
    tokens, n = params.tokens, params.n
    wide_blocks = _ceil_div(n, shape.wide_rows)
    wide = wide_blocks >= shape.wide_min_waves * rt.sm_count
    rows = shape.wide_rows if wide else shape.narrow_rows
    grid = (_ceil_div(n, rows), 1, 1)
    if weight_row_bytes:
        params.prefetch_blocks = prefetch_blocks(rt, grid[0], rows * weight_row_bytes)
    rt.launch(f"{entry}_t{tokens}" if wide else f"{entry}_narrow_t{tokens}", grid, (shape.threads, 1, 1), params)


def prefetch_blocks(rt: CudaRuntime, blocks: int, block_bytes: int) -> int:
    """How many of a GEMV's first blocks prefetch their weights before pdl_enter: none unless
    ATLAS_PREFETCH=l2, else as many as PREFETCH_BYTES covers (the first blocks are the ones that
    start while the previous kernel runs)."""
    return min(blocks, PREFETCH_BYTES // block_bytes) if rt.prefetch else 0


def head_norm_rope(
    rt: CudaRuntime,
    x: DeviceTensor,
    weight: DeviceTensor,
    positions: DeviceTensor,
    inv_freq: DeviceTensor,
    scaling: float,
    eps: float,
) -> DeviceTensor:
    tokens, heads, dim = x.shape
    rotary_dim = 2 * inv_freq.numel
    _expect(weight.numel == dim, f"head_norm_rope: weight {weight.shape} vs x {x.shape}")
    _expect(positions.numel == tokens, f"head_norm_rope: positions {positions.shape} vs x {x.shape}")
    _expect(rotary_dim <= dim, f"head_norm_rope: inv_freq {inv_freq.shape} rotates more than head dim {dim}")
    _expect_dtype("head_norm_rope", "x", x, "f32")
    _expect_dtype("head_norm_rope", "weight", weight, "f32")
    _expect_dtype("head_norm_rope", "positions", positions, "i32")
    _expect_dtype("head_norm_rope", "inv_freq", inv_freq, "f32")
    out = rt.empty(x.shape, "f32")
    if x.numel == 0:
        return out
    params = kp.HeadNormRopeParams(x=x.ptr, weight=weight.ptr, positions=positions.ptr, inv_freq=inv_freq.ptr,
                                   out=out.ptr, tokens=tokens, heads=heads, head_dim=dim, rotary_dim=rotary_dim,
                                   scaling=scaling, eps=eps)
    warps = ROPE_THREADS // WARP
    rt.launch("atlas_head_norm_rope", (_ceil_div(tokens * heads, warps), 1, 1), (ROPE_THREADS, 1, 1), params,
              smem=warps * dim * 4)
    return out


def _check_attention(q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, k_cache: DeviceTensor,
                     v_cache: DeviceTensor, positions: DeviceTensor) -> None:
    tokens, q_heads, dim = q.shape
    capacity, kv_heads, cache_dim = k_cache.shape
    _expect(k.shape == (tokens, kv_heads, dim) and v.shape == k.shape, f"attention: k {k.shape} / v {v.shape} vs q {q.shape}, cache {k_cache.shape}")
    _expect(v_cache.shape == k_cache.shape and cache_dim == dim, f"attention: caches {k_cache.shape} / {v_cache.shape} vs q {q.shape}")
    _expect(q_heads % kv_heads == 0, f"attention: {q_heads} q heads not a multiple of {kv_heads} kv heads")
    _expect(dim in ATTN_HEAD_DIMS, f"attention: head dim {dim}, kernels exist for {ATTN_HEAD_DIMS}")
    _expect(positions.numel == tokens, f"attention: positions {positions.shape} vs q {q.shape}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _expect_dtype("attention", name, t, "f32")
    _expect_dtype("attention", "k_cache", k_cache, "bf16")
    _expect_dtype("attention", "v_cache", v_cache, "bf16")
    _expect_dtype("attention", "positions", positions, "i32")
    _expect_int32("attention", k_cache.numel)


@dataclass(frozen=True)
class CachedKV:
    """The caches attention reads: device addresses of K and V, [capacity, kv_heads] head vectors,
    and the kernel suffix of their storage level ('' for bf16, '_fp8', ... for ops_kv's levels)."""

    k: int
    v: int
    capacity: int
    kv_heads: int
    suffix: str = ""


def prefill_attention_form(form: str | None = None) -> str:
    """`form`, or with None the ATLAS_PREFILL_ATTENTION environment variable (default "mma"),
    checked. The CUDA backend reads it once, when it is built."""
    return PREFILL_ATTENTION_SWITCH.read(form)


def attention_mma_smem_bytes(dim: int) -> int:
    """attention_mma.cuh MmaAttnSmem<D>: the q rows and one K and one V tile, rows padded."""
    return 2 * (ATTN_MMA_ROWS + 2 * ATTN_MMA_KEYS) * (dim + ATTN_MMA_PAD)


def attention(rt: CudaRuntime, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, cache: KVCache,
              positions: DeviceTensor, scale: float, *, prefill: str = "simt") -> DeviceTensor:
    """Writes this step's k, v into the bf16 caches (cache.k, cache.v), then attends (the kernel
    compiled for the tuple's head_dim; it leaves the output untouched for any other head dim).
    `prefill`: the form of attention for T > ATTN_DECODE_MAX_TOKENS (prefill_attention_form)."""
    k_cache, v_cache = cache.k, cache.v  # [S, Hkv, D] bf16
    _check_attention(q, k, v, k_cache, v_cache, positions)
    tokens, _, dim = q.shape
    capacity, kv_heads, _ = k_cache.shape
    if tokens == 0:
        return rt.empty(q.shape, "f32")
    write = kp.KvCacheWriteParams(k=k.ptr, v=v.ptr, k_cache=k_cache.ptr, v_cache=v_cache.ptr, positions=positions.ptr,
                                  tokens=tokens, kv_heads=kv_heads, head_dim=dim, capacity=capacity)
    rt.launch("atlas_kv_cache_write", _elementwise_grid(k.numel), (ELEMENTWISE_THREADS, 1, 1), write)
    return attend(rt, q, CachedKV(k_cache.ptr, v_cache.ptr, capacity, kv_heads), positions, scale, prefill=prefill)


def fused_attention(rt: CudaRuntime, x: AttentionInputs, layer: AttentionOperands, *,
                    prefill: str = "simt") -> DeviceTensor:
    """`Backend.full_attention` over bf16 caches: atlas_attention_prep (q and k head norm + rotary,
    the rotated k and v written into the caches) in one launch, then `attend` (the output gate in
    its combine kernel when decoding)."""
    k_cache, v_cache = layer.cache.k, layer.cache.v  # [S, Hkv, D] bf16
    _check_attention(x.q, x.k, x.v, k_cache, v_cache, x.positions)
    tokens, q_heads, dim = x.q.shape
    capacity, kv_heads, _ = k_cache.shape
    rotary_dim = 2 * layer.inv_freq.numel
    _expect(layer.q_norm.numel == dim and layer.k_norm.numel == dim,
            f"attention_prep: norm weights {layer.q_norm.shape} / {layer.k_norm.shape} vs head dim {dim}")
    _expect(rotary_dim <= dim, f"attention_prep: inv_freq {layer.inv_freq.shape} rotates more than head dim {dim}")
    for name, t in (("q_norm", layer.q_norm), ("k_norm", layer.k_norm), ("inv_freq", layer.inv_freq)):
        _expect_dtype("attention_prep", name, t, "f32")
    q = rt.empty(x.q.shape, "f32")
    if tokens == 0:
        return q
    params = kp.AttentionPrepParams(q=x.q.ptr, k=x.k.ptr, v=x.v.ptr, q_weight=layer.q_norm.ptr, k_weight=layer.k_norm.ptr,
                                    positions=x.positions.ptr, inv_freq=layer.inv_freq.ptr, q_out=q.ptr,
                                    k_cache=k_cache.ptr, v_cache=v_cache.ptr, tokens=tokens, q_heads=q_heads,
                                    kv_heads=kv_heads, head_dim=dim, rotary_dim=rotary_dim, capacity=capacity,
                                    scaling=layer.rope_scaling, q_eps=layer.q_eps, k_eps=layer.k_eps)
    warps = ROPE_THREADS // WARP
    rt.launch("atlas_attention_prep", (_ceil_div(tokens * (q_heads + kv_heads), warps), 1, 1), (ROPE_THREADS, 1, 1),
              params, smem=warps * dim * 4)
    cached = CachedKV(k_cache.ptr, v_cache.ptr, capacity, kv_heads)
    return attend(rt, q, cached, x.positions, layer.scale, prefill=prefill, gate=x.gate)


def prefill_token_chunks(tokens: int, group: int) -> list[tuple[int, int]]:
    """Token ranges [first, stop) of the prefill attention launches: each has at most
    ATTN_MAX_ROW_TILES row tiles (Qwen3.6, G = 8: 131070 tokens). A launch over a later range
    attends the same cache (written before), each row masked by its own position."""
    per_launch = ATTN_MAX_ROW_TILES * ATTN_PREFILL_ROWS // group
    return [(first, min(first + per_launch, tokens)) for first in range(0, tokens, per_launch)]


def attend(rt: CudaRuntime, q: DeviceTensor, cache: CachedKV, positions: DeviceTensor, scale: float, *,
           prefill: str = "simt", gate: DeviceTensor | None = None) -> DeviceTensor:
    """Causal attention of q [T, Hq, D] over the cached keys and values (already written), times
    sigmoid(gate [T, Hq, D]) when given: in the combine kernel when decoding, a sigmoid_mul after a
    prefill. prefill "mma" takes the tensor-core kernel for T > ATTN_DECODE_MAX_TOKENS (over a
    quantized level its tiles are decoded to bf16: atlas_attention_prefill_mma_<level>)."""
    _expect(prefill in PREFILL_ATTENTION_FORMS, f"attend: prefill form {prefill!r}, expected one of {PREFILL_ATTENTION_FORMS}")
    if gate is not None:
        _expect(gate.shape == q.shape, f"attend: gate {gate.shape} vs q {q.shape}")
        _expect_dtype("attend", "gate", gate, "f32")
    tokens, q_heads, dim = q.shape
    if tokens > ATTN_DECODE_MAX_TOKENS:
        out = attend_prefill(rt, q, cache, positions, scale, prefill)
        return out if gate is None else sigmoid_mul(rt, out, gate)
    out = rt.empty(q.shape, "f32")
    if tokens == 0:
        return out
    rows = tokens * (q_heads // cache.kv_heads)
    splits = min(_ceil_div(cache.capacity, ATTN_KEYS), ATTN_MAX_SPLITS)  # the kernels size spans from the live length
    partial = rt.empty((splits, tokens, q_heads, dim), "f32")
    ml = rt.empty((splits, tokens, q_heads, 2), "f32")
    params = kp.AttentionParams(out=partial.ptr, ml=ml.ptr, **attention_fields(q, cache, positions, scale))
    grid = (splits, cache.kv_heads, _ceil_div(rows, ATTN_DECODE_ROWS))
    rt.launch(f"atlas_attention_decode{cache.suffix}", grid, (ATTN_DECODE_THREADS, 1, 1), params)
    combine = kp.AttentionCombineParams(partial=partial.ptr, ml=ml.ptr, positions=positions.ptr, out=out.ptr,
                                        gate=None if gate is None else gate.ptr, tokens=tokens, q_heads=q_heads,
                                        head_dim=dim, capacity=cache.capacity, num_splits=splits)
    rt.launch("atlas_attention_combine", (tokens * q_heads, 1, 1), (dim, 1, 1), combine)
    return out


def attention_fields(q: DeviceTensor, cache: CachedKV, positions: DeviceTensor, scale: float) -> dict[str, Any]:
    """AttentionParams' fields but out and ml."""
    tokens, q_heads, dim = q.shape
    return dict(q=q.ptr, k_cache=cache.k, v_cache=cache.v, positions=positions.ptr, tokens=tokens, q_heads=q_heads,
                kv_heads=cache.kv_heads, head_dim=dim, capacity=cache.capacity, scale=scale)


def attend_prefill(rt: CudaRuntime, q: DeviceTensor, cache: CachedKV, positions: DeviceTensor, scale: float,
                   prefill: str) -> DeviceTensor:
    """`attend` for T > ATTN_DECODE_MAX_TOKENS: one split, the output normalised in the kernel."""
    tokens, q_heads, dim = q.shape
    out = rt.empty(q.shape, "f32")
    common = attention_fields(q, cache, positions, scale)
    if prefill == "mma":
        params = kp.AttentionParams(out=out.ptr, ml=None, **common)
        grid = (_ceil_div(tokens * (q_heads // cache.kv_heads), ATTN_MMA_ROWS), cache.kv_heads, 1)
        rt.launch(f"atlas_attention_prefill_mma{cache.suffix}", grid, (ATTN_MMA_THREADS, 1, 1), params,
                  smem=attention_mma_smem_bytes(dim))
        return out
    group = q_heads // cache.kv_heads
    for first, stop in prefill_token_chunks(tokens, group):
        chunk = dict(common, q=q.rows(first, stop).ptr, positions=positions.elements(first, stop).ptr,
                     tokens=stop - first)
        params = kp.AttentionParams(out=out.rows(first, stop).ptr, ml=None, **chunk)
        grid = (1, cache.kv_heads, _ceil_div((stop - first) * group, ATTN_PREFILL_ROWS))
        rt.launch(f"atlas_attention_prefill{cache.suffix}", grid, (ATTN_PREFILL_THREADS, 1, 1), params)
    return out


def argmax(rt: CudaRuntime, logits: DeviceTensor) -> DeviceTensor:
    vocab = logits.shape[-1]
    rows = logits.numel // vocab if vocab else 0
    _expect_dtype("argmax", "logits", logits, "f32")
    _expect(vocab > 0, f"argmax: empty vocabulary in logits {logits.shape}")
    _expect_int32("argmax", logits.numel)
    out = rt.empty((rows,), "i32")
    if rows == 0:
        return out
    chunks = _ceil_div(vocab, ARGMAX_CHUNK)
    values = rt.empty((rows, chunks), "f32")
    indices = rt.empty((rows, chunks), "i32")
    params = kp.ArgmaxParams(logits=logits.ptr, partial_value=values.ptr, partial_index=indices.ptr, out=out.ptr,
                             rows=rows, vocab=vocab, chunk=ARGMAX_CHUNK, chunks=chunks)
    rt.launch("atlas_argmax_partial", (chunks, rows, 1), (ARGMAX_THREADS, 1, 1), params)
    rt.launch("atlas_argmax_final", (rows, 1, 1), (ARGMAX_THREADS, 1, 1), params)
    return out


def sample(rt: CudaRuntime, logits: DeviceTensor, params: SamplingParams, uniform: float,
           form: str = "block") -> DeviceTensor:
    """Temperature 0 is greedy (argmax). The settings and `uniform` are launch parameters, so a
    sampled step is launched per token, not replayed from a captured graph. `form`: SAMPLE_FORMS."""
    check_sampling(params)
    vocab = logits.shape[-1]
    _expect(logits.numel == vocab, f"sample: logits {logits.shape}, expected one row [1, V]")
    _expect_dtype("sample", "logits", logits, "f32")
    _expect(math.isfinite(uniform) and 0.0 <= uniform < 1.0, f"sample: uniform {uniform} outside [0, 1)")
    if params.temperature == 0.0:
        return argmax(rt, logits.reshape(1, vocab))
    out = rt.empty((1,), "i32")
    probs = rt.empty((vocab,), "f32")
    scratch = rt.empty((SAMPLE_SCRATCH_BYTES,), "u8") if form == "split" else None
    launch = kp.SampleParams(logits=logits.ptr, probs=probs.ptr, scratch=None if scratch is None else scratch.ptr,
                             out=out.ptr, vocab=vocab, top_k=params.top_k, temperature=params.temperature,
                             top_p=params.top_p, uniform=uniform, min_p=params.min_p)
    if scratch is None:
        rt.launch("atlas_sample", (1, 1, 1), (SAMPLE_THREADS, 1, 1), launch)
        return out
    units_grid = (_ceil_div(SAMPLE_UNITS, SAMPLE_UNIT_WARPS), 1, 1)
    units_block = (SAMPLE_UNIT_WARPS * 32, 1, 1)
    rt.launch("atlas_sample_units", units_grid, units_block, launch)
    rt.launch("atlas_sample_row", (1, 1, 1), (SAMPLE_UNITS, 1, 1), launch)
    rt.launch("atlas_sample_count", units_grid, units_block, launch)
    rt.launch("atlas_sample_gather", units_grid, units_block, launch)
    rt.launch("atlas_sample_pick", (1, 1, 1), (SAMPLE_UNITS, 1, 1), launch)
    return out


def penalize(rt: CudaRuntime, logits: DeviceTensor, operands: PenaltyOperands, params: SamplingParams,
             mask_ends: bool) -> DeviceTensor:
    """Launched per token (the counts change), like sample: not part of the captured graph."""
    vocab = logits.shape[-1]
    _expect(logits.numel == vocab, f"penalize: logits {logits.shape}, expected one row [1, V]")
    _expect_dtype("penalize", "logits", logits, "f32")
    for name in ("counts", "flags"):
        tensor = getattr(operands, name)
        _expect(tensor.shape == (vocab,) and tensor.dtype == "i32", f"penalize: {name} {tensor.shape} {tensor.dtype}, expected ({vocab},) i32")
    bias = operands.bias
    _expect(bias is None or (bias.shape == (vocab,) and bias.dtype == "f32"), f"penalize: bias must be ({vocab},) f32")
    out = rt.empty(tuple(logits.shape), "f32")
    launch = kp.PenalizeParams(logits=logits.ptr, out=out.ptr, counts=operands.counts.ptr, flags=operands.flags.ptr,
                               bias=None if bias is None else bias.ptr, vocab=vocab, mask_ends=int(mask_ends),
                               repetition=params.repetition_penalty, presence=params.presence_penalty,
                               frequency=params.frequency_penalty)
    rt.launch("atlas_penalize", (_ceil_div(vocab, PENALIZE_THREADS), 1, 1), (PENALIZE_THREADS, 1, 1), launch)
    return out


def top_ids(rt: CudaRuntime, logits: DeviceTensor, k: int) -> DeviceTensor:
    vocab = logits.shape[-1]
    _expect(logits.numel == vocab, f"top_ids: logits {logits.shape}, expected one row [1, V]")
    _expect_dtype("top_ids", "logits", logits, "f32")
    _expect(1 <= k <= SAMPLE_THREADS, f"top_ids: k {k} outside 1..{SAMPLE_THREADS}")
    out = rt.empty((k,), "i32")
    launch = kp.TopIdsParams(logits=logits.ptr, ids=out.ptr, vocab=vocab, k=k)
    rt.launch("atlas_top_ids", (1, 1, 1), (SAMPLE_THREADS, 1, 1), launch)
    return out


def logprob_rows(rt: CudaRuntime, logits: DeviceTensor, tokens: DeviceTensor, top: int,
                 temperature: float = 1.0) -> LogprobTensors:
    vocab = logits.shape[-1]
    rows = logits.numel // vocab if vocab else 0
    _expect_dtype("logprob_rows", "logits", logits, "f32")
    _expect(tokens.dtype == "i32" and tokens.numel == rows, f"logprob_rows: tokens {tokens.shape} for {rows} rows")
    _expect(0 <= top <= SAMPLE_THREADS and rows > 0, f"logprob_rows: top {top} outside 0..{SAMPLE_THREADS}")
    out = LogprobTensors(rt.empty((rows, 2), "f32"), rt.empty((rows,), "f32"), rt.empty((rows,), "i32"),
                         rt.empty((rows, top), "i32"), rt.empty((rows, top), "f32"))
    launch = kp.LogprobParams(logits=logits.ptr, tokens=tokens.ptr, lse=out.lse.ptr, picked=out.picked.ptr,
                              ranks=out.ranks.ptr,
                              ids=out.ids.ptr, values=out.values.ptr, rows=rows, vocab=vocab, k=top,
                              temperature=temperature)
    rt.launch("atlas_logprob_rows", (rows, 1, 1), (SAMPLE_THREADS, 1, 1), launch)
    return out


def count_token(rt: CudaRuntime, counts: DeviceTensor, token: DeviceTensor) -> None:
    _expect(counts.dtype == "i32" and token.dtype == "i32" and token.numel == 1,
            f"count_token: counts {counts.shape} {counts.dtype}, token {token.shape} {token.dtype}")
    launch = kp.CountTokenParams(counts=counts.ptr, token=token.ptr, vocab=counts.numel)
    rt.launch("atlas_count_token", (1, 1, 1), (32, 1, 1), launch)
