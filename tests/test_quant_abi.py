"""CPU-side checks of the quantized (fp8 block, nvfp4) kernels: ABI, launch geometry, and a numpy
emulation of their decode and addressing against atlas.quant's reference dequantization.

The emulations follow kernels/include/atlas/quant_common.cuh and gemv_quant.cuh step by step
(bit layouts, chunk and scale addressing, the x swizzle, the per-chunk accumulation order), so
an index or bit error there shows up here without a GPU.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from atlas.backends.cuda import ops_quant
from atlas.backends.cuda.ops_dense import add_rms_norm, norm_threads
from atlas.backends.cuda.quant_weights import HostQuantWeight, QuantWeight, from_fp8_block, from_nvfp4, stack_rows
from atlas.backends.cuda.tensor import DeviceTensor
from atlas.kernel_params import quant as kp
from atlas.quant.codes import E2M1_VALUES, decode_e4m3
from atlas.quant.fp8_block import dequantize_fp8_block, quantize_fp8_block
from atlas.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

from _abi import MODELS, PtxBuild, PtxEntry, RecordingRuntime, compile_ptx_entries, header_constant, model_dims

FORMATS = ("fp8", "nvfp4")


# --- decode bit tricks ----------------------------------------------------------------------------

def _half2_words_to_f32(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    halves = bits.astype(np.uint32)
    lo = (halves & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)
    hi = (halves >> 16).astype(np.uint16).view(np.float16).astype(np.float32)
    return lo, hi


def emulate_e2m1x8(words: np.ndarray) -> np.ndarray:
    """quant_common.cuh e2m1x8_to_raw_f32: uint32 [n] -> raw f32 [n, 8] (value / 2^14)."""
    w = words.astype(np.uint64)
    out = np.empty((len(words), 8), dtype=np.float32)
    for j in range(4):
        mag_shift, sign_shift = 9 - 4 * j, 12 - 4 * j
        mag = (w << mag_shift) if mag_shift >= 0 else (w >> -mag_shift)
        bits = ((mag & 0x0E000E00) | ((w << sign_shift) & 0x80008000)) & 0xFFFFFFFF
        out[:, j], out[:, j + 4] = _half2_words_to_f32(bits)
    return out


def emulate_e4m3x2_fallback(pairs: np.ndarray) -> np.ndarray:
    """quant_common.cuh e4m3x2_to_half2 before sm_89: uint16 [n] -> f32 [n, 2]."""
    p = pairs.astype(np.uint32)
    w = (p & 0xFF) | ((p >> 8) << 16)
    bits = ((w & 0x007F007F) << 7) | ((w & 0x00800080) << 8)
    lo, hi = _half2_words_to_f32(bits)
    scaled = np.stack([lo, hi], axis=1).astype(np.float16) * np.float16(256.0)  # __hmul2, exact
    return scaled.astype(np.float32)


def test_e2m1_bit_decode_matches_the_code_table(rng: np.random.Generator) -> None:
    words = np.concatenate([rng.integers(0, 2**32, 4096, dtype=np.uint64),
                            np.array([0x76543210, 0xFEDCBA98], dtype=np.uint64)]).astype(np.uint32)
    raw = emulate_e2m1x8(words)
    nibbles = (words[:, None].astype(np.uint64) >> (4 * np.arange(8, dtype=np.uint64))) & 0xF  # [n, 8]
    expected = E2M1_VALUES[nibbles.astype(np.uint8)]
    np.testing.assert_array_equal(raw * np.float32(2.0**14), expected)


def test_e4m3_fallback_decode_is_exact_for_every_finite_code() -> None:
    codes = np.arange(256, dtype=np.uint16)
    finite = (codes & 0x7F) != 0x7F
    pairs = codes | (codes[::-1] << 8)
    got = emulate_e4m3x2_fallback(pairs)
    np.testing.assert_array_equal(got[finite, 0], decode_e4m3(codes[finite].astype(np.uint8)))
    hi_codes = codes[::-1].astype(np.uint8)
    np.testing.assert_array_equal(got[finite[::-1], 1], decode_e4m3(hi_codes[finite[::-1]]))


# --- staged-x swizzle -----------------------------------------------------------------------------

def swizzled_slot(f: np.ndarray) -> np.ndarray:
    c = f >> 2
    return (c << 2) | ((f & 3) ^ ((c >> 1) & 3))


def test_x_swizzle_is_a_permutation_without_bank_conflicts() -> None:
    slots = np.arange(8192 // 4)
    assert sorted(swizzled_slot(slots)) == list(slots)
    for base in range(0, 64, 8):  # a quarter warp: lanes base..base+7 read chunks 64 bytes apart
        chunks = np.arange(base, base + 8)
        for j in range(4):
            banks = (swizzled_slot(4 * chunks + j) % 8)  # 8 float4 slots span the 32 banks
            assert len(set(banks.tolist())) == 8


# --- chunk / scale addressing and the GEMV accumulation ----------------------------------------

def _chunk_load(w: HostQuantWeight, row: int, c: int) -> tuple[np.ndarray, float]:
    """Format::load + decode + scale of quant_common.cuh on flat device buffers: 16 raw, scale."""
    q = w.q.reshape(-1)
    if w.format == "fp8":
        raw = decode_e4m3(q[row * w.k + 16 * c: row * w.k + 16 * c + 16])
        blocks_per_row = -(-w.k // 128)
        return raw, float(w.scale.reshape(-1)[row * blocks_per_row + c * 16 // 128])
    base = row * (w.k // 2) + 8 * c
    words = q[base: base + 8].view(np.uint32)  # the uint2 of the chunk, little endian
    raw = emulate_e2m1x8(words).reshape(16)
    code = w.scale.reshape(-1)[row * (w.k // 16) + c]
    return raw, float(decode_e4m3(np.array([code], dtype=np.uint8))[0]) * 2.0**14


def emulate_gemv(w: HostQuantWeight, x: np.ndarray) -> np.ndarray:
    """gemv_quant: per row, f32 partial of each chunk, one FMA with its scale, row scale last."""
    out = np.zeros((x.shape[0], w.rows), dtype=np.float32)
    for row in range(w.rows):
        acc = np.zeros(x.shape[0], dtype=np.float32)
        for c in range(w.k // 16):
            raw, scale = _chunk_load(w, row, c)
            partial = (x[:, 16 * c: 16 * c + 16] * raw).sum(axis=1, dtype=np.float32)
            acc = acc + np.float32(scale) * partial
        out[:, row] = acc * (1.0 if w.row_scale is None else w.row_scale[row])
    return out


def _quantized(fmt: str, n: int, k: int, rng: np.random.Generator) -> tuple[HostQuantWeight, np.ndarray]:
    """(device-layout weight, atlas.quant reference dequantization [n, k])."""
    dense = rng.standard_normal((n, k)).astype(np.float32) * np.float32(rng.uniform(0.01, 3.0))
    if fmt == "fp8":
        q = quantize_fp8_block(dense)
        return from_fp8_block(q.weight, q.scale_inv, q.block), dequantize_fp8_block(q.weight, q.scale_inv, q.block)
    q4 = quantize_nvfp4(dense)
    return (from_nvfp4(q4.weight, q4.weight_scale, q4.weight_scale_2),
            dequantize_nvfp4(q4.weight, q4.weight_scale, q4.weight_scale_2))


@pytest.mark.parametrize("fmt", FORMATS)
def test_chunk_addressing_rebuilds_the_reference_weight(fmt: str, rng: np.random.Generator) -> None:
    n = int(rng.integers(1, 300))  # ragged fp8 row blocks
    k = 16 * int(rng.integers(1, 40))  # ragged fp8 column blocks
    w, reference = _quantized(fmt, n, k, rng)
    np.testing.assert_array_equal(w.dequantize(), reference)
    rebuilt = np.empty((n, k), dtype=np.float32)
    for row in range(n):
        for c in range(k // 16):
            raw, scale = _chunk_load(w, row, c)
            rebuilt[row, 16 * c: 16 * c + 16] = raw * np.float32(scale)
    row_scale = 1.0 if w.row_scale is None else w.row_scale[:, None]
    np.testing.assert_allclose(rebuilt * row_scale, reference, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_accumulation_matches_the_dequantized_product(fmt: str, rng: np.random.Generator) -> None:
    n, k, tokens = int(rng.integers(1, 40)), 16 * int(rng.integers(1, 24)), int(rng.integers(1, 9))
    w, reference = _quantized(fmt, n, k, rng)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    expected = x.astype(np.float64) @ reference.astype(np.float64).T
    bound = 5e-5 * (np.abs(x).astype(np.float64) @ np.abs(reference).astype(np.float64).T) + 1e-6  # k * eps(f32)
    assert np.all(np.abs(emulate_gemv(w, x) - expected) <= bound)


@pytest.mark.parametrize("fmt", FORMATS)
def test_row_slicing_and_stacking_keep_each_rows_scales(fmt: str, rng: np.random.Generator) -> None:
    parts = [_quantized(fmt, int(rng.integers(1, 200)), 256, rng) for _ in range(3)]
    stacked = stack_rows([p[0] for p in parts])
    reference = np.concatenate([p[1] for p in parts])
    np.testing.assert_array_equal(stacked.dequantize(), reference)
    index = rng.permutation(stacked.rows)[: stacked.rows // 2]
    np.testing.assert_array_equal(stacked.take_rows(index).dequantize(), reference[index])


def test_bad_layouts_are_refused(rng: np.random.Generator) -> None:
    q = quantize_fp8_block(rng.standard_normal((130, 256)).astype(np.float32))
    with pytest.raises(ValueError, match="128-column"):
        from_fp8_block(q.weight, q.scale_inv, (128, 64))
    with pytest.raises(ValueError, match="scale grid"):
        from_fp8_block(q.weight, q.scale_inv[:1], q.block)
    q4 = quantize_nvfp4(rng.standard_normal((8, 64)).astype(np.float32))
    with pytest.raises(ValueError, match="weight_scale"):
        from_nvfp4(q4.weight, q4.weight_scale[:, :2], q4.weight_scale_2)


# --- MoE tile rows ------------------------------------------------------------------------------

def moe_weight_row(gate_up: bool, n_out: int, e: int, n0: int, r: int) -> tuple[int, int]:
    """moe_quant.cuh moe_weight_row over moe.cuh b_tile_column: (weight row, output column)."""
    col = n0 + (r // 32) * 16 + r % 16 if gate_up else n0 + r
    up_half = gate_up and (r % 32) >= 16
    rows_per_expert = 2 * n_out if gate_up else n_out
    return e * rows_per_expert + col + (n_out if up_half else 0), col


@pytest.mark.parametrize("gate_up", [True, False])
def test_moe_tiles_read_every_weight_row_once(gate_up: bool, rng: np.random.Generator) -> None:
    n_out, experts = 8 * int(rng.integers(1, 40)), int(rng.integers(1, 5))
    cols_per_block = 32 if gate_up else 64
    seen: list[int] = []
    for e in range(experts):
        for n0 in range(0, n_out, cols_per_block):
            for r in range(64):
                row, col = moe_weight_row(gate_up, n_out, e, n0, r)
                if col < n_out:
                    seen.append(row)
    assert sorted(seen) == list(range(experts * n_out * (2 if gate_up else 1)))


# --- ABI: op wrappers against the compiled PTX --------------------------------------------------

@pytest.fixture(scope="module", params=MODELS)
def model_ptx(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, PtxEntry]]:
    """The model's entries: the decode down GEMVs are compiled per slot count (k and k + 1)."""
    model = request.param
    files = [f"kernels/h200/{model}/{q}/{kind}_{q}.cu" for q in FORMATS for kind in ("linear", "moe")]
    sources = (*files, f"kernels/h200/{model}/bf16/moe_experts.cu")
    build = PtxBuild("h200", model, "fp8", "compute_90a", sources)
    return model, compile_ptx_entries(build, tmp_path_factory.mktemp(model.replace(".", "_")))


def _device_weight(rt: RecordingRuntime, fmt: str, rows: int, k: int, experts: int = 0) -> QuantWeight:
    total = rows * max(experts, 1)
    q = rt.empty((total, k if fmt == "fp8" else k // 2), "u8")
    scale = rt.empty((total, -(-k // 128)), "f32") if fmt == "fp8" else rt.empty((total, k // 16), "u8")
    row_scale = None if fmt == "fp8" else rt.empty((total,), "f32")
    shape = (experts, rows, k) if experts else (rows, k)
    return QuantWeight(fmt, q, scale, row_scale, shape)  # type: ignore[arg-type]


def _run_every_op(rt: RecordingRuntime, dims: dict[str, int], rng: np.random.Generator) -> None:
    h, inter, experts, top_k = dims["hidden_size"], dims["moe_intermediate_size"], dims["num_experts"], dims["num_experts_per_tok"]
    for fmt in FORMATS:
        n = int(rng.integers(1, 5000))
        for t in (*range(1, 9), int(rng.integers(9, 700))):
            for rows in (n, 64 * rt.sm_count + n):
                ops_quant.linear(rt, rt.empty((t, h), "f32"), _device_weight(rt, fmt, rows, h))
        normed, _ = add_rms_norm(rt, rt.empty((1, h), "f32"), rt.empty((1, h), "f32"), rt.empty((h,), "f32"), 1e-6,
                                 defer=True)  # ATLAS_NORM=fused: a wide GEMV of few blocks takes it in
        ops_quant.linear(rt, normed, _device_weight(rt, fmt, 64 * rt.sm_count + n, h))
        for t in (1, int(rng.integers(2, 9)), int(rng.integers(9, 700))):
            for shared in (0, 1):  # the router's shared slot: k + 1 slots over E + 1 stacked experts
                slots, stacked = top_k + shared, experts + shared
                ops_quant.moe_experts(rt, rt.empty((t, h), "f32"), rt.empty((t, slots), "i32"), rt.empty((t, slots), "f32"),
                                      _device_weight(rt, fmt, 2 * inter, h, stacked), _device_weight(rt, fmt, h, inter, stacked))


def test_every_launch_matches_its_ptx_entry(model_ptx: tuple[str, dict[str, PtxEntry]], rng: np.random.Generator) -> None:
    model, ptx_entries = model_ptx
    rt = RecordingRuntime()
    dims = model_dims(model)
    _run_every_op(rt, dims, rng)
    for launch in rt.launches:
        assert launch.kernel in ptx_entries, f"{launch.kernel} is launched but not in the PTX"
        align, size, max_threads = ptx_entries[launch.kernel]
        assert size == ctypes.sizeof(launch.params) and align == ctypes.alignment(type(launch.params)), launch.kernel
        assert math.prod(launch.block) == max_threads, f"{launch.kernel}: block {launch.block} vs bound {max_threads}"
        assert all(g > 0 for g in launch.grid) and max(launch.grid[1:]) <= 65535, f"{launch.kernel}: grid {launch.grid}"
        p = launch.params
        if isinstance(p, kp.QuantLinearNormParams):  # atlas_qgemv_{fmt}_norm_t1
            assert (p.norm.rows, p.norm.dim) == (1, p.linear.k) and launch.block[0] == norm_threads(p.norm.dim)
            p = p.linear
        if launch.kernel.startswith("atlas_qgemv_"):
            assert int(launch.kernel.rsplit("_t", 1)[1]) == p.tokens <= 8
            rows = ops_quant.GEMV_NARROW_ROWS_PER_BLOCK if "_narrow_" in launch.kernel else ops_quant.GEMV_WIDE_ROWS_PER_BLOCK
            assert launch.grid[0] * rows >= p.n
        elif launch.kernel.startswith("atlas_qgemm_"):
            assert p.tokens > 8 and launch.grid[0] * ops_quant.GEMM_BN >= p.n and launch.grid[1] * ops_quant.GEMM_BM >= p.tokens
        elif launch.kernel.startswith("atlas_moe_qgemm_"):
            cols = ops_quant.MOE_BN // 2 if launch.kernel.endswith("gate_up") else ops_quant.MOE_BN
            assert launch.grid[0] * cols >= p.n_out and launch.grid[2] == p.num_experts
            assert launch.grid[1] * ops_quant.MOE_BM >= p.num_slots // p.top_k
        elif launch.kernel.startswith("atlas_moe_qgemv_"):
            gate_up = launch.kernel.endswith("gate_up")
            assert p.num_tokens <= ops_quant.MOE_GEMV_MAX_TOKENS and p.top_k - dims["num_experts_per_tok"] in (0, 1)
            assert gate_up or launch.kernel.endswith(f"_down_k{p.top_k}")
            assert launch.grid[0] * ops_quant.MOE_GEMV_ROWS_PER_BLOCK >= (p.inter if gate_up else p.hidden)
            assert launch.grid[1] == (p.num_tokens * p.top_k if gate_up else p.num_tokens)
    quant_entries = {e for e in ptx_entries if e.startswith(("atlas_qgemv_", "atlas_qgemm_", "atlas_moe_q"))}
    assert quant_entries <= {launch.kernel for launch in rt.launches}, "quantized entries never launched"


def test_wrapper_geometry_mirrors_the_headers() -> None:
    warps = header_constant("gemv_quant.cuh", "kQGemvThreads") // 32
    assert ops_quant.GEMV_THREADS == header_constant("gemv_quant.cuh", "kQGemvThreads")
    assert ops_quant.GEMV_WIDE_ROWS_PER_BLOCK == warps * header_constant("gemv_quant.cuh", "kQGemvWideRows")
    assert ops_quant.GEMV_NARROW_ROWS_PER_BLOCK == warps * header_constant("gemv_quant.cuh", "kQGemvNarrowRows")
    assert (ops_quant.GEMM_BM, ops_quant.GEMM_BN) == (header_constant("gemm.cuh", "kGemmBM"), header_constant("gemm.cuh", "kGemmBN"))
    assert (ops_quant.MOE_BM, ops_quant.MOE_BN) == (header_constant("moe.cuh", "kBM"), header_constant("moe.cuh", "kBN"))
    assert ops_quant.MOE_THREADS == header_constant("moe.cuh", "kGemmThreads")
    assert ops_quant.MOE_GEMV_THREADS == ops_quant.GEMV_THREADS and ops_quant.MOE_GEMV_ROWS_PER_BLOCK == warps


def test_bad_inputs_are_refused(rng: np.random.Generator) -> None:
    rt = RecordingRuntime()
    w = _device_weight(rt, "nvfp4", 32, 64)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        ops_quant.linear(rt, rt.empty((1, 40), "f32"), _device_weight(rt, "fp8", 32, 40))
    with pytest.raises(ValueError, match="vs weight"):
        ops_quant.linear(rt, rt.empty((1, 48), "f32"), w)
    with pytest.raises(ValueError, match="row scales"):
        ops_quant.linear(rt, rt.empty((1, 64), "f32"), QuantWeight("nvfp4", w.q, w.scale, None, w.shape))
    with pytest.raises(ValueError, match="dtype"):
        ops_quant.linear(rt, rt.empty((1, 64), "bf16"), w)
    assert rt.launches == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_loader_weights_convert_to_the_device_layout(fmt: str, rng: np.random.Generator) -> None:
    from atlas.backends.cuda.quant_weights import from_quantized_weight
    from atlas.quant.stored import QuantizedWeight

    n, k = int(rng.integers(1, 300)), 16 * int(rng.integers(1, 30))
    dense = rng.standard_normal((n, k)).astype(np.float32)
    if fmt == "fp8":
        q = quantize_fp8_block(dense)
        parts = {"weight": q.weight, "weight_scale_inv": q.scale_inv.astype(np.float16)}
    else:
        q4 = quantize_nvfp4(dense)
        parts = {"weight": q4.weight, "weight_scale": q4.weight_scale, "weight_scale_2": q4.weight_scale_2,
                 "input_scale": q4.input_scale}
    stored = QuantizedWeight("m.weight", fmt, (n, k), parts, (128, 128))
    np.testing.assert_array_equal(from_quantized_weight(stored).dequantize(), stored.dequantize())


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def emulate_moe_decode(x: np.ndarray, ids: np.ndarray, route: np.ndarray, gate_up: HostQuantWeight,
                       down: HostQuantWeight, experts: int) -> np.ndarray:
    """moe_quant.cuh moe_qgemv_gate_up / moe_qgemv_down row indexing on the stacked matrices."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    inter = gate_up.rows // experts // 2
    gu, dn = gate_up.dequantize(), down.dequantize()  # [E*2I, H], [E*H, I]
    act = np.zeros((tokens * top_k, inter), dtype=np.float64)
    for slot in range(tokens * top_k):
        e = ids.reshape(-1)[slot]
        gate_rows = e * 2 * inter + np.arange(inter)
        act[slot] = _silu(gu[gate_rows] @ x[slot // top_k]) * (gu[gate_rows + inter] @ x[slot // top_k])
    out = np.zeros((tokens, hidden), dtype=np.float64)
    for t in range(tokens):
        for j in range(top_k):
            rows = ids[t, j] * hidden + np.arange(hidden)
            out[t] += route[t, j] * (dn[rows] @ act[t * top_k + j])
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_decode_indexing_matches_the_numpy_backend(fmt: str, rng: np.random.Generator) -> None:
    from atlas.backends.numpy_backend import NumpyBackend

    experts, top_k, hidden, inter, tokens = 6, 2, 64, 32, int(rng.integers(1, 9))
    gate = [_quantized(fmt, inter, hidden, rng) for _ in range(experts)]
    up = [_quantized(fmt, inter, hidden, rng) for _ in range(experts)]
    down = [_quantized(fmt, hidden, inter, rng) for _ in range(experts)]
    gate_up_host = stack_rows([w for e in range(experts) for w in (gate[e][0], up[e][0])])
    down_host = stack_rows([d[0] for d in down])
    gate_up_ref = np.stack([np.concatenate([gate[e][1], up[e][1]]) for e in range(experts)])  # [E, 2I, H]
    down_ref = np.stack([d[1] for d in down])  # [E, H, I]
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).astype(np.int32)
    route = rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)
    expected = NumpyBackend().moe_experts(x, ids, route, gate_up_ref, down_ref)
    got = emulate_moe_decode(x, ids, route, gate_up_host, down_host, experts)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())  # f32 reference


def test_cuda_backend_upload_quantized(rng: np.random.Generator) -> None:
    """The loader hook packs (u8 codes, scales, row scales) and names an unsupported layout in one line."""
    from atlas.backends.cuda.backend import CudaBackend
    from atlas.errors import AtlasError
    from atlas.quant.stored import QuantizedWeight

    @dataclass
    class FakeUploader:
        arrays: list[tuple[np.ndarray, str]] = field(default_factory=list)

        def upload(self, array: np.ndarray, dtype: str) -> DeviceTensor:
            self.arrays.append((np.array(array), dtype))
            return DeviceTensor(4096 * len(self.arrays), tuple(array.shape), dtype)  # type: ignore[arg-type]

    backend = CudaBackend.__new__(CudaBackend)
    backend.uploader = FakeUploader()  # type: ignore[assignment]
    q4 = quantize_nvfp4(rng.standard_normal((24, 64)).astype(np.float32))
    parts = {"weight": q4.weight, "weight_scale": q4.weight_scale, "weight_scale_2": q4.weight_scale_2}
    w = backend.upload_quantized(QuantizedWeight("m.weight", "nvfp4", (24, 64), parts, (128, 128)))
    assert w.shape == (24, 64) and w.format == "nvfp4" and w.row_scale is not None
    assert [(a.shape, d) for a, d in backend.uploader.arrays] == [((24, 32), "u8"), ((24, 4), "u8"), ((24,), "f32")]
    q8 = quantize_fp8_block(rng.standard_normal((24, 64)).astype(np.float32), (128, 64))
    with pytest.raises(AtlasError, match="m.weight: fp8 kernels read 128-column scale blocks"):
        backend.upload_quantized(QuantizedWeight("m.weight", "fp8", (24, 64),
                                                 {"weight": q8.weight, "weight_scale_inv": q8.scale_inv}, (128, 64)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_demo_through_the_device_layout_gives_the_same_logits(fmt: str, tmp_path: Path) -> None:
    """Every weight the loader hands to upload_quantized, converted to the kernels' layout and
    evaluated by its numpy model (quant_weights.dequantize), runs the quantized demo exactly."""
    from atlas.backends.cuda.quant_weights import from_quantized_weight
    from atlas.backends.numpy_backend import NumpyBackend
    from atlas.config import load_spec
    from atlas.demo import DEMO_DIR, zen_of_python
    from atlas.engine import Engine
    from atlas.quantize import QuantizeArgs, quantize
    from atlas.safetensors import Checkpoint
    from atlas.tokenizer import Tokenizer

    class DeviceLayoutBackend(NumpyBackend):
        """The CUDA backend's two loader hooks, with the kernels' numpy model in place of the upload."""

        def __init__(self) -> None:
            super().__init__()
            self.converted = 0
            self.stacks: list[tuple[int, bool, int]] = []  # (matrices, rows selected, experts)

        def upload_quantized(self, weight: Any) -> np.ndarray:
            self.converted += 1
            return from_quantized_weight(weight).dequantize()

        def upload_quantized_rows(self, weights: list[Any], rows: np.ndarray | None, experts: int) -> np.ndarray:
            self.stacks.append((len(weights), rows is not None, experts))
            host = stack_rows([from_quantized_weight(w) for w in weights])
            dense = (host if rows is None else host.take_rows(rows)).dequantize()
            return dense.reshape(experts, -1, host.k) if experts else dense

    model_dir = quantize(QuantizeArgs(str(DEMO_DIR), fmt, tmp_path / fmt, 1 << 30))
    ids = Tokenizer.open(DEMO_DIR).encode(zen_of_python())[:40]
    run = lambda backend: Engine(load_spec(model_dir), Checkpoint.open(model_dir), backend, max_seq_len=64).logits(ids)  # noqa: E731
    backend = DeviceLayoutBackend()
    ours = run(backend)
    spec = load_spec(model_dir)
    full = spec.layer_types.count("full_attention")
    assert backend.converted > 0
    assert backend.stacks.count((3, True, 0)) == full  # q_proj (q and gate rows), k_proj, v_proj fused
    stacked = spec.num_experts + 1  # the demo's shared expert has the routed size: stacked as expert E
    assert backend.stacks.count((2 * stacked, False, stacked)) == spec.num_hidden_layers
    assert backend.stacks.count((stacked, False, stacked)) == spec.num_hidden_layers
    linear = spec.num_hidden_layers - full  # in_proj_qkv + in_proj_z fused (b and a stay bf16)
    assert backend.stacks.count((2, False, 0)) == linear
    np.testing.assert_array_equal(ours, run(NumpyBackend()))
