"""CPU-side checks of the dense kernels' ABI and launch geometry (no GPU needed).

The op wrappers of backends/cuda/ops_dense.py run against a recording runtime at random
shapes of both registry models. Every launch must name a kernel entry of the compiled PTX whose
single by-value parameter has the size of the params struct it is given, use a block no larger
than the entry's launch bound, and cover the output with its grid. The PTX comes from nvcc here
(skipped without it).
"""

from __future__ import annotations

import ctypes
import math
import re
from typing import Any

import numpy as np
import pytest

from atlas.backends.base import AttentionInputs, AttentionOperands, KVCache, PenaltyOperands, SamplingParams
from atlas.backends.cuda import ops_dense
from atlas.backends.cuda.tensor import DeviceTensor
from atlas.kernel_params.dense import LinearNormParams

from _abi import MODELS, REPO, PtxBuild, PtxEntry, RecordingRuntime, compile_ptx_entries, header_constant, model_dims

DENSE_FILES = ("embedding", "norm", "elementwise", "linear", "rope", "attention", "sampling")
@pytest.fixture(scope="module", params=MODELS)
def ptx_entries(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, PtxEntry]]:
    model = request.param
    sources = tuple(f"kernels/sm80/{model}/bf16/{n}.cu" for n in DENSE_FILES)
    found = compile_ptx_entries(PtxBuild("sm80", model, "bf16", "compute_80", sources),
                                tmp_path_factory.mktemp(model.replace(".", "_")))
    assert found, "no dense entries parsed from the PTX"
    return model, found


def _tensor(rt: RecordingRuntime, dtype: str, *shape: int) -> DeviceTensor:
    return rt.empty(shape, dtype)


def _run_every_op(rt: RecordingRuntime, dims: dict[str, int], rng: np.random.Generator) -> dict[str, Any]:
    """Calls each dense op once at random shapes; returns the shapes used for coverage checks."""
    h, v = dims["hidden_size"], dims["vocab_size"]
    hq, hkv, d = dims["num_attention_heads"], dims["num_key_value_heads"], dims["head_dim"]
    tokens = int(rng.integers(1, 9))
    prefill = int(rng.integers(9, 700))
    capacity = int(rng.integers(prefill, 40_000))
    n = int(rng.integers(1, 5000))  # output features: any count
    f = lambda *s: _tensor(rt, "f32", *s)  # noqa: E731
    for table_dtype in ("bf16", "f32"):
        ops_dense.embedding(rt, _tensor(rt, table_dtype, v, h), _tensor(rt, "i32", tokens))
    ops_dense.rms_norm(rt, f(tokens, h), f(h), 1e-6)
    ops_dense.add_rms_norm(rt, f(prefill, h), f(prefill, h), f(h), 1e-6)
    ops_dense.add(rt, f(prefill, h), f(prefill, h))
    ops_dense.silu_mul(rt, f(tokens, 2 * dims["moe_intermediate_size"]))
    ops_dense.sigmoid_mul(rt, f(tokens, hq * d), f(tokens, hq * d))
    for t in (*range(1, 9), prefill):
        ops_dense.linear(rt, f(t, h), _tensor(rt, "bf16", n, h))
        ops_dense.linear(rt, f(t, h), _tensor(rt, "bf16", 64 * rt.sm_count + n, h))
    ops_dense.linear(rt, f(1, h), _tensor(rt, "bf16", v, h))
    normed, _ = ops_dense.add_rms_norm(rt, f(1, h), f(1, h), f(h), 1e-6, defer=True)  # ATLAS_NORM=fused
    ops_dense.linear(rt, normed, _tensor(rt, "bf16", 64 * rt.sm_count + n, h))  # takes it in: wide, few blocks
    ops_dense.head_norm_rope(rt, f(prefill, hq, d), f(d), _tensor(rt, "i32", prefill), f(dims["rotary_dim"] // 2), 1.0, 1e-6)
    for t in (tokens % 4 + 1, prefill):
        caches = [_tensor(rt, "bf16", capacity, hkv, d) for _ in range(2)]
        ops_dense.attention(rt, f(t, hq, d), f(t, hkv, d), f(t, hkv, d), KVCache(*caches), _tensor(rt, "i32", t), d**-0.5)
        layer = AttentionOperands(f(d), f(d), 1e-6, 1e-6, f(dims["rotary_dim"] // 2), 1.0, KVCache(*caches), d**-0.5)
        ops_dense.fused_attention(rt, AttentionInputs(f(t, hq, d), f(t, hkv, d), f(t, hkv, d), _tensor(rt, "i32", t)), layer)
    ops_dense.argmax(rt, f(tokens, v))
    ops_dense.nonfinite_count(rt, f(1, h))
    for form in ops_dense.SAMPLE_FORMS:
        ops_dense.sample(rt, f(1, v), SamplingParams(0.8, 20, 0.9), float(rng.random()), form)
    i32 = lambda *s: _tensor(rt, "i32", *s)  # noqa: E731
    for bias in (None, f(v)):
        ops_dense.penalize(rt, f(1, v), PenaltyOperands(i32(v), i32(v), bias), SamplingParams(presence_penalty=1.5), True)
    ops_dense.count_token(rt, i32(v), i32(1))
    ops_dense.top_ids(rt, f(1, v), int(rng.integers(1, 1025)))
    ops_dense.logprob_rows(rt, f(tokens, v), i32(tokens), int(rng.integers(0, 21)))
    return {"tokens": tokens, "prefill": prefill, "capacity": capacity, "n": n}


def test_every_launch_matches_its_ptx_entry(ptx_entries: tuple[str, dict[str, PtxEntry]], rng: np.random.Generator) -> None:
    model, entries = ptx_entries
    rt = RecordingRuntime()
    _run_every_op(rt, model_dims(model), rng)
    for launch in rt.launches:
        assert launch.kernel in entries, f"{launch.kernel} is launched but not in the {model} PTX"
        entry = entries[launch.kernel]
        assert entry.param_bytes == ctypes.sizeof(launch.params), (
            f"{launch.kernel}: PTX param {entry.param_bytes} B, {type(launch.params).__name__} {ctypes.sizeof(launch.params)} B")
        assert entry.align == ctypes.alignment(type(launch.params)), f"{launch.kernel}: alignment"
        threads = math.prod(launch.block)
        assert 0 < threads <= entry.max_threads and threads % 32 == 0, f"{launch.kernel}: block {launch.block}"
        assert all(0 < g for g in launch.grid) and max(launch.grid[1:]) <= 65535, f"{launch.kernel}: grid {launch.grid}"
        assert launch.smem <= 48 * 1024, f"{launch.kernel}: {launch.smem} B dynamic smem needs an opt-in"
    launched = {launch.kernel for launch in rt.launches}
    assert launched == set(entries), f"entries never launched: {set(entries) - launched}"


def test_grids_cover_the_outputs(rng: np.random.Generator) -> None:
    for model in MODELS:
        dims = model_dims(model)
        rt = RecordingRuntime()
        shapes = _run_every_op(rt, dims, rng)
        for launch in rt.launches:
            p = launch.params
            if isinstance(p, LinearNormParams):  # atlas_gemv_norm_t1: the norm's one row is the GEMV's x
                assert (p.norm.rows, p.norm.dim) == (1, p.linear.k) and launch.block[0] == ops_dense.norm_threads(p.norm.dim)
                p = p.linear
            if launch.kernel.startswith("atlas_gemv_"):
                narrow = launch.kernel.startswith("atlas_gemv_narrow_t")
                assert int(launch.kernel.rsplit("_t", 1)[1]) == p.tokens
                rows = ops_dense.GEMV_NARROW_ROWS_PER_BLOCK if narrow else ops_dense.GEMV_WIDE_ROWS_PER_BLOCK
                assert launch.grid[0] * rows >= p.n
            elif launch.kernel == "atlas_gemm_bf16":
                assert p.tokens > ops_dense.GEMV_MAX_TOKENS
                assert launch.grid[0] * ops_dense.GEMM_BN >= p.n and launch.grid[1] * ops_dense.GEMM_BM >= p.tokens
            elif launch.kernel in ("atlas_attention_decode", "atlas_attention_prefill"):
                group = p.q_heads // p.kv_heads
                rows = ops_dense.ATTN_DECODE_ROWS if launch.kernel.endswith("decode") else ops_dense.ATTN_PREFILL_ROWS
                splits = min(-(-shapes["capacity"] // ops_dense.ATTN_KEYS), ops_dense.ATTN_MAX_SPLITS)
                assert launch.grid[0] == (splits if launch.kernel.endswith("decode") else 1)
                assert launch.grid[1] == p.kv_heads and p.capacity == shapes["capacity"]
                assert launch.grid[2] * rows >= p.tokens * group
                assert (p.ml is None) == launch.kernel.endswith("prefill")
            elif launch.kernel == "atlas_head_norm_rope":
                warps = launch.block[0] // 32
                assert launch.grid[0] * warps >= p.tokens * p.heads and launch.smem == warps * p.head_dim * 4
            elif launch.kernel == "atlas_attention_prep":
                warps = launch.block[0] // 32
                assert launch.grid[0] * warps >= p.tokens * (p.q_heads + p.kv_heads) and launch.smem == warps * p.head_dim * 4
                assert p.capacity == shapes["capacity"] and p.rotary_dim == dims["rotary_dim"]
            elif launch.kernel in ("atlas_rms_norm", "atlas_add_rms_norm"):
                assert launch.grid[0] == p.rows
            elif launch.kernel == "atlas_argmax_partial":
                assert launch.grid[0] * p.chunk >= p.vocab and launch.grid[1] == p.rows
            elif launch.kernel == "atlas_penalize":
                assert launch.grid[0] * launch.block[0] >= p.vocab == dims["vocab_size"]
            elif launch.kernel in ("atlas_sample_units", "atlas_sample_count", "atlas_sample_gather"):
                assert launch.block[0] == 32 * ops_dense.SAMPLE_UNIT_WARPS and p.scratch is not None
                assert launch.grid[0] * ops_dense.SAMPLE_UNIT_WARPS >= ops_dense.SAMPLE_UNITS
            elif launch.kernel in ("atlas_sample_row", "atlas_sample_pick"):
                assert launch.grid == (1, 1, 1) and launch.block[0] == ops_dense.SAMPLE_UNITS and p.scratch is not None
            elif launch.kernel == "atlas_sample":
                assert launch.grid == (1, 1, 1) and p.scratch is None


@pytest.mark.parametrize("programmatic", [False, True])
@pytest.mark.parametrize("prefetch", [False, True])
def test_gemv_prefetch_blocks_only_under_the_prefetch_setting(rng: np.random.Generator, programmatic: bool,
                                                              prefetch: bool) -> None:
    """Under ATLAS_PREFETCH=l2 a bf16 GEMV's first blocks prefetch their weight rows (as many as
    PREFETCH_BYTES covers, never more than the grid), whatever the launch form; without it none
    does, and the prefill GEMM never does."""
    rt = RecordingRuntime(programmatic=programmatic, prefetch=prefetch)
    k = 8 * int(rng.integers(1, 1024))
    for n in (int(rng.integers(1, 300)), int(rng.integers(64 * rt.sm_count, 200_000))):
        ops_dense.linear(rt, rt.empty((int(rng.integers(1, 9)), k), "f32"), rt.empty((n, k), "bf16"))
    ops_dense.linear(rt, rt.empty((int(rng.integers(9, 300)), k), "f32"), rt.empty((64, k), "bf16"))
    gemvs = [launch for launch in rt.launches if launch.kernel.startswith("atlas_gemv_")]
    assert len(gemvs) == 2 and rt.launches[-1].kernel == "atlas_gemm_bf16" and rt.launches[-1].params.prefetch_blocks == 0
    for launch in gemvs:
        narrow = launch.kernel.startswith("atlas_gemv_narrow_t")
        rows = ops_dense.GEMV_NARROW_ROWS_PER_BLOCK if narrow else ops_dense.GEMV_WIDE_ROWS_PER_BLOCK
        want = min(launch.grid[0], ops_dense.PREFETCH_BYTES // (rows * 2 * k)) if prefetch else 0
        assert launch.params.prefetch_blocks == want


def test_bad_inputs_are_refused(rng: np.random.Generator) -> None:
    rt = RecordingRuntime()
    h = int(rng.integers(1, 64)) * 8
    with pytest.raises(ValueError, match="multiple of 8"):
        ops_dense.linear(rt, rt.empty((1, h + 4), "f32"), rt.empty((16, h + 4), "bf16"))
    with pytest.raises(ValueError, match="dtype"):
        ops_dense.linear(rt, rt.empty((1, h), "f32"), rt.empty((16, h), "f32"))
    with pytest.raises(ValueError, match="head dim"):
        caches = [rt.empty((64, 2, 96), "bf16") for _ in range(2)]
        ops_dense.attention(rt, rt.empty((1, 4, 96), "f32"), rt.empty((1, 2, 96), "f32"),
                            rt.empty((1, 2, 96), "f32"), KVCache(*caches), rt.empty((1,), "i32"), 0.1)
    assert rt.launches == []


def test_wrapper_geometry_mirrors_the_headers() -> None:
    warps_per_gemv_block = header_constant("gemv.cuh", "kGemvThreads") // 32
    mirrored = [
        (ops_dense.GEMV_THREADS, header_constant("gemv.cuh", "kGemvThreads")),
        (ops_dense.GEMV_WIDE_ROWS_PER_BLOCK, warps_per_gemv_block * header_constant("gemv.cuh", "kGemvWideRows")),
        (ops_dense.GEMV_NARROW_ROWS_PER_BLOCK, warps_per_gemv_block * header_constant("gemv.cuh", "kGemvNarrowRows")),
        (ops_dense.GEMM_THREADS, header_constant("gemm.cuh", "kGemmThreads")),
        (ops_dense.GEMM_BM, header_constant("gemm.cuh", "kGemmBM")),
        (ops_dense.GEMM_BN, header_constant("gemm.cuh", "kGemmBN")),
        (ops_dense.ROPE_THREADS, header_constant("rope.cuh", "kRopeThreads")),
        (ops_dense.ATTN_KEYS, header_constant("attention.cuh", "kAttnKeys")),
        (ops_dense.ARGMAX_THREADS, header_constant("sampling.cuh", "kArgmaxThreads")),
        (ops_dense.SAMPLE_THREADS, header_constant("sampling.cuh", "kSampleThreads")),
        (ops_dense.SAMPLE_UNITS, header_constant("sampling_split.cuh", "kSampleUnits")),
        (ops_dense.SAMPLE_UNIT_WARPS, header_constant("sampling_split.cuh", "kSampleUnitWarps")),
        (ops_dense.SAMPLE_SCRATCH_BYTES, header_constant("sampling_split.cuh", "kSampleScratchBytes")),
    ]
    for wrapper, header in mirrored:
        assert wrapper == header
    template = (REPO / "kernels/templates/bf16/attention.cu.j2").read_text()
    shapes = dict(re.findall(r"atlas_attention_(decode|prefill)\(const AttentionParams p\) \{\s*"
                             r"atlas::pdl_enter\(\);\s*atlas::attention_block<atlas::model::head_dim, (\d+, \d+)>", template))
    rows_decode, warps_decode = map(int, shapes["decode"].split(", "))
    rows_prefill, warps_prefill = map(int, shapes["prefill"].split(", "))
    assert ops_dense.ATTN_DECODE_ROWS == rows_decode * warps_decode
    assert ops_dense.ATTN_DECODE_THREADS == 32 * warps_decode
    assert ops_dense.ATTN_PREFILL_ROWS == rows_prefill * warps_prefill
    assert ops_dense.ATTN_PREFILL_THREADS == 32 * warps_prefill
