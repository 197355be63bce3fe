"""CPU-side checks of the quantized KV cache kernels (kernels/include/atlas/kv_quant.cuh).

1. ABI: the ops_kv wrappers, run against a recording runtime, launch entries of the PTX compiled
   here whose by-value parameter has the size of the params struct, with grids covering the work.
2. A numpy emulation of the kernels' arithmetic, lane by lane: the writer's bit tricks (e4m3 by
   integer rounding, e2m1 by thresholds, the codebook search in float64, the lane-split WHT, the
   RMS in numpy's pairwise order, byte packing by output byte) must give exactly the bytes of
   atlas.kvcache's encoder laid out as ops_kv's buffer; the attention tile's per-element decode
   must give exactly the level's values (in the rotated basis for the turbo levels), and rotating
   q instead of un-rotating keys must leave scores and outputs unchanged.
"""

from __future__ import annotations

import ctypes
import math
import re

import numpy as np
import pytest

from atlas.backends.base import KVCache
from atlas.backends.cuda import ops_kv
from atlas.kvcache.codebooks import CODEBOOKS
from atlas.kvcache.hadamard import rotate, sign_flips, unrotate
from atlas.kvcache.levels import LEVELS

from _abi import MODELS, REPO, PtxBuild, PtxEntry, RecordingRuntime, compile_ptx_entries, header_constant, model_dims

LEVEL_NAMES = ops_kv.QUANTIZED_LEVELS
WARP = 32
HEADER = REPO / "kernels/include/atlas/kv_quant.cuh"


# --- ABI ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=MODELS)
def ptx_entries(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, PtxEntry]]:
    model = request.param
    sources = (f"kernels/sm80/{model}/bf16/kv_quant.cu", f"kernels/sm80/{model}/bf16/attention.cu")
    found = compile_ptx_entries(PtxBuild("sm80", model, "bf16", "compute_80", sources),
                                tmp_path_factory.mktemp(model.replace(".", "_")))
    assert found, "no kv entries parsed from the PTX"
    return model, found


def _cache(rt: RecordingRuntime, level: str, shape: tuple[int, int, int]) -> ops_kv.QuantizedKVCache:
    return ops_kv.QuantizedKVCache(level, shape, rt.empty((ops_kv.cache_bytes(level, shape),), "u8"))


def test_every_launch_matches_its_ptx_entry(ptx_entries: tuple[str, dict[str, PtxEntry]], rng: np.random.Generator) -> None:
    model, entries = ptx_entries
    dims = model_dims(model)
    hq, hkv, d = dims["num_attention_heads"], dims["num_key_value_heads"], dims["head_dim"]
    rt = RecordingRuntime()
    for level in LEVEL_NAMES:
        capacity = int(rng.integers(700, 40_000))
        for tokens in (int(rng.integers(1, 5)), int(rng.integers(5, 700))):
            caches = [_cache(rt, level, (capacity, hkv, d)) for _ in range(2)]
            f = lambda *s: rt.empty(s, "f32")  # noqa: E731
            ops_kv.attention(rt, f(tokens, hq, d), f(tokens, hkv, d), f(tokens, hkv, d), KVCache(*caches),
                             rt.empty((tokens,), "i32"), d**-0.5)
    launched = set()
    for launch in rt.launches:
        launched.add(launch.kernel)
        assert launch.kernel in entries, f"{launch.kernel} is launched but not in the {model} PTX"
        entry = entries[launch.kernel]
        assert entry.param_bytes == ctypes.sizeof(launch.params), f"{launch.kernel}: param size"
        assert entry.align == ctypes.alignment(type(launch.params)), f"{launch.kernel}: alignment"
        threads = math.prod(launch.block)
        assert 0 < threads <= entry.max_threads and threads % 32 == 0, f"{launch.kernel}: block {launch.block}"
        p = launch.params
        if launch.kernel.startswith("atlas_kv_write_"):
            assert launch.grid[0] * ops_kv.KV_WRITE_WARPS >= 2 * p.tokens * p.kv_heads
            assert p.k_cache != p.v_cache and p.capacity >= 700
    quantized = {e for e in entries if e.startswith(("atlas_kv_write_", "atlas_attention_decode_", "atlas_attention_prefill_"))}
    assert quantized == launched - {"atlas_attention_combine"}, f"never launched: {quantized - launched}"


def test_wrapper_constants_mirror_the_header() -> None:
    assert ops_kv.KV_WRITE_WARPS == header_constant("kv_quant.cuh", "kKvWriteWarps")
    text = HEADER.read_text()
    for bits, name in ((4, "kLloydMax4"), (3, "kLloydMax3")):
        body = re.search(rf"{name}\[\d+\] = \{{(.*?)\}};", text, re.S)
        assert body, name
        values = np.array([float(v.strip().rstrip("f")) for v in body[1].split(",")], dtype=np.float32)
        assert np.array_equal(values, CODEBOOKS[bits]), f"{name} differs from codebooks.py"


def test_bad_caches_are_refused() -> None:
    rt = RecordingRuntime()
    k_cache, v_cache = _cache(rt, "fp8", (64, 2, 128)), _cache(rt, "turbo4", (64, 2, 128))
    f = lambda *s: rt.empty(s, "f32")  # noqa: E731
    with pytest.raises(ValueError, match="k cache fp8"):
        ops_kv.attention(rt, f(1, 4, 128), f(1, 2, 128), f(1, 2, 128), KVCache(k_cache, v_cache), rt.empty((1,), "i32"), 0.1)
    assert rt.launches == []


# --- emulation of the writer ----------------------------------------------------------------------
F32 = np.float32


def emu_e4m3(x: np.ndarray) -> np.ndarray:
    """kv_f32_to_e4m3."""
    x = x.astype(F32)
    sign = (x.view(np.uint32) >> 24) & 0x80
    a = np.minimum(np.abs(x), F32(448))
    sub = np.rint(a * F32(512)).astype(np.uint32)
    bits = a.view(np.uint32).astype(np.uint64)
    normal = (((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - 960).astype(np.uint32)
    return (sign | np.where(a < F32(0.015625), sub, normal)).astype(np.uint8)


def emu_e2m1(x: np.ndarray) -> np.ndarray:
    """kv_f32_to_e2m1."""
    sign = (x.astype(F32).view(np.uint32) >> 28) & 8
    a = np.abs(x)
    edges = [(0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False), (5.0, True)]
    code = np.zeros(a.shape, dtype=np.uint32)
    for edge, inclusive in edges:  # code = number of edges below a (ties to the even side)
        code += (a > edge) if inclusive else (a >= edge)
    return (sign | code).astype(np.uint8)


def emu_codebook(x: np.ndarray, book: np.ndarray) -> np.ndarray:
    """kv_codebook_index: the linear search in float64."""
    first = float(book[0])
    shifted = book.astype(np.float64) - first
    m = np.minimum(np.maximum(x.astype(np.float64) - first, 0.0), shifted[-1])
    upper = 1 + np.sum(shifted[None, 1:-1] < m.reshape(-1, 1), axis=1).reshape(m.shape)
    below, above = m - shifted[upper - 1], shifted[upper] - m
    take = (above < below) | ((above == below) & (upper % 2 == 0))
    return np.where(take, upper, upper - 1).astype(np.uint8)


def emu_wht(v: np.ndarray) -> np.ndarray:
    """kv_wht on [N, 32 lanes, P]: in-lane butterflies, then across lanes by shuffles."""
    v = v.astype(F32).copy()
    p = v.shape[2]
    half = 1
    while half < p:
        for e in range(p):
            if e & half:
                continue
            a, b = v[:, :, e].copy(), v[:, :, e + half].copy()
            v[:, :, e], v[:, :, e + half] = a + b, a - b
        half *= 2
    lanes = np.arange(WARP)
    bit = 1
    while bit < WARP:
        other = v[:, lanes ^ bit, :]
        high = (lanes & bit) != 0
        v = np.where(high[None, :, None], other - v, v + other).astype(F32)
        bit *= 2
    return v * F32(1.0 / math.sqrt(p * WARP))


def emu_sum32(x: np.ndarray) -> np.ndarray:
    """kv_numpy_sum32 on [..., 32]."""
    r = [x[..., j].copy() for j in range(8)]
    for i in range(8, 32, 8):
        r = [r[j] + x[..., i + j] for j in range(8)]
    return ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))


def test_rms_sum_order_is_numpys(rng: np.random.Generator) -> None:
    """The turbo4/3 scale is a bf16 of an f32 RMS: the writer sums squares in numpy's order."""
    squares = np.square(rng.standard_normal((2_500, 8, 32)).astype(F32) * F32(rng.uniform(0.1, 10)))  # [N, G, 32]
    emulated = emu_sum32(squares) / F32(32)
    assert np.array_equal(emulated, np.mean(squares, axis=-1))
    assert not np.array_equal(np.cumsum(squares, axis=-1, dtype=F32)[:, -1] / F32(32), emulated)


def _safe_div(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    out = np.zeros(np.broadcast_shapes(x.shape, s.shape), dtype=F32)
    return np.divide(x, s, out=out, where=s != 0)


def bf16_round(x: np.ndarray) -> np.ndarray:
    bits = x.astype(F32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def emu_encode(level: str, x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """kv_encode_plain / kv_encode_turbo on [N, D] -> (codes [N, D], scale fields in buffer order)."""
    n, d = x.shape
    p = d // WARP
    if level in ("fp8", "nvfp4"):
        amax = np.max(np.abs(x), axis=1)
        if level == "fp8":
            scale = (amax / F32(448)).astype(F32)
            return emu_e4m3(_safe_div(x, scale[:, None])), [scale]
        scale = (amax / F32(2688)).astype(F32)
        group_amax = np.max(np.abs(x.reshape(n, -1, 16)), axis=2)
        group_code = emu_e4m3(_safe_div((group_amax / F32(6)).astype(F32), scale[:, None]))
        effective = (emu_decode_e4m3(group_code) * scale[:, None]).astype(F32)
        codes = emu_e2m1(_safe_div(x.reshape(n, -1, 16), effective[..., None])).reshape(n, d)
        return codes, [group_code, scale]
    y = x.reshape(n, WARP, p) * sign_flips(d).reshape(1, WARP, p)
    y = emu_wht(y).reshape(n, -1, 32)  # [N, G, 32]
    if level == "turbo8":
        statistic = (np.max(np.abs(y), axis=2) / F32(448)).astype(F32)
    else:
        statistic = np.sqrt(emu_sum32((y * y).astype(F32)) / F32(32)).astype(F32)
    scale_bits = bf16_round(statistic)
    normed = _safe_div(y, (scale_bits.astype(np.uint32) << 16).view(F32)[..., None]).reshape(n, d)
    codes = emu_e4m3(normed) if level == "turbo8" else emu_codebook(normed, CODEBOOKS[int(level[-1])])
    return codes, [scale_bits]


def emu_pack(level: str, codes: np.ndarray) -> np.ndarray:
    """kv_store_codes: each output byte b from the codes it covers."""
    n, d = codes.shape
    c = codes.astype(np.uint32)
    if level in ("fp8", "turbo8"):
        return codes
    if level == "turbo3":
        b = np.arange(d * 3 // 8)
        words = np.zeros((n, d // 8), dtype=np.uint32)
        for j in range(8):
            words |= c[:, j::8] << (3 * j)
        return ((words[:, b // 3] >> (8 * (b % 3))) & 0xFF).astype(np.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)


def emu_buffer(level: str, x: np.ndarray) -> bytes:
    """The cache buffer of N vectors as the writer lays it out: codes region, then the scales."""
    codes, scales = emu_encode(level, x)
    return emu_pack(level, codes).tobytes() + b"".join(np.ascontiguousarray(s).tobytes() for s in scales)


def numpy_buffer(level: str, x: np.ndarray) -> bytes:
    fields = LEVELS[level].encode(x)
    return b"".join(np.ascontiguousarray(fields[name]).tobytes() for name in LEVELS[level].layout(x.shape[1]))


def _vectors(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    x = rng.standard_normal((n, d)).astype(F32) * F32(rng.uniform(0.01, 30))
    x[0] = 0.0  # the all-zero vector: scales 0
    x[1, : d // 2] = 0.0  # zero groups
    x[2] = np.round(x[2] * 8) / 8  # exact ties in the codes
    x[3, 5] *= 1000.0  # an outlier channel
    return x


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("level", LEVEL_NAMES)
def test_writer_emulation_gives_the_encoder_bytes(level: str, dim: int, rng: np.random.Generator) -> None:
    x = _vectors(rng, 300, dim)
    assert emu_buffer(level, x) == numpy_buffer(level, x)


def test_buffer_fields_round_trip(rng: np.random.Generator) -> None:
    for level in LEVEL_NAMES:
        shape = (int(rng.integers(4, 9)), int(rng.integers(1, 5)), 128)  # _vectors edits rows 0..3
        x = _vectors(rng, shape[0] * shape[1], shape[2])
        fields = ops_kv.fields_from_bytes(level, shape, np.frombuffer(numpy_buffer(level, x), dtype=np.uint8))
        expected = LEVELS[level].encode(x)
        for name, array in expected.items():
            assert np.array_equal(fields[name].reshape(array.shape), array), f"{level}.{name}"
        assert ops_kv.cache_bytes(level, shape) == len(numpy_buffer(level, x))


# --- emulation of the attention tile -------------------------------------------------------------
def emu_decode_e4m3(code: np.ndarray) -> np.ndarray:
    c = code.astype(np.uint32)
    exponent, mantissa = (c >> 3) & 15, c & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).astype(np.uint32).view(F32)
    magnitude = np.where(exponent == 0, mantissa.astype(F32) * F32(0.001953125), normal)
    return np.where(c & 0x80, -magnitude, magnitude).astype(F32)


def emu_decode_e2m1(code: np.ndarray) -> np.ndarray:
    c = code.astype(np.uint32)
    exponent, mantissa = (c >> 1) & 3, c & 1
    normal = (((exponent + 126) << 23) | (mantissa << 22)).astype(np.uint32).view(F32)
    magnitude = np.where(exponent == 0, F32(0.5) * mantissa.astype(F32), normal)
    return np.where(c & 8, -magnitude, magnitude).astype(F32)


def emu_tile_decode(level: str, codes: np.ndarray, aux: np.ndarray, d: int) -> np.ndarray:
    """KvqTile::decode of every element i of N staged vectors (codes [N, code bytes], aux [N, aux bytes])."""
    i = np.arange(d)
    if level == "fp8":
        return emu_decode_e4m3(codes[:, i]) * aux[:, :4].copy().view(F32)
    if level == "nvfp4":
        effective = emu_decode_e4m3(aux[:, i // 16]) * aux[:, d // 16 : d // 16 + 4].copy().view(F32)
        return emu_decode_e2m1((codes[:, i // 2] >> (4 * (i & 1))) & 15) * effective
    scale = (aux.copy().view(np.uint16).astype(np.uint32) << 16).view(F32)[:, i // 32]
    if level == "turbo8":
        value = emu_decode_e4m3(codes[:, i])
    elif level == "turbo4":
        value = CODEBOOKS[4][(codes[:, i // 2] >> (4 * (i & 1))) & 15]
    else:
        w = codes.astype(np.uint32)
        bits = w[:, (i // 8) * 3] | (w[:, (i // 8) * 3 + 1] << 8) | (w[:, (i // 8) * 3 + 2] << 16)
        value = CODEBOOKS[3][(bits >> (3 * (i % 8))) & 7]
    return (value * scale).astype(F32)


def _staged(level: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What KvqSide::load puts in shared memory: per vector its code bytes and its aux bytes."""
    n, d = x.shape
    raw = np.frombuffer(numpy_buffer(level, x), dtype=np.uint8)
    sizes = dict(ops_kv.field_bytes(level, d))
    code_bytes = sizes.pop("codes")
    codes = raw[: n * code_bytes].reshape(n, code_bytes)
    aux_parts, offset = [], n * code_bytes
    for size in sizes.values():
        aux_parts.append(raw[offset : offset + n * size].reshape(n, size))
        offset += n * size
    return codes, np.concatenate(aux_parts, axis=1)


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("level", LEVEL_NAMES)
def test_tile_decode_gives_the_stored_values(level: str, dim: int, rng: np.random.Generator) -> None:
    x = _vectors(rng, 200, dim)
    decoded = emu_tile_decode(level, *_staged(level, x), dim)
    reference = LEVELS[level].decode(LEVELS[level].encode(x))
    if level.startswith("turbo"):
        assert np.allclose(unrotate(decoded), reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    else:
        assert np.array_equal(decoded, reference)


@pytest.mark.parametrize("level", ["turbo8", "turbo4", "turbo3"])
def test_rotating_q_leaves_attention_unchanged(level: str, rng: np.random.Generator) -> None:
    dim, keys = 128, 40
    k, v = _vectors(rng, keys, dim), _vectors(rng, keys, dim)
    q = rng.standard_normal((3, dim)).astype(F32)
    k_rot = emu_tile_decode(level, *_staged(level, k), dim)  # the keys as the tile reads them
    v_rot = emu_tile_decode(level, *_staged(level, v), dim)
    q_rot = emu_wht(q.reshape(3, WARP, -1) * sign_flips(dim).reshape(1, WARP, -1)).reshape(3, dim)
    assert np.allclose(q_rot, rotate(q), atol=1e-5)
    scores = q_rot @ k_rot.T
    k_ref, v_ref = (LEVELS[level].decode(LEVELS[level].encode(a)) for a in (k, v))
    np.testing.assert_allclose(scores, q @ k_ref.T, rtol=1e-4, atol=1e-3 * np.abs(scores).max())
    probs = np.exp(scores - scores.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    acc = (probs @ v_rot).reshape(3, WARP, -1)
    out = emu_wht(acc).reshape(3, dim) * sign_flips(dim)  # KvqTile::leave
    np.testing.assert_allclose(out, probs @ v_ref, rtol=1e-4, atol=1e-4 * np.abs(v_ref).max())


# --- engine storage hook --------------------------------------------------------------------------
def test_quantized_layers_get_the_backends_storage_and_no_bf16_cache(rng: np.random.Generator) -> None:
    from types import SimpleNamespace

    from atlas.errors import AtlasError
    from atlas.kvcache.storage import new_states
    from atlas.layers.attention import Attention, AttentionDims

    capacity, dims = int(rng.integers(8, 64)), AttentionDims(4, 2, 128)
    shape = (capacity, dims.num_kv_heads, dims.head_dim)
    made: list[tuple[str, tuple[int, ...]]] = []
    zeros: list[tuple[int, ...]] = []
    gpu = SimpleNamespace(
        name="cuda",
        quantized_kv_cache=lambda level, s: made.append((level, s)) or (level, s),
        zeros=lambda s, dtype: zeros.append(tuple(s)) or np.zeros(s),
    )
    attention = SimpleNamespace(mixer=Attention(None, dims, None))  # type: ignore[arg-type]
    other = SimpleNamespace(mixer=SimpleNamespace(new_state=lambda backend, cap: ("delta", cap)))
    states = new_states([attention, other, attention], gpu, capacity, ["turbo3", None, "bf16"])
    assert states[0].k == ("turbo3", shape) and states[0].v == ("turbo3", shape) and len(made) == 2
    assert states[1] == ("delta", capacity)
    assert isinstance(states[2].k, np.ndarray), "bf16 layers keep the backend's own cache"
    assert zeros == [shape, shape], "a quantized layer never allocates a bf16 cache first"
    with pytest.raises(AtlasError, match="no rocm storage"):
        new_states([attention], SimpleNamespace(name="rocm"), capacity, ["fp8"])
