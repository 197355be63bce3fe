"""CPU checks of the tensor-core prefill attention (attention_mma.cuh; no GPU needed).

The wrapper's launch (ATLAS_PREFILL_ATTENTION=mma) against the PTX entry nvcc makes here, its
geometry against the header's constants, and a numpy emulation of the kernel's fragment index
math: per block and warp, the ldmatrix / ldmatrix.trans addresses, the mma.sync m16n8k16 fragment
layouts of the PTX ISA, the quad reductions of the online softmax, bf16 rounding of Q and P, the
causal mask by each row's position and the stores. The emulation must equal the float32 reference
on bf16-rounded inputs, give every visible key (and no other) a non-zero weight, and write every
output element exactly once. Fresh random inputs every run.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import pytest

from atlas.backends.cuda import ops_dense
from atlas.backends.base import KVCache
from atlas.backends.numpy_backend import NumpyBackend
from atlas.errors import AtlasError

from _abi import MODELS, PtxBuild, PtxEntry, RecordingRuntime, compile_ptx_entries, header_constant, model_dims
from test_kernel_math_abi import ldmatrix_x4 as ldmatrix_x4_lanes, mma_16816 as mma_16816_lanes

ROWS, KEYS, PAD = ops_dense.ATTN_MMA_ROWS, ops_dense.ATTN_MMA_KEYS, ops_dense.ATTN_MMA_PAD
WARPS = ops_dense.ATTN_MMA_THREADS // 32
LANES = np.arange(32)
GROUP, IN_GROUP = LANES // 4, LANES % 4  # groupID (row of a fragment), threadID_in_group
PAIR = np.arange(2)
SMEM_OPTIN_MIN = 99 * 1024  # the smallest per-block opt-in of the targets' devices (sm_86/89/120/121)
Address = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


def bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


# --- fragments, vectorised over the 32 lanes (PTX ISA layouts) -------------------------------------
def ldmatrix_x4(tile: np.ndarray, address: Address) -> np.ndarray:
    """ldmatrix.m8n8.x4.b16: lane l gives the row start of matrix l/8, row l%8; every lane
    receives row lane/4, columns 2*(lane%4) + {0, 1} of each matrix. -> [4, 32 lanes, 2]."""
    regs = np.empty((4, 32, 2))
    for i in range(4):
        row, col = address(8 * i + GROUP)
        regs[i] = tile[row[:, None], col[:, None] + 2 * IN_GROUP[:, None] + PAIR]
    return regs


def ldmatrix_x4_trans(tile: np.ndarray, address: Address) -> np.ndarray:
    """ldmatrix...x4.trans: each 8x8 matrix delivered transposed, lane l receiving elements
    (rows 2*(l%4) + {0, 1}, column l/4) of the matrix as stored."""
    regs = np.empty((4, 32, 2))
    for i in range(4):
        for j in range(2):
            row, col = address(8 * i + 2 * IN_GROUP + j)
            regs[i, :, j] = tile[row, col + GROUP]
    return regs


def mma_16816(acc: np.ndarray, a: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> None:
    """acc [32, 4] += A [16x16] @ B [16x8], A from a [4, 32, 2] (row-major A), B from b0, b1 [32, 2]."""
    a_mat, b_mat = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
    g, c = GROUP[:, None], 2 * IN_GROUP[:, None] + PAIR
    a_mat[g, c], a_mat[g + 8, c], a_mat[g, c + 8], a_mat[g + 8, c + 8] = a
    b_mat[c, g], b_mat[c + 8, g] = b0, b1
    d = a_mat @ b_mat
    c0 = 2 * IN_GROUP
    acc += np.stack([d[GROUP, c0], d[GROUP, c0 + 1], d[GROUP + 8, c0], d[GROUP + 8, c0 + 1]], -1)


def test_vectorised_fragments_equal_the_per_lane_ones(rng: np.random.Generator) -> None:
    tile = rng.standard_normal((32, 40))
    address: Address = lambda l: (l % 16, 8 + (l // 16) * 8)  # noqa: E731
    np.testing.assert_array_equal(ldmatrix_x4(tile, address), ldmatrix_x4_lanes(tile, lambda l: address(np.asarray(l))))
    a, b = rng.standard_normal((4, 32, 2)), rng.standard_normal((2, 32, 2))
    want, got = np.zeros((32, 4)), np.zeros((32, 4))
    mma_16816_lanes(want, a, b)
    mma_16816(got, a, b[0], b[1])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # .trans of a row-major tile is the plain load of its transpose
    np.testing.assert_array_equal(ldmatrix_x4_trans(tile, lambda l: (l % 16, (l // 16) * 8)),
                                  ldmatrix_x4(tile.T, lambda l: ((l // 16) * 8 + (l % 8), l % 16 // 8 * 8)))


# --- the kernel, block by block ----------------------------------------------------------------------
@dataclass
class Problem:
    q: np.ndarray  # [T, Hq, D] bf16 values
    k_cache: np.ndarray  # [S, Hkv, D] bf16 values, NaN past the live keys
    v_cache: np.ndarray
    positions: np.ndarray  # [T] i32
    scale: float


@dataclass
class Result:
    out: np.ndarray  # [T, Hq, D]
    writes: np.ndarray  # [T, Hq, D] store count
    weighted: dict[tuple[int, int], set[int]] = field(default_factory=dict)  # (token, head) -> keys with P > 0


@dataclass
class WarpRows:
    """One warp's lanes: o [32, D/8, 4], m, l, last_key [32, 2] (half 0: row lane/4, half 1: +8)."""

    o: np.ndarray
    m: np.ndarray
    l: np.ndarray
    last_key: np.ndarray
    rows: np.ndarray  # [32, 2] block-level row index


def _row_of(prob: Problem, kv_head: int, row: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tokens, q_heads, _ = prob.q.shape
    group = q_heads // prob.k_cache.shape[1]
    valid = row < tokens * group
    return valid, np.where(valid, row // group, 0), kv_head * group + np.where(valid, row % group, 0)


def _smem_tile(rows: int, dim: int) -> np.ndarray:
    return np.full((rows, dim + PAD), np.nan)  # pads are never read: NaN would show


def _scores(q_s: np.ndarray, k_s: np.ndarray, warp: int) -> np.ndarray:
    s = np.zeros((KEYS // 8, 32, 4))
    for ks in range(0, q_s.shape[1] - PAD, 16):
        a = ldmatrix_x4(q_s, lambda l: (warp * 16 + l % 16, ks + (l // 16) * 8))
        for np_ in range(KEYS // 16):
            b = ldmatrix_x4(k_s, lambda l: (np_ * 16 + l % 8 + (l // 16) * 8, ks + ((l // 8) % 2) * 8))
            mma_16816(s[2 * np_], a, b[0], b[1])
            mma_16816(s[2 * np_ + 1], a, b[2], b[3])
    return s


def _softmax(s: np.ndarray, key0: int, scale_log2: float, w: WarpRows) -> np.ndarray:
    """Online softmax update; returns P (bf16 values) as A fragments [KEYS/16, 4, 32, 2]."""
    pa = np.empty((KEYS // 16, 4, 32, 2))
    for half in range(2):
        keys = key0 + np.arange(KEYS // 8)[:, None, None] * 8 + 2 * IN_GROUP[:, None] + PAIR  # [t, lane, 2]
        vals = s[:, :, 2 * half:2 * half + 2]
        vals = np.where(keys <= w.last_key[None, :, half, None], vals * scale_log2, -np.inf)
        mx = np.maximum(w.m[:, half], vals.max(axis=(0, 2)))
        mx = np.repeat(mx.reshape(8, 4).max(axis=1), 4)  # shuffles xor 1, 2: the quad's max
        base = np.where(mx == -np.inf, 0.0, mx)
        alpha = np.exp2(w.m[:, half] - base)
        w.m[:, half] = mx
        w.o[:, :, 2 * half:2 * half + 2] *= alpha[:, None, None]
        p = bf16(np.exp2(vals - base[None, :, None]))
        w.l[:, half] = w.l[:, half] * alpha + p.sum(axis=(0, 2))
        for t in range(KEYS // 8):
            pa[t // 2, (t % 2) * 2 + half] = p[t]
    return pa


def _values(v_s: np.ndarray, pa: np.ndarray, w: WarpRows) -> None:
    dim = v_s.shape[1] - PAD
    for kk in range(KEYS // 16):
        for dp in range(dim // 16):
            b = ldmatrix_x4_trans(v_s, lambda l: (kk * 16 + l % 16, dp * 16 + (l // 16) * 8))
            mma_16816(w.o[:, 2 * dp], pa[kk], b[0], b[1])
            mma_16816(w.o[:, 2 * dp + 1], pa[kk], b[2], b[3])


def _record_weights(prob: Problem, kv_head: int, key0: int, pa: np.ndarray, w: WarpRows, result: Result) -> None:
    for kk in range(KEYS // 16):
        for reg in range(4):
            half, key = reg % 2, key0 + kk * 16 + (reg // 2) * 8 + 2 * IN_GROUP[:, None] + PAIR  # [lane, 2]
            valid, token, head = _row_of(prob, kv_head, w.rows[:, half])
            for lane in np.flatnonzero(valid):
                seen = result.weighted.setdefault((int(token[lane]), int(head[lane])), set())
                seen.update(int(k) for k in key[lane][pa[kk, reg, lane] > 0])


def _store(prob: Problem, kv_head: int, w: WarpRows, result: Result) -> None:
    dim = prob.q.shape[2]
    for half in range(2):
        l = np.repeat(w.l[:, half].reshape(8, 4).sum(axis=1), 4)  # shuffles xor 1, 2
        valid, token, head = _row_of(prob, kv_head, w.rows[:, half])
        inv = np.where(l > 0, 1.0 / np.where(l > 0, l, 1.0), 0.0)
        for lane in np.flatnonzero(valid):
            cols = np.arange(dim // 8)[:, None] * 8 + 2 * IN_GROUP[lane] + PAIR  # float2 stores
            result.out[token[lane], head[lane], cols] = w.o[lane, :, 2 * half:2 * half + 2] * inv[lane]
            result.writes[token[lane], head[lane], cols] += 1


def _block(prob: Problem, row_tile: int, kv_head: int, result: Result) -> None:
    """attention_prefill_mma for block (row tile, kv head) of its grid."""
    dim, capacity = prob.q.shape[2], prob.k_cache.shape[0]
    row0 = row_tile * ROWS
    valid, token, head = _row_of(prob, kv_head, row0 + np.arange(ROWS))
    q_s = _smem_tile(ROWS, dim)
    q_s[:, :dim] = np.where(valid[:, None], prob.q[token, head], 0.0)
    pos = prob.positions[token]
    key_end = max([min(int(p) + 1, capacity) for p in pos[valid]], default=0)
    warps = []
    for warp in range(WARPS):
        rows = row0 + warp * 16 + GROUP[:, None] + np.array([0, 8])  # [32, 2]
        ok, tok, _ = _row_of(prob, kv_head, rows)
        last_key = np.minimum(np.where(ok, prob.positions[tok], -1), key_end - 1)
        warps.append(WarpRows(np.zeros((32, dim // 8, 4)), np.full((32, 2), -np.inf), np.zeros((32, 2)), last_key, rows))
    for key0 in range(0, key_end, KEYS):
        k_s, v_s = _smem_tile(KEYS, dim), _smem_tile(KEYS, dim)
        live = np.arange(key0, key0 + KEYS) < key_end  # cp.async zero-fills the rest
        k_s[:, :dim] = np.where(live[:, None], prob.k_cache[np.minimum(key0 + np.arange(KEYS), capacity - 1), kv_head], 0)
        v_s[:, :dim] = np.where(live[:, None], prob.v_cache[np.minimum(key0 + np.arange(KEYS), capacity - 1), kv_head], 0)
        for warp, w in enumerate(warps):
            pa = _softmax(_scores(q_s, k_s, warp), key0, prob.scale * math.log2(math.e), w)
            _record_weights(prob, kv_head, key0, pa, w, result)
            _values(v_s, pa, w)
    for w in warps:
        _store(prob, kv_head, w, result)


def emulate_prefill_mma(prob: Problem) -> Result:
    tokens, q_heads, dim = prob.q.shape
    kv_heads = prob.k_cache.shape[1]
    result = Result(np.full(prob.q.shape, np.nan), np.zeros(prob.q.shape, np.int64))
    tiles = -(-tokens * (q_heads // kv_heads) // ROWS)
    for kv_head in range(kv_heads):
        for row_tile in range(tiles):
            _block(prob, row_tile, kv_head, result)
    return result


def _problem(rng: np.random.Generator, shape: tuple[int, int, int, int], tokens: int, start: int) -> tuple[Problem, np.ndarray]:
    """A prompt of `tokens` at positions start.. with the prefix in the cache; -> (problem, reference)."""
    q_heads, kv_heads, dim, capacity = shape
    q = bf16(rng.standard_normal((tokens, q_heads, dim)))
    k_cache, v_cache = (bf16(rng.standard_normal((capacity, kv_heads, dim))) for _ in range(2))
    positions = np.arange(start, start + tokens, dtype=np.int32)
    live = min(start + tokens, capacity)
    k_cache[live:], v_cache[live:] = np.nan, np.nan  # never written: must never be read
    scale = dim**-0.5
    ref = NumpyBackend().attention(q.astype(np.float32), k_cache[start:live].astype(np.float32),
                                   v_cache[start:live].astype(np.float32),
                                   KVCache(k_cache.astype(np.float32).copy(), v_cache.astype(np.float32).copy()),
                                   positions, scale)
    return Problem(q, k_cache, v_cache, positions, scale), ref


CASES = [((4, 2, 64, 300), 5, 0), ((4, 2, 64, 300), 17, None), ((4, 2, 64, 300), 70, None),
         ((8, 1, 128, 200), 9, None), ((16, 2, 256, 128), 9, None)]


@pytest.mark.parametrize("shape,tokens,start", CASES)
def test_emulated_kernel_equals_the_reference(rng: np.random.Generator, shape: tuple[int, int, int, int],
                                              tokens: int, start: int | None) -> None:
    if start is None:
        start = int(rng.integers(1, shape[3] - tokens + 1))  # a prefix already in the cache
    prob, ref = _problem(rng, shape, tokens, start)
    got = emulate_prefill_mma(prob)
    assert (got.writes == 1).all(), f"store counts {np.unique(got.writes)} (each element exactly once)"
    for (token, head), keys in got.weighted.items():
        assert keys == set(range(int(prob.positions[token]) + 1)), f"token {token} head {head}: wrong visible keys"
    assert len(got.weighted) == prob.q.shape[0] * prob.q.shape[1]
    err = np.linalg.norm(got.out - ref) / np.linalg.norm(ref)  # P in bf16 is the only extra rounding
    assert err < 4e-3, f"relative error {err:.2e}"
    np.testing.assert_allclose(got.out, ref, rtol=0, atol=1e-2)


# --- the wrapper: launch, PTX entry, geometry ---------------------------------------------------------
@pytest.fixture(scope="module", params=MODELS)
def ptx_entries(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, PtxEntry]]:
    model = request.param
    sources = (f"kernels/sm80/{model}/bf16/attention_mma.cu",)
    found = compile_ptx_entries(PtxBuild("sm80", model, "bf16", "compute_80", sources),
                                tmp_path_factory.mktemp(model.replace(".", "_")))
    return model, found


def _attention(rt: RecordingRuntime, dims: dict[str, int], tokens: int, capacity: int, prefill: str) -> None:
    hq, hkv, d = dims["num_attention_heads"], dims["num_key_value_heads"], dims["head_dim"]
    f = lambda *s: rt.empty(s, "f32")  # noqa: E731
    caches = [rt.empty((capacity, hkv, d), "bf16") for _ in range(2)]
    ops_dense.attention(rt, f(tokens, hq, d), f(tokens, hkv, d), f(tokens, hkv, d), KVCache(*caches),
                        rt.empty((tokens,), "i32"), d**-0.5, prefill=prefill)


def test_mma_launches_match_their_ptx_entries(ptx_entries: tuple[str, dict[str, PtxEntry]], rng: np.random.Generator) -> None:
    """The bf16 form and each quantized level's (the same params, grid and smem)."""
    from atlas.backends.cuda.ops_kv import QUANTIZED_LEVELS

    model, entries = ptx_entries
    dims = model_dims(model)
    hq, hkv, d = dims["num_attention_heads"], dims["num_key_value_heads"], dims["head_dim"]
    rt = RecordingRuntime()
    tokens = int(rng.integers(ops_dense.ATTN_DECODE_MAX_TOKENS + 1, 5000))
    capacity = tokens + int(rng.integers(0, 9000))
    _attention(rt, dims, tokens, capacity, "mma")
    launches = [rt.launches[-1]]
    for level in QUANTIZED_LEVELS:
        cache = ops_dense.CachedKV(1 << 20, 1 << 21, capacity, hkv, f"_{level}")
        ops_dense.attend(rt, rt.empty((tokens, hq, d), "f32"), cache, rt.empty((tokens,), "i32"), d**-0.5, prefill="mma")
        launches.append(rt.launches[-1])
    assert [launch.kernel for launch in launches] == ["atlas_attention_prefill_mma"] + [
        f"atlas_attention_prefill_mma_{level}" for level in QUANTIZED_LEVELS]
    assert set(entries) == {launch.kernel for launch in launches}
    for launch in launches:
        entry = entries[launch.kernel]
        assert entry.param_bytes == ctypes.sizeof(launch.params) and entry.align == ctypes.alignment(type(launch.params))
        assert launch.block == (entry.max_threads, 1, 1) == (ops_dense.ATTN_MMA_THREADS, 1, 1)
        p = launch.params
        assert p.ml is None and p.tokens == tokens and p.head_dim == d and p.capacity == capacity
        rows = tokens * (p.q_heads // p.kv_heads)
        assert launch.grid == (-(-rows // ROWS), p.kv_heads, 1)
        assert launch.smem == ops_dense.attention_mma_smem_bytes(p.head_dim) <= SMEM_OPTIN_MIN


def test_decode_keeps_its_kernels_and_each_level_takes_its_prefill_form(rng: np.random.Generator) -> None:
    dims = model_dims("qwen3.6-35b-a3b")
    rt = RecordingRuntime()
    for tokens in range(1, ops_dense.ATTN_DECODE_MAX_TOKENS + 1):
        _attention(rt, dims, tokens, 4096, "mma")
    assert "atlas_attention_prefill_mma" not in {launch.kernel for launch in rt.launches}
    _attention(rt, dims, int(rng.integers(5, 900)), 4096, "simt")
    assert rt.launches[-1].kernel == "atlas_attention_prefill"
    cache = ops_dense.CachedKV(1 << 20, 1 << 21, 4096, 2, "_fp8")
    for form, kernel in (("simt", "atlas_attention_prefill_fp8"), ("mma", "atlas_attention_prefill_mma_fp8")):
        ops_dense.attend(rt, rt.empty((64, 16, 256), "f32"), cache, rt.empty((64,), "i32"), 1 / 16, prefill=form)
        assert rt.launches[-1].kernel == kernel
    ops_dense.attend(rt, rt.empty((3, 16, 256), "f32"), cache, rt.empty((3,), "i32"), 1 / 16, prefill="mma")
    assert rt.launches[-2].kernel == "atlas_attention_decode_fp8"


def test_wrapper_geometry_mirrors_the_header() -> None:
    for wrapper, name in ((ROWS, "kMmaAttnRows"), (KEYS, "kMmaAttnKeys"), (PAD, "kMmaAttnPad"),
                          (WARPS, "kMmaAttnWarps")):
        assert wrapper == header_constant("attention_mma.cuh", name), name
    for dim in ops_dense.ATTN_HEAD_DIMS:
        assert ops_dense.attention_mma_smem_bytes(dim) == 2 * (ROWS + 2 * KEYS) * (dim + PAD) <= SMEM_OPTIN_MIN


def test_prefill_form_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ops_dense.PREFILL_ATTENTION_ENV, raising=False)
    assert ops_dense.prefill_attention_form() == "mma"
    monkeypatch.setenv(ops_dense.PREFILL_ATTENTION_ENV, "simt")
    assert ops_dense.prefill_attention_form() == "simt"
    assert ops_dense.prefill_attention_form("mma") == "mma"
    monkeypatch.setenv(ops_dense.PREFILL_ATTENTION_ENV, "flash")
    with pytest.raises(AtlasError, match="ATLAS_PREFILL_ATTENTION='flash'.*'mma'"):
        ops_dense.prefill_attention_form()


@pytest.mark.parametrize("form", ["simt", "mma"])
def test_backend_reads_the_form_once_and_opts_into_the_smem(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator,
                                                            form: str) -> None:
    """CudaBackend on the fake driver: ATLAS_PREFILL_ATTENTION at construction picks the prefill
    kernel, over the bf16 cache and over a quantized level; the mma kernel's dynamic smem above
    48 KiB (D 256) is raised before its launch."""
    from atlas.backends.cuda.backend import CudaBackend
    from test_cuda_select import make_runtime

    monkeypatch.setenv(ops_dense.PREFILL_ATTENTION_ENV, form)
    rt, driver = make_runtime()
    backend = CudaBackend(rt, use_graphs=False)
    monkeypatch.setenv(ops_dense.PREFILL_ATTENTION_ENV, "simt" if form == "mma" else "mma")  # read once: ignored
    tokens, (hq, hkv, d) = int(rng.integers(5, 200)), (16, 2, 256)
    f = lambda *s: rt.empty(s, "f32")  # noqa: E731
    caches = [rt.zeros((256, hkv, d), "bf16") for _ in range(2)]
    backend.attention(f(tokens, hq, d), f(tokens, hkv, d), f(tokens, hkv, d), KVCache(*caches), rt.empty((tokens,), "i32"),
                      1 / 16)
    kernel, grid, _, smem = driver.launches[-1]
    assert kernel == {"simt": "atlas_attention_prefill", "mma": "atlas_attention_prefill_mma"}[form]
    if form == "mma":
        assert grid == (-(-tokens * hq // hkv // ROWS), hkv, 1)
        assert smem == driver.smem_raised[kernel] == ops_dense.attention_mma_smem_bytes(d) > 48 * 1024
    quantized = [backend.quantized_kv_cache("turbo4", (256, hkv, d)) for _ in range(2)]
    backend.attention(f(tokens, hq, d), f(tokens, hkv, d), f(tokens, hkv, d), KVCache(*quantized),
                      rt.empty((tokens,), "i32"), 1 / 16)
    kernel, _, _, smem = driver.launches[-1]
    assert kernel == {"simt": "atlas_attention_prefill_turbo4", "mma": "atlas_attention_prefill_mma_turbo4"}[form]
    assert form == "simt" or smem == driver.smem_raised[kernel] == ops_dense.attention_mma_smem_bytes(d)
    monkeypatch.setenv(ops_dense.PREFILL_ATTENTION_ENV, "tensor")
    with pytest.raises(AtlasError, match="ATLAS_PREFILL_ATTENTION"):
        CudaBackend(rt, use_graphs=False)
