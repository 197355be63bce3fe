"""Weights the numpy backend keeps compact on the host, converted to float32 where an op reads them.

A bf16 (or f16) checkpoint's matrices stay 2 bytes per parameter (often a read-only view of the
safetensors memory map) and a quantized checkpoint's stay packed (codes + scales). Each op turns
only what it reads into float32 — a block of rows, or only the experts a step selected — and runs
the same float32 matmul, on the same shapes, as with float32 weights, so results do not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..quant.stored import QuantizedWeight

BF16 = np.dtype(ml_dtypes.bfloat16)

ROW_BLOCK_BYTES = 128 << 20  # float32 bytes of one converted block of a big matrix (lm_head, embeddings)
ROW_BLOCK_ALIGN = 256  # rows: blocks start at the same row offsets modulo BLAS's unrolling


def to_f32(stored: np.ndarray) -> np.ndarray:
    """Exact float32 copy of bf16 / f16 / f32 data (widening: every value is representable)."""
    return np.asarray(stored, dtype=np.float32)


@dataclass(frozen=True)
class HostMatrix:
    """A float matrix (or stack [E, N, K]) as the checkpoint stores it."""

    stored: np.ndarray  # [..., N, K] bf16 / f16 / f32, C-contiguous

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stored.shape)

    @property
    def nbytes(self) -> int:
        return int(self.stored.nbytes)

    def __getitem__(self, index: int | slice) -> HostMatrix:
        return HostMatrix(self.stored[index])

    def dense(self) -> np.ndarray:
        return to_f32(self.stored)

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        return self.dense() if dtype is None else self.dense().astype(dtype)  # np.asarray: float32 values

    def rows(self, start: int, stop: int) -> np.ndarray:
        return to_f32(self.stored[start:stop])  # [stop - start, K]

    def take(self, ids: np.ndarray) -> np.ndarray:
        return to_f32(self.stored[ids])  # [len(ids), K]


@dataclass(frozen=True)
class HostQuantized:
    """Quantized matrices stacked by rows, as `upload_quantized_rows` describes them: `rows`
    selects rows of the stack (None: all), `experts` > 0 makes it [E, rows / E, K]."""

    weights: tuple[QuantizedWeight, ...]
    rows: np.ndarray | None = None
    experts: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        height = sum(w.shape[0] for w in self.weights) if self.rows is None else len(self.rows)
        width = self.weights[0].shape[1]
        return (height, width) if self.experts == 0 else (self.experts, height // self.experts, width)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights)

    def dense(self) -> np.ndarray:
        stacked = np.concatenate([w.dequantize() for w in self.weights])  # [sum N, K]
        selected = stacked if self.rows is None else stacked[self.rows]
        return selected.reshape(self.shape)

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        return self.dense() if dtype is None else self.dense().astype(dtype)

    def expert(self, index: int) -> np.ndarray:
        """Expert `index` alone [rows / E, K]: only its own matrices are dequantized."""
        per_expert = len(self.weights) // self.experts
        if self.rows is not None or per_expert * self.experts != len(self.weights):
            return self.dense()[index]
        mine = self.weights[index * per_expert : (index + 1) * per_expert]
        return np.concatenate([w.dequantize() for w in mine])


HostWeight = HostMatrix | HostQuantized


def dense(weight: np.ndarray | HostWeight) -> np.ndarray:
    """The whole weight as float32 (small weights: routers, conv taps, a fused projection)."""
    return weight if isinstance(weight, np.ndarray) else weight.dense()


def expert_matrix(stack: np.ndarray | HostWeight, index: int) -> np.ndarray:
    """stack [E, N, K] -> expert `index` as float32 [N, K]."""
    if isinstance(stack, HostQuantized):
        return stack.expert(index)
    if isinstance(stack, HostMatrix):
        return to_f32(stack.stored[index])
    return stack[index]


def row_block(rows: int, width: int) -> int:
    """Rows per converted block: one block (the float32 product as before) up to ROW_BLOCK_BYTES."""
    fitting = max(ROW_BLOCK_BYTES // (4 * max(width, 1)), 1)
    if fitting >= rows:
        return rows
    return max(fitting // ROW_BLOCK_ALIGN, 1) * ROW_BLOCK_ALIGN


def matmul_t(x: np.ndarray, weight: np.ndarray | HostWeight) -> np.ndarray:
    """x [T, K] @ weight.T -> [T, N]; a big compact matrix a block of rows at a time."""
    if not isinstance(weight, HostMatrix):
        return x @ dense(weight).T
    rows, width = weight.shape
    block = row_block(rows, width)
    if block >= rows:
        return x @ weight.dense().T
    out = np.empty((x.shape[0], rows), dtype=np.float32)  # [T, N]
    for start in range(0, rows, block):
        out[:, start : start + block] = x @ weight.rows(start, start + block).T
    return out


def row_parts(weight: np.ndarray | HostWeight, bounds: Sequence[int]) -> list[np.ndarray | HostWeight]:
    """The row blocks [bounds[i], bounds[i+1]) of a weight, each still compact where it was."""
    if isinstance(weight, HostQuantized):
        full = weight.dense()
        return [full[a:b] for a, b in zip(bounds, bounds[1:])]
    return [weight[a:b] for a, b in zip(bounds, bounds[1:])]


def compact(array: np.ndarray) -> np.ndarray | HostMatrix:
    """What the numpy backend keeps for a float matrix uploaded with the bf16 hint: bf16 / f16
    data as it is (a read-only view is kept, not copied), float32 data as bf16 when that is
    exact (the MTP head's bf16-rounded weights), else float32 as before."""
    if array.dtype in (BF16, np.dtype(np.float16)):
        kept = array if not array.flags.writeable and array.flags.c_contiguous else np.array(array, order="C")
        return HostMatrix(kept)
    values = np.array(array, dtype=np.float32, order="C")
    bits = values.view(np.uint32)
    if values.size and not np.any(bits & 0xFFFF):
        return HostMatrix((bits >> 16).astype(np.uint16).view(BF16))
    return values


def resident_bytes(weight: object) -> int:
    """Host bytes one uploaded weight holds."""
    if isinstance(weight, (HostMatrix, HostQuantized)):
        return weight.nbytes
    return int(weight.nbytes) if isinstance(weight, np.ndarray) else 0
