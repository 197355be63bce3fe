"""Quantized weights in the device layout of the fp8 / nvfp4 kernels (quant_common.cuh).

Every array is indexed by weight row, so slicing rows (the q / gate split of q_proj, a part of a
fused projection: `QuantWeight.rows`) and stacking matrices (gate + up, experts, a layer's input
projections) are plain row operations:
  fp8:   q u8 [rows, k] e4m3; scale f32 [rows, ceil(k / 128)] (the checkpoint's 128x128 block
         scales repeated per row); row_scale None.
  nvfp4: q u8 [rows, k / 2] (element 2i in the low nibble); scale u8 e4m3 [rows, k / 16];
         row_scale f32 [rows] (the tensor's weight_scale_2 on each of its rows).
`dequantize` evaluates exactly what the kernels compute per weight (chunk of 16 under one scale,
row scale last), so it is the reference the GPU tests hold the kernels to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from atlas.quant.codes import E2M1_VALUES, decode_e4m3

from .ops_common import ceil_div
from .tensor import DeviceTensor
from .upload import Uploader

QuantFormat = Literal["fp8", "nvfp4"]
CHUNK = 16  # K elements per scale chunk (quant_common.cuh kChunk)
FP8_BLOCK = 128  # kFp8Block: the kernels' column block of one fp8 scale
NVFP4_GROUP = 16


@dataclass(frozen=True)
class HostQuantWeight:
    format: QuantFormat
    q: np.ndarray  # uint8, see module doc
    scale: np.ndarray  # float32 (fp8) or uint8 e4m3 (nvfp4)
    row_scale: np.ndarray | None  # float32 [rows] (nvfp4) or None
    k: int

    @property
    def rows(self) -> int:
        return int(self.q.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.scale.nbytes + (0 if self.row_scale is None else self.row_scale.nbytes))

    def take_rows(self, index: np.ndarray | slice) -> HostQuantWeight:
        row_scale = None if self.row_scale is None else self.row_scale[index]
        return HostQuantWeight(self.format, self.q[index], self.scale[index], row_scale, self.k)

    def dequantize(self) -> np.ndarray:
        """float32 [rows, k]: raw code value x chunk scale x row scale, as the kernels do."""
        if self.format == "fp8":
            raw = decode_e4m3(self.q)  # [rows, k]
            per_element = np.repeat(self.scale, FP8_BLOCK, axis=1)[:, : self.k]  # [rows, k]
            return raw * per_element
        codes = np.empty((self.rows, self.k), dtype=np.uint8)  # [rows, k]
        codes[:, 0::2] = self.q & 0xF
        codes[:, 1::2] = self.q >> 4
        scaled = E2M1_VALUES[codes] * np.repeat(decode_e4m3(self.scale), NVFP4_GROUP, axis=1)  # [rows, k]
        assert self.row_scale is not None
        return scaled * self.row_scale[:, None]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def from_fp8_block(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128)) -> HostQuantWeight:
    """Checkpoint fp8: weight e4m3 [N, K] (uint8 or float8 storage), weight_scale_inv
    [ceil(N / bn), ceil(K / 128)] in any float dtype."""
    codes = np.ascontiguousarray(weight).view(np.uint8)
    n, k = codes.shape
    _check(block[1] == FP8_BLOCK, f"fp8 kernels read 128-column scale blocks, the checkpoint has {block}")
    _check(k % CHUNK == 0, f"fp8 kernels need in-features divisible by {CHUNK}, got {k}")
    scale = np.asarray(scale_inv).astype(np.float32)
    expected = (ceil_div(n, block[0]), ceil_div(k, block[1]))
    _check(scale.shape == expected, f"fp8 scale grid {scale.shape}, expected {expected} for weight {codes.shape}")
    per_row = np.ascontiguousarray(np.repeat(scale, block[0], axis=0)[:n])  # [N, ceil(K/128)]
    return HostQuantWeight("fp8", codes, per_row, None, k)


def from_nvfp4(weight: np.ndarray, weight_scale: np.ndarray, weight_scale_2: np.ndarray | float) -> HostQuantWeight:
    """Checkpoint nvfp4 (ModelOpt): weight u8 [N, K / 2], weight_scale e4m3 [N, K / 16], fp32 scalar."""
    packed = np.ascontiguousarray(weight).view(np.uint8)
    scales = np.ascontiguousarray(weight_scale).view(np.uint8)
    n, half_k = packed.shape
    k = 2 * half_k
    _check(k % CHUNK == 0, f"nvfp4 needs in-features divisible by {CHUNK}, got {k}")
    _check(scales.shape == (n, k // NVFP4_GROUP), f"nvfp4 weight_scale {scales.shape}, expected {(n, k // NVFP4_GROUP)}")
    global_scale = np.float32(np.asarray(weight_scale_2, dtype=np.float32).reshape(()))
    return HostQuantWeight("nvfp4", packed, scales, np.full(n, global_scale, dtype=np.float32), k)


def stack_rows(parts: Sequence[HostQuantWeight]) -> HostQuantWeight:
    """Row concatenation (gate + up of an MLP, the experts of a layer)."""
    _check(len(parts) > 0, "stack_rows of nothing")
    first = parts[0]
    _check(all(p.format == first.format and p.k == first.k for p in parts), "stack_rows: formats or in-features differ")
    row_scale = None if first.row_scale is None else np.concatenate([p.row_scale for p in parts])  # type: ignore[misc]
    return HostQuantWeight(first.format, np.concatenate([p.q for p in parts]), np.concatenate([p.scale for p in parts]),
                           row_scale, first.k)


@dataclass(frozen=True)
class QuantWeight:
    """A HostQuantWeight on the device; `shape` is the logical (rows, k) or (E, rows/E, k)."""

    format: QuantFormat
    q: DeviceTensor
    scale: DeviceTensor
    row_scale: DeviceTensor | None
    shape: tuple[int, ...]

    @property
    def k(self) -> int:
        return self.shape[-1]

    @property
    def row_scale_ptr(self) -> int | None:
        return None if self.row_scale is None else self.row_scale.ptr

    def rows(self, start: int, stop: int) -> QuantWeight:
        """The view of rows start..stop-1 of a (rows, k) weight. Exact at any row in both formats:
        every array of the device layout is indexed by weight row (fp8's block scales are
        repeated per row), and the kernels address row r at base + r * row stride."""
        _check(len(self.shape) == 2, f"rows() of a stacked weight {self.shape}")
        _check(0 <= start <= stop <= self.shape[0], f"rows({start}, {stop}) out of range for shape {self.shape}")
        row_scale = None if self.row_scale is None else self.row_scale.rows(start, stop)
        return QuantWeight(self.format, self.q.rows(start, stop), self.scale.rows(start, stop), row_scale,
                           (stop - start, self.k))


def upload(uploader: Uploader, host: HostQuantWeight, experts: int = 0) -> QuantWeight:
    """Upload; experts > 0 records the stacked shape (E, rows / E, k) for the MoE op."""
    shape: tuple[int, ...] = (host.rows, host.k)
    if experts:
        _check(host.rows % experts == 0, f"{host.rows} rows do not split into {experts} experts")
        shape = (experts, host.rows // experts, host.k)
    q = uploader.upload(host.q, "u8")
    scale = uploader.upload(host.scale, "f32" if host.format == "fp8" else "u8")
    row_scale = None if host.row_scale is None else uploader.upload(host.row_scale, "f32")
    return QuantWeight(host.format, q, scale, row_scale, shape)


def from_quantized_weight(weight: Any) -> HostQuantWeight:
    """atlas.quant.stored.QuantizedWeight (the loader's `upload_quantized` argument) -> device layout."""
    parts = weight.parts
    if weight.method == "fp8":
        return from_fp8_block(parts["weight"], parts["weight_scale_inv"], tuple(weight.block))
    if weight.method == "nvfp4":
        return from_nvfp4(parts["weight"], parts["weight_scale"], parts["weight_scale_2"])
    raise ValueError(f"{weight.name}: no kernels for quantization {weight.method!r} (fp8, nvfp4)")
