"""Block FP8 and NVFP4 on the host: decoding bit for bit against ml_dtypes (an independent decoder),
encoding against ml_dtypes' round-to-nearest-even, and quantize -> dequantize error bounds."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from atlas.quant.codes import E2M1_VALUES, E4M3_VALUES, encode_e2m1, encode_e4m3
from atlas.quant.fp8_block import dequantize_fp8_block, quantize_fp8_block
from atlas.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

E4M3_NAN = (0x7F, 0xFF)


def independent_e4m3(codes: np.ndarray) -> np.ndarray:
    return np.asarray(codes, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def independent_e2m1(nibbles: np.ndarray) -> np.ndarray:
    return np.asarray(nibbles, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def finite_e4m3_codes(rng: np.random.Generator, shape: tuple[int, ...], positive: bool = False) -> np.ndarray:
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    if positive:
        codes &= 0x7F
    codes[np.isin(codes, E4M3_NAN)] = 0x38  # 1.0
    return codes


def test_code_tables_match_ml_dtypes() -> None:
    every_byte = np.arange(256, dtype=np.uint8)
    assert np.array_equal(E4M3_VALUES, independent_e4m3(every_byte), equal_nan=True)
    assert np.isnan(E4M3_VALUES[list(E4M3_NAN)]).all() and np.nanmax(E4M3_VALUES) == 448.0
    assert np.array_equal(E2M1_VALUES, independent_e2m1(np.arange(16, dtype=np.uint8)))
    assert E2M1_VALUES[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_encoders_round_to_nearest_even(rng: np.random.Generator) -> None:
    values = np.concatenate([
        rng.normal(scale=3.0, size=4096), rng.uniform(-8, 8, 4096),
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 6.5, -100.0, 0.0, -0.0],
    ]).astype(np.float32)  # fmt: skip
    assert np.array_equal(encode_e2m1(values), values.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))
    wide = (values * 60).astype(np.float32)
    in_range = np.clip(wide, -448, 448)
    assert np.array_equal(encode_e4m3(wide), in_range.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


@pytest.mark.parametrize("scale_dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (64, 48)])
def test_fp8_dequantize_bit_for_bit(rng: np.random.Generator, shape: tuple[int, int], scale_dtype: type) -> None:
    block = (128, 128)
    codes = finite_e4m3_codes(rng, shape)
    grid = (-(-shape[0] // 128), -(-shape[1] // 128))
    scales = rng.uniform(1e-4, 2.0, grid).astype(scale_dtype)
    rows, cols = np.indices(shape)
    per_element = scales.astype(np.float32)[rows // 128, cols // 128]
    expected = independent_e4m3(codes) * per_element
    ours = dequantize_fp8_block(codes.view(ml_dtypes.float8_e4m3fn), scales, block)
    assert ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("shape", [(96, 256), (5, 16), (33, 80)])
def test_nvfp4_dequantize_bit_for_bit(rng: np.random.Generator, shape: tuple[int, int]) -> None:
    n, k = shape
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale_codes = finite_e4m3_codes(rng, (n, k // 16), positive=True)
    scale_2 = np.array(rng.uniform(1e-5, 1e-2), dtype=np.float32)
    elements = np.empty((n, k), dtype=np.float32)
    elements[:, 0::2] = independent_e2m1(packed & 0x0F)  # element 2i: low nibble
    elements[:, 1::2] = independent_e2m1(packed >> 4)
    group_scale = independent_e4m3(scale_codes)[:, np.arange(k) // 16]
    expected = (elements * group_scale) * scale_2
    ours = dequantize_nvfp4(packed, scale_codes.view(ml_dtypes.float8_e4m3fn), scale_2)
    assert ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32))


def test_fp8_quantize_scales_and_error(rng: np.random.Generator) -> None:
    w = rng.normal(size=(300, 200)).astype(np.float32) * rng.uniform(0.01, 3.0, (300, 1)).astype(np.float32)
    w[:128, :128] = 0.0  # an all-zero block
    w[200, 150] = 40.0  # an outlier in a ragged edge block
    q = quantize_fp8_block(w)
    assert q.weight.shape == w.shape and q.scale_inv.shape == (3, 2)
    amax = np.array([[np.abs(w[r : r + 128, c : c + 128]).max() for c in (0, 128)] for r in (0, 128, 256)])
    assert np.array_equal(q.scale_inv, (amax / np.float32(448)).astype(np.float32))
    back = dequantize_fp8_block(q.weight, q.scale_inv, q.block)
    rows, cols = np.indices(w.shape)
    unit = q.scale_inv[rows // 128, cols // 128]  # one e4m3 unit of the block
    bound = np.abs(w) / 16 + unit * 2.0**-9 * 1.0001  # 3 mantissa bits; subnormal step 2^-9
    assert (np.abs(back - w) <= bound).all()
    assert np.array_equal(back[:128, :128], np.zeros((128, 128), np.float32))
    assert abs(back[200, 150] - 40.0) <= 40.0 / 16


def test_nvfp4_quantize_scales_and_error(rng: np.random.Generator) -> None:
    w = rng.normal(size=(64, 512)).astype(np.float32) * rng.uniform(0.05, 2.0, (64, 1)).astype(np.float32)
    w[3, 32:48] = 0.0  # an all-zero group
    q = quantize_nvfp4(w)
    assert q.weight.shape == (64, 256) and q.weight.dtype == np.uint8
    assert q.weight_scale.shape == (64, 32) and q.weight_scale_2.shape == ()
    amax = np.abs(w).max()
    assert q.weight_scale_2 == np.float32(amax / np.float32(448 * 6))
    group_amax = np.abs(w.reshape(64, 32, 16)).max(axis=2)
    wanted = (group_amax / (np.float32(6) * q.weight_scale_2)).astype(np.float32)
    assert np.array_equal(q.weight_scale, wanted.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    assert independent_e4m3(q.weight_scale).max() == 448.0  # the tensor's largest group
    back = dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2)
    unit = np.repeat(independent_e4m3(q.weight_scale) * q.weight_scale_2, 16, axis=1)  # [N, K]
    bound = np.maximum(np.abs(w) / 4, unit / 4) * 1.0001 + unit * 0.07  # e2m1 half-steps; scale rounding
    assert (np.abs(back - w) <= bound).all()
    assert np.array_equal(back[3, 32:48], np.zeros(16, np.float32))
    relative = np.linalg.norm(back - w) / np.linalg.norm(w)
    assert 0.02 < relative < 0.15  # about 4 bits of precision, not a pass-through


def test_nvfp4_packs_element_2i_in_the_low_nibble() -> None:
    w = np.zeros((1, 16), dtype=np.float32)
    w[0, 0], w[0, 1] = 6.0, -3.0  # codes 7 and 0xD
    q = quantize_nvfp4(w)
    assert q.weight[0, 0] == 0xD7
    back = dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2)[0]
    assert back[:2] == pytest.approx([6.0, -3.0], rel=1e-6) and not back[2:].any()


def test_nvfp4_needs_groups_of_16() -> None:
    with pytest.raises(ValueError, match="divisible by 16"):
        quantize_nvfp4(np.ones((4, 24), dtype=np.float32))
