"""CPU-side checks of the DeltaNet / MoE kernels' ABI and launch geometry (no GPU needed).

The op wrappers of backends/cuda/ops_linear_moe.py run against a recording runtime at random
shapes of both registry models. Every launch must name an entry of the compiled PTX whose single
by-value parameter has the size of the params struct given, launch exactly the block the entry
was written for (its launch bound: the kernels refuse any other block size), and cover its
output with the grid; every entry must be launched by some op.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest

from atlas.backends.cuda import ops_linear_moe as ops
from atlas.backends.cuda.ops_dense import add_rms_norm

from _abi import MODELS, PtxBuild, PtxEntry, RecordingRuntime, compile_ptx_entries, header_constant, model_dims
from _operands import delta_rule_operands

FILES = ("causal_conv1d", "gated_delta_rule", "gated_rms_norm", "router", "moe_experts", "add_sigmoid_scaled")
OPT_IN_SMEM_MIN = 99 * 1024  # the smallest per-block opt-in of the targets (sm_86/89, sm_120/121)
@pytest.fixture(scope="module", params=MODELS)
def ptx_entries(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, PtxEntry]]:
    model = request.param
    sources = tuple(f"kernels/sm80/{model}/bf16/{n}.cu" for n in FILES)
    found = compile_ptx_entries(PtxBuild("sm80", model, "bf16", "compute_80", sources),
                                tmp_path_factory.mktemp(model.replace(".", "_")))
    assert found, "no entries parsed from the PTX"
    return model, found


def _run_every_op(rt: RecordingRuntime, d: dict[str, int], rng: np.random.Generator) -> None:
    f = lambda *s: rt.empty(s, "f32")  # noqa: E731
    hk, hv = d["linear_num_key_heads"], d["linear_num_value_heads"]
    dk, dv, width = d["linear_key_head_dim"], d["linear_value_head_dim"], d["linear_conv_kernel_dim"]
    h, e, k, inter = d["hidden_size"], d["num_experts"], d["num_experts_per_tok"], d["moe_intermediate_size"]
    channels = 2 * hk * dk + hv * dv
    for tokens in (1, int(rng.integers(2, ops.MOE_GEMV_MAX_TOKENS + 1)), int(rng.integers(ops.MOE_GEMV_MAX_TOKENS + 1, 700))):
        for conv_dtype in ("f32", "bf16"):
            ops.causal_conv1d(rt, f(tokens, channels), rt.empty((channels, width), conv_dtype), f(channels, width - 1))
        for chunked in (False, True):
            ops.gated_delta_rule(rt, f(tokens, channels), f(tokens, hv), f(tokens, hv),
                                 delta_rule_operands(f(hv), f(hv), f(hv, dk, dv), hk), chunked=chunked)
        ops.gated_rms_norm(rt, f(tokens, hv, dv), f(tokens, hv, dv), f(dv), 1e-6)
        arrivals = rt.empty((ops.ROUTER_FUSED_MAX_TOKENS,), "i32")  # the fused router's counters (decode steps)
        for shared in (0, 1):  # the router's shared slot: k + 1 slots over E + 1 stacked experts
            ids, weights = ops.router(rt, f(tokens, h), rt.empty((e + shared, h), "bf16"), k, True, shared_expert=bool(shared))
            assert ids.shape == weights.shape == (tokens, k + shared)
            ops.router(rt, f(tokens, h), rt.empty((e + shared, h), "bf16"), k, True, shared_expert=bool(shared),
                       arrivals=arrivals)
            stacked = e + shared
            ops.moe_experts(rt, f(tokens, h), ids, weights, rt.empty((stacked, 2 * inter, h), "bf16"),
                            rt.empty((stacked, h, inter), "bf16"))
        ops.add_sigmoid_scaled(rt, f(tokens, h), f(tokens, h), f(tokens, 1))
    for arrivals in (None, rt.empty((ops.ROUTER_FUSED_MAX_TOKENS,), "i32")):  # ATLAS_NORM=fused: the router takes it in
        normed, _ = add_rms_norm(rt, f(1, h), f(1, h), f(h), 1e-6, defer=True)
        ops.router(rt, normed, rt.empty((e, h), "bf16"), k, True, arrivals=arrivals)


def test_every_launch_matches_its_ptx_entry(ptx_entries: tuple[str, dict[str, PtxEntry]],
                                            rng: np.random.Generator) -> None:
    model, entries = ptx_entries
    rt = RecordingRuntime()
    _run_every_op(rt, model_dims(model), rng)
    for launch in rt.launches:
        assert launch.kernel in entries, f"{launch.kernel} is launched but not in the {model} PTX"
        align, param_bytes, max_threads = entries[launch.kernel]
        assert param_bytes == ctypes.sizeof(launch.params), f"{launch.kernel}: PTX param {param_bytes} B"
        assert align == ctypes.alignment(type(launch.params)), f"{launch.kernel}: alignment"
        assert math.prod(launch.block) == max_threads, f"{launch.kernel}: block {launch.block} != bound {max_threads}"
        assert all(0 < g for g in launch.grid) and max(launch.grid[1:]) <= 65535, f"{launch.kernel}: grid {launch.grid}"
        assert launch.smem <= OPT_IN_SMEM_MIN, f"{launch.kernel}: {launch.smem} B dynamic smem"
    assert {launch.kernel for launch in rt.launches} == set(entries), "some entries are never launched"


def test_grids_cover_the_outputs(rng: np.random.Generator) -> None:
    for model in MODELS:
        d = model_dims(model)
        rt = RecordingRuntime()
        _run_every_op(rt, d, rng)
        for launch in rt.launches:
            p, (gx, gy, gz) = launch.params, launch.grid
            if launch.kernel == "atlas_causal_conv1d":
                assert gx * ops.CONV_THREADS >= p.channels and gy * ops.CONV_TOKENS_PER_BLOCK >= p.num_tokens
            elif launch.kernel == "atlas_gated_delta_rule":
                assert (gx, gy * ops.DELTA_COLS_PER_BLOCK) == (p.num_v_heads, p.v_head_dim)
            elif launch.kernel == "atlas_gated_delta_chunk_prep":
                assert (gx, gy) == (p.num_v_heads, p.num_chunks) and p.num_chunks * ops.DELTA_CHUNK >= p.num_tokens > 1
                assert launch.smem == ops.delta_prep_smem_bytes(p.k_head_dim)
            elif launch.kernel == "atlas_gated_delta_chunk_scan":
                assert (gx, gy * ops.DELTA_COLS_PER_BLOCK) == (p.num_v_heads, p.v_head_dim)
            elif launch.kernel == "atlas_gated_rms_norm":
                assert gx * ops.GATED_NORM_WARPS >= p.rows and p.dim == d["linear_value_head_dim"]
            elif launch.kernel in ("atlas_router_logits", "atlas_router_fused", "atlas_router_logits_norm",
                                   "atlas_router_fused_norm"):
                if launch.kernel.endswith("_norm"):
                    assert (p.norm.rows, p.norm.dim, p.router.num_tokens) == (1, d["hidden_size"], 1)
                    p = p.router
                assert gx == p.num_tokens and gy == -(-(p.num_experts + p.shared_expert) // ops.ROUTER_WARPS)
                assert p.num_experts == d["num_experts"] and p.shared_expert in (0, 1)
                fused = launch.kernel.startswith("atlas_router_fused")  # the kernel refuses any other grid height
                assert bool(p.arrivals) == fused and (not fused or gx <= ops.ROUTER_FUSED_MAX_TOKENS)
            elif launch.kernel == "atlas_moe_gate_up_gemv":
                assert gx * ops.GEMV_WARPS >= p.inter and gy == p.num_slots
            elif launch.kernel.startswith("atlas_moe_down_gemv_k"):
                assert gx * ops.GEMV_WARPS >= p.hidden and gy == p.num_tokens <= ops.MOE_GEMV_MAX_TOKENS
                assert launch.kernel == f"atlas_moe_down_gemv_k{p.top_k}" and p.top_k - d["num_experts_per_tok"] in (0, 1)
                assert p.num_experts == d["num_experts"] + p.top_k - d["num_experts_per_tok"]
            elif launch.kernel.startswith("atlas_moe_grouped_gemm"):
                cols = ops.GEMM_BN // 2 if launch.kernel.endswith("gate_up") else ops.GEMM_BN
                tokens = p.num_slots // p.top_k
                assert gx * cols >= p.n_out and gy * ops.GEMM_BM >= tokens and gz == p.num_experts
            elif launch.kernel in ("atlas_moe_combine", "atlas_add_sigmoid_scaled"):
                assert gx * ops.ELEMENTWISE_THREADS * 4 >= p.num_tokens * p.hidden
        grouped = [launch for launch in rt.launches if launch.kernel == "atlas_moe_grouped_gemm_down"]
        assert grouped and all(launch.params.out in rt.zeroed for launch in grouped), "grouped MoE output not zeroed"


def test_bad_inputs_are_refused() -> None:
    rt = RecordingRuntime()
    f = lambda *s: rt.empty(s, "f32")  # noqa: E731
    with pytest.raises(ValueError, match="conv_state"):
        ops.causal_conv1d(rt, f(3, 64), f(64, 4), f(64, 4))
    with pytest.raises(ValueError, match="dtype"):
        ops.router(rt, f(2, 64), f(8, 64), 2, True)
    with pytest.raises(ValueError, match="top_k"):
        ops.router(rt, f(2, 64), rt.empty((8, 64), "bf16"), 9, True)
    with pytest.raises(ValueError, match="mixed_qkv"):
        ops.gated_delta_rule(rt, f(1, 100), f(1, 4), f(1, 4), delta_rule_operands(f(4), f(4), f(4, 64, 64), 2))
    assert rt.launches == []


def test_wrapper_geometry_mirrors_the_headers() -> None:
    mirrored = [
        (ops.CONV_THREADS, header_constant("conv1d.cuh", "kThreads")),
        (ops.CONV_TOKENS_PER_BLOCK, header_constant("conv1d.cuh", "kTokensPerBlock")),
        (ops.DELTA_THREADS, 32 * header_constant("delta_rule.cuh", "kWarps")),
        (ops.DELTA_COLS_PER_BLOCK, header_constant("delta_rule.cuh", "kWarps") * header_constant("delta_rule.cuh", "kColsPerWarp")),
        (ops.DELTA_CHUNK, header_constant("delta_chunked.cuh", "kChunk")),
        (ops.DELTA_PREP_THREADS, header_constant("delta_chunked.cuh", "kPrepThreads")),
        (ops.GATED_NORM_WARPS, header_constant("gated_norm.cuh", "kWarps")),
        (ops.ROUTER_WARPS, header_constant("router.cuh", "kWarps")),
        (ops.GEMV_WARPS, header_constant("moe.cuh", "kGemvWarps")),
        (ops.ROUTE_THREADS, header_constant("moe.cuh", "kRouteThreads")),
        (ops.GEMM_THREADS, header_constant("moe.cuh", "kGemmThreads")),
        (ops.GEMM_BM, header_constant("moe.cuh", "kBM")),
        (ops.GEMM_BN, header_constant("moe.cuh", "kBN")),
        (ops.ELEMENTWISE_THREADS, header_constant("moe.cuh", "kElementwiseThreads")),
    ]
    for wrapper, header in mirrored:
        assert wrapper == header


def test_delta_rule_form_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from atlas.errors import AtlasError

    d = model_dims("qwen3.6-35b-a3b")
    hk, hv, dk, dv = d["linear_num_key_heads"], d["linear_num_value_heads"], d["linear_key_head_dim"], d["linear_value_head_dim"]

    def kernels(tokens: int) -> list[str]:
        rt = RecordingRuntime()
        f = lambda *s: rt.empty(s, "f32")  # noqa: E731
        ops.gated_delta_rule(rt, f(tokens, 2 * hk * dk + hv * dv), f(tokens, hv), f(tokens, hv),
                             delta_rule_operands(f(hv), f(hv), f(hv, dk, dv), hk))
        return [launch.kernel for launch in rt.launches]

    monkeypatch.delenv(ops.DELTA_RULE_ENV, raising=False)
    assert kernels(100) == ["atlas_gated_delta_rule"]  # recurrent until the device confirms the chunked form
    monkeypatch.setenv(ops.DELTA_RULE_ENV, "chunked")
    assert kernels(100) == ["atlas_gated_delta_chunk_prep", "atlas_gated_delta_chunk_scan"]
    assert kernels(1) == ["atlas_gated_delta_rule"]  # decode stays recurrent
    monkeypatch.setenv(ops.DELTA_RULE_ENV, "wy")
    with pytest.raises(AtlasError, match=ops.DELTA_RULE_ENV):
        kernels(100)
