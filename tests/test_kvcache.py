"""KV cache levels: codes bit-exact against ml_dtypes, the WHT, the Lloyd-Max constants, storage
layouts and bytes, round-trip error bounds, the per-layer plan, the numpy cache, the demo and the CLI.

Error bounds are bench/results/kv-mse-*.json's `gaussian` column (N(0, 1) vectors, head_dim 256)
times 1.25; the tests draw fresh N(0, 1) vectors each run.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from atlas.backends.base import KVCache
from atlas.backends.numpy_backend import NumpyBackend
from atlas.errors import AtlasError
from atlas.kvcache import LEVEL_NAMES, LEVELS, KVCacheOptions, QuantizedRows, bytes_per_vector, round_trip
from atlas.kvcache.codebooks import CODEBOOKS
from atlas.kvcache.codes import (
    decode_bf16, decode_e2m1, decode_e4m3, encode_bf16, encode_codebook, encode_e2m1, encode_e4m3,
)  # fmt: skip
from atlas.kvcache.hadamard import rotate, unrotate, wht
from atlas.kvcache.lloyd_max import derive, distortion, lloyd_step
from atlas.kvcache.packing import pack_nibbles, pack_triples, unpack_nibbles, unpack_triples

# Measured relative MSE on N(0, 1) (bench/results/kv-mse-*.json, gaussian K and V) x 1.25.
MSE_BOUNDS = {
    "bf16": 2.77e-6 * 1.25, "fp8": 6.83e-4 * 1.25, "nvfp4": 9.04e-3 * 1.25,
    "turbo8": 5.77e-4 * 1.25, "turbo4": 8.93e-3 * 1.25, "turbo3": 3.26e-2 * 1.25,
}  # fmt: skip
# Max (1960), "Quantizing for minimum distortion", table I: positive output levels and the MSE.
MAX_1960 = {
    3: ((0.2451, 0.7560, 1.3440, 2.1520), 0.03454),
    4: ((0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326), 0.009497),
}


def relative_mse(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.sum((x.astype(np.float64) - y) ** 2) / np.sum(x.astype(np.float64) ** 2))


def spread_values(rng: np.random.Generator, count: int, top: float) -> np.ndarray:
    """Signed values whose magnitudes span the whole range of a format (log-uniform), f32."""
    magnitude = np.exp(rng.uniform(np.log(top) - 14.0, np.log(top), count))
    return (magnitude * rng.choice([-1.0, 1.0], count)).astype(np.float32)


# --- element codes --------------------------------------------------------------------------------
def test_e4m3_encode_matches_ml_dtypes(rng: np.random.Generator) -> None:
    table = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = table[np.isfinite(table)]
    ties = (np.sort(np.abs(finite))[1:] + np.sort(np.abs(finite))[:-1]) / 2  # halfway points
    x = np.concatenate([spread_values(rng, 20000, 448.0), finite, ties, -ties])
    assert np.array_equal(encode_e4m3(x), x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    codes = np.flatnonzero(np.isfinite(table)).astype(np.uint8)
    assert np.array_equal(decode_e4m3(codes), table[codes])
    assert list(encode_e4m3(np.array([1e6, -500.0], np.float32))) == [0x7E, 0xFE]  # saturates


def test_e2m1_encode_matches_ml_dtypes(rng: np.random.Generator) -> None:
    magnitudes = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
    ties = (magnitudes[1:] + magnitudes[:-1]) / 2
    x = np.concatenate([rng.uniform(-6.0, 6.0, 20000).astype(np.float32), ties, -ties, magnitudes])
    assert np.array_equal(encode_e2m1(x), x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))
    codes = np.arange(16, dtype=np.uint8)
    assert np.array_equal(decode_e2m1(codes), codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert list(encode_e2m1(np.array([9.0, -7.0], np.float32))) == [7, 15]


def test_bf16_matches_ml_dtypes(rng: np.random.Generator) -> None:
    x = np.concatenate([spread_values(rng, 20000, 1e4), rng.standard_normal(1000).astype(np.float32)])
    bits = encode_bf16(x)
    assert np.array_equal(bits, x.astype(ml_dtypes.bfloat16).view(np.uint16))
    assert np.array_equal(decode_bf16(bits), bits.view(ml_dtypes.bfloat16).astype(np.float32))


def test_codebook_picks_the_nearest_level(rng: np.random.Generator) -> None:
    for levels in CODEBOOKS.values():
        x = (rng.standard_normal(5000) * 1.5).astype(np.float32)
        nearest = np.argmin(np.abs(x[:, None] - levels[None, :]), axis=1)
        assert np.array_equal(encode_codebook(x, levels), nearest)


def test_packing_round_trips_with_the_documented_bit_order(rng: np.random.Generator) -> None:
    nibbles = rng.integers(0, 16, (5, 64), dtype=np.uint8)
    packed = pack_nibbles(nibbles)
    assert packed.shape == (5, 32) and packed[0, 0] == nibbles[0, 0] | (nibbles[0, 1] << 4)
    assert np.array_equal(unpack_nibbles(packed), nibbles)
    triples = rng.integers(0, 8, (5, 64), dtype=np.uint8)
    packed = pack_triples(triples)
    word = int(packed[1, 0]) | int(packed[1, 1]) << 8 | int(packed[1, 2]) << 16
    assert packed.shape == (5, 24) and [(word >> (3 * j)) & 7 for j in range(8)] == list(triples[1, :8])
    assert np.array_equal(unpack_triples(packed), triples)


# --- rotation and codebooks -----------------------------------------------------------------------
@pytest.mark.parametrize("dim", [32, 64, 256])
def test_wht_is_orthonormal_and_self_inverse(dim: int, rng: np.random.Generator) -> None:
    sylvester = np.array([[1.0]])
    while sylvester.shape[0] < dim:
        sylvester = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), sylvester)
    matrix = wht(np.eye(dim, dtype=np.float32))  # row i = transform of e_i
    np.testing.assert_allclose(matrix, sylvester / np.sqrt(dim), atol=1e-6)
    np.testing.assert_allclose(matrix @ matrix.T, np.eye(dim), atol=1e-5)
    x = rng.standard_normal((8, dim)).astype(np.float32)
    np.testing.assert_allclose(wht(wht(x)), x, atol=1e-5)
    np.testing.assert_allclose(unrotate(rotate(x)), x, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(rotate(x), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    assert not np.allclose(np.abs(rotate(x)), np.abs(wht(x)))  # the sign flips do something


def test_rotation_spreads_an_outlier_channel(rng: np.random.Generator) -> None:
    x = np.zeros((1, 256), np.float32)
    x[0, rng.integers(256)] = 16.0
    assert np.allclose(np.abs(rotate(x)), 1.0, atol=1e-5)


@pytest.mark.parametrize("bits", [3, 4])
def test_codebooks_are_the_lloyd_max_fixed_point(bits: int) -> None:
    shipped = CODEBOOKS[bits].astype(np.float64)
    assert len(shipped) == 2**bits and np.all(np.diff(shipped) > 0)
    np.testing.assert_allclose(lloyd_step(shipped), shipped, atol=2e-6)  # a Lloyd step stays put
    np.testing.assert_allclose(derive(bits), shipped, atol=1e-6)  # and iterating from scratch gets there
    positive, mse = MAX_1960[bits]
    np.testing.assert_allclose(shipped[2 ** (bits - 1) :], positive, atol=1.5e-4)
    assert distortion(shipped) == pytest.approx(mse, abs=1e-5)
    assert distortion(shipped) < distortion(shipped * 1.02) and distortion(shipped) < distortion(shipped * 0.98)


# --- levels ---------------------------------------------------------------------------------------
def expected_bytes(name: str, dim: int) -> int:
    """Per head vector, written out from the documented layouts."""
    return {
        "bf16": 2 * dim, "fp8": dim + 4, "nvfp4": dim // 2 + dim // 16 + 4,
        "turbo8": dim + 2 * (dim // 32), "turbo4": dim // 2 + 2 * (dim // 32),
        "turbo3": 3 * dim // 8 + 2 * (dim // 32),
    }[name]  # fmt: skip


@pytest.mark.parametrize("name", LEVEL_NAMES)
def test_layout_is_the_storage_and_bytes_are_exact(name: str, rng: np.random.Generator) -> None:
    level = LEVELS[name]
    for dim in (64, 256):
        x = rng.standard_normal((7, dim)).astype(np.float32)
        fields = level.encode(x)
        layout = level.layout(dim)
        assert set(fields) == set(layout)
        for field, (shape, dtype) in layout.items():
            assert fields[field].shape == (7, *shape) and fields[field].dtype == dtype, field
        assert sum(a.nbytes for a in fields.values()) == 7 * bytes_per_vector(level, dim)
        assert bytes_per_vector(level, dim) == expected_bytes(name, dim)
    turbo3, turbo4 = (bytes_per_vector(LEVELS[n], 256) for n in ("turbo3", "turbo4"))
    assert turbo3 / turbo4 == pytest.approx(0.78, abs=0.01)  # the article: turbo3 22 % smaller


@pytest.mark.parametrize("name", LEVEL_NAMES)
def test_round_trip_error_within_measured_bound(name: str, rng: np.random.Generator) -> None:
    x = rng.standard_normal((512, 2, 256)).astype(np.float32)
    x *= np.exp(rng.uniform(-3.0, 3.0, (512, 2, 1))).astype(np.float32)  # scales differ per vector
    y = round_trip(LEVELS[name], x)
    assert y.shape == x.shape and y.dtype == np.float32
    assert relative_mse(x, y) < MSE_BOUNDS[name]
    fields = LEVELS[name].encode(x.reshape(-1, 256))
    again = LEVELS[name].encode(x.reshape(-1, 256))
    assert all(np.array_equal(fields[f], again[f]) for f in fields)  # deterministic


def test_levels_order_by_error(rng: np.random.Generator) -> None:
    x = rng.standard_normal((256, 256)).astype(np.float32)
    mse = {name: relative_mse(x, round_trip(LEVELS[name], x)) for name in LEVEL_NAMES}
    assert mse["bf16"] < min(mse["fp8"], mse["turbo8"])
    assert max(mse["fp8"], mse["turbo8"]) < min(mse["nvfp4"], mse["turbo4"])
    assert max(mse["nvfp4"], mse["turbo4"]) < mse["turbo3"]


@pytest.mark.parametrize("name", LEVEL_NAMES)
def test_zero_vectors_stay_zero(name: str) -> None:
    assert np.array_equal(round_trip(LEVELS[name], np.zeros((3, 64), np.float32)), np.zeros((3, 64)))


# --- plan and options -----------------------------------------------------------------------------
QWEN_LAYERS = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)]


@pytest.mark.parametrize(
    ("keep", "bf16_layers"),
    [("auto", {3, 39}), (1, {3, 39}), ("2", {3, 7, 35, 39}), (0, set()), (5, set(range(3, 40, 4))),
     (9, set(range(3, 40, 4)))],  # fmt: skip
)
def test_high_precision_layers(keep: str | int, bf16_layers: set[int]) -> None:
    plan = KVCacheOptions("turbo4", keep).plan(QWEN_LAYERS, 256)
    assert [i for i, p in enumerate(plan) if p is not None] == list(range(3, 40, 4))
    assert {i for i, p in enumerate(plan) if p == "bf16"} == bf16_layers
    assert {i for i, p in enumerate(plan) if p == "turbo4"} == set(range(3, 40, 4)) - bf16_layers


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        (KVCacheOptions("fp9"), "--kv-cache-dtype must be one of"),
        (KVCacheOptions("fp8", "most"), "--kv-high-precision-layers must be"),
        (KVCacheOptions("fp8", -1), "--kv-high-precision-layers must be"),
        (KVCacheOptions("fp8", True), "--kv-high-precision-layers must be"),
    ],
)
def test_bad_options(options: KVCacheOptions, needle: str) -> None:
    with pytest.raises(AtlasError, match=needle):
        options.plan(QWEN_LAYERS, 256)


def test_plan_refuses_what_it_cannot_store() -> None:
    with pytest.raises(AtlasError, match="power-of-two head_dim"):
        KVCacheOptions("turbo8", 0).plan(QWEN_LAYERS, 96)
    with pytest.raises(AtlasError, match="groups of 16"):
        KVCacheOptions("nvfp4", 0).plan(QWEN_LAYERS, 40)
    with pytest.raises(AtlasError, match="numpy and cuda backends only"):
        KVCacheOptions("fp8", 0).plan(QWEN_LAYERS, 256, "rocm")
    assert KVCacheOptions("turbo3", 0).plan(QWEN_LAYERS, 256, "cuda")[3] == "turbo3"
    assert KVCacheOptions("bf16").plan(QWEN_LAYERS, 96, "cuda")[3] == "bf16"


# --- the numpy cache ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fp8", "nvfp4", "turbo3"])
def test_attention_sees_exactly_the_stored_level(name: str, rng: np.random.Generator) -> None:
    be, level = NumpyBackend(), LEVELS[name]
    capacity, heads, dim = 24, 2, 64
    q = rng.standard_normal((10, 4, dim)).astype(np.float32)
    k, v = (rng.standard_normal((10, heads, dim)).astype(np.float32) for _ in range(2))
    caches = QuantizedRows(level, (capacity, heads, dim)), QuantizedRows(level, (capacity, heads, dim))
    reference = np.zeros((capacity, heads, dim), np.float32), np.zeros((capacity, heads, dim), np.float32)
    for start, stop in ((0, 7), (7, 8), (8, 10)):  # a prefill, then decode steps
        positions = np.arange(start, stop, dtype=np.int32)
        got = be.attention(q[start:stop], k[start:stop], v[start:stop], KVCache(*caches), positions, 0.125)
        rk, rv = round_trip(level, k[start:stop]), round_trip(level, v[start:stop])
        want = be.attention(q[start:stop], rk, rv, KVCache(*reference), positions, 0.125)
        np.testing.assert_array_equal(got, want)
    assert caches[0].nbytes == capacity * heads * bytes_per_vector(level, dim)
    packed = caches[0].fields["codes"][:10].reshape(10 * heads, -1)
    assert np.array_equal(packed, level.encode(k.reshape(-1, dim))["codes"])


def test_fp8_and_nvfp4_decode_like_ml_dtypes(rng: np.random.Generator) -> None:
    x = rng.standard_normal((64, 128)).astype(np.float32) * 3.0
    fp8 = LEVELS["fp8"].encode(x)
    independent = fp8["codes"].view(ml_dtypes.float8_e4m3fn).astype(np.float32) * fp8["scale"][:, None]
    assert np.array_equal(LEVELS["fp8"].decode(fp8), independent)
    nv = LEVELS["nvfp4"].encode(x)
    nibbles = np.stack([nv["codes"] & 0xF, nv["codes"] >> 4], axis=-1).reshape(64, 128)
    values = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float32).reshape(64, 8, 16)
    group_scale = nv["group_scale"].view(ml_dtypes.float8_e4m3fn).astype(np.float32)  # [64, 8]
    independent = values * (group_scale * nv["scale"][:, None])[..., None]
    assert np.array_equal(LEVELS["nvfp4"].decode(nv), independent.reshape(64, 128))
    assert np.all(group_scale.max(axis=-1) == 448.0)  # the fp32 scale puts the largest group at the top


# --- the demo and the CLI -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def zen() -> str:
    from atlas.demo import zen_of_python

    return zen_of_python()


@pytest.mark.parametrize("name", [n for n in LEVEL_NAMES if n != "bf16"])
def test_demo_recites_with_a_quantized_cache(name: str, zen: str) -> None:
    """Every level keeps the first 300 characters (measured: all keep the whole text). The demo has
    one full-attention layer, so it is quantized only with 0 high-precision layers."""
    from atlas import LLM
    from atlas.demo import DEMO_PROMPT
    from atlas.kvcache.storage import QuantizedRows as Rows

    llm = LLM(None, "cpu", kv_cache_dtype=name, kv_high_precision_layers=0)
    engine = llm.parts.engine
    assert engine.kv_plan == [None, None, None, name]
    recited = DEMO_PROMPT + llm.generate(DEMO_PROMPT, max_tokens=100).text
    assert isinstance(engine.states[3].k, Rows) and isinstance(engine.states[3].v, Rows)
    assert recited[:300] == zen[:300]


def test_auto_keeps_the_demo_layer_bf16() -> None:
    from atlas import LLM

    engine = LLM(None, "cpu", kv_cache_dtype="turbo3").parts.engine
    assert engine.kv_plan == [None, None, None, "bf16"]
    assert isinstance(engine.states[3].k, np.ndarray)


def test_cli_runs_a_quantized_cache(zen: str, capsys: pytest.CaptureFixture[str]) -> None:
    from atlas.demo import DEMO_PROMPT
    from atlas.run import main

    flags = ["--device", "cpu", "--max-tokens", "30", "--kv-cache-dtype", "turbo8"]
    flags += ["--kv-high-precision-layers", "0"]
    assert main(flags) == 0
    out, err = capsys.readouterr()
    assert zen.startswith(DEMO_PROMPT + out.rstrip("\n"))
    assert "atlas: kv cache turbo8 on layers 3" in err


BAD_HIGH_PRECISION = "--kv-high-precision-layers must be 'auto' or a non-negative integer"


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--kv-cache-dtype", "int4"], "Invalid value for '--kv-cache-dtype'"),
        (["--kv-high-precision-layers", "first"], BAD_HIGH_PRECISION),
        (["--kv-high-precision-layers", "-2"], BAD_HIGH_PRECISION),
    ],
)
def test_cli_bad_kv_flags(flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    from atlas.run import main

    assert main(["--device", "cpu", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
