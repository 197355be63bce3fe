"""Checkpoint names -> backend tensors: shape checks up front, host arrays, progress bar.

A model family (models/) lists the tensors it needs with their expected shapes; `WeightReader`
checks every one before any data is read, so a checkpoint that does not match its config fails at
once with one line naming the tensor, the expected and found shapes and the file.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .backends.base import Backend, Tensor
from .errors import AtlasError
from .layers.split_linear import SplitLinear, WeightGroup
from .quant.stored import QuantizedTensors
from .safetensors import Checkpoint

TEXT_PREFIXES = ("model.language_model.", "model.")  # multimodal (nested) first, then text-only
READABLE_DTYPES = frozenset({"F32", "BF16", "F16", "F64"})
COMPACT_FLOAT_DTYPES = frozenset({"BF16", "F16"})  # exact in float32: converted where an op reads them
Shape = tuple[int, ...]


@dataclass(frozen=True)
class RowPart:
    """Rows of one planned matrix: one part of a fused projection."""

    name: str
    rows: np.ndarray | None = None  # None: every row, in order


def find_text_prefix(checkpoint: Checkpoint, probe: str) -> str:
    """The prefix under which this checkpoint stores its text model, found by `probe`."""
    for prefix in TEXT_PREFIXES:
        if prefix + probe in checkpoint:
            return prefix
    tried = " or ".join(repr(p + probe) for p in TEXT_PREFIXES)
    raise AtlasError(
        f"{checkpoint.source} holds neither {tried}; it is not a checkpoint of the model type "
        "its config.json names"
    )


def check_tensor(
    checkpoint: Checkpoint, name: str, expected: Shape, quantized: QuantizedTensors | None = None
) -> None:
    if quantized is not None and quantized.holds(name):
        quantized.check(name, expected)
        return
    if name not in checkpoint:
        raise AtlasError(
            f"tensor {name!r} (expected shape {list(expected)}) is missing from {checkpoint.source}; "
            "the checkpoint is incomplete or does not match its config.json"
        )
    info = checkpoint.info(name)
    if tuple(info.shape) != tuple(expected):
        raise AtlasError(
            f"tensor {name!r} in {info.path} has shape {list(info.shape)}, expected {list(expected)} "
            "from config.json; the checkpoint does not match its config"
        )
    if info.dtype not in READABLE_DTYPES:
        raise AtlasError(
            f"tensor {name!r} in {info.path} is {info.dtype}; atlas reads "
            f"{', '.join(sorted(READABLE_DTYPES))} tensors, and quantized weights only in an fp8 or "
            "nvfp4 checkpoint whose config declares that quantization"
        )


class WeightReader:
    """Reads the planned tensors as float32 and uploads them to a backend."""

    def __init__(self, checkpoint: Checkpoint, backend: Backend, plan: Mapping[str, Shape]):
        self.quantized = QuantizedTensors.of(checkpoint)
        for name, shape in plan.items():
            check_tensor(checkpoint, name, shape, self.quantized)
        self.checkpoint = checkpoint
        self.backend = backend
        self._plan = dict(plan)
        self._bar = self._progress(sum(self._stored_bytes(n) for n in plan))

    def _stored_bytes(self, name: str) -> int:
        if self.quantized.holds(name):
            return self.quantized.nbytes(name)
        return self.checkpoint.info(name).nbytes

    def _progress(self, total: int):  # noqa: ANN202 - tqdm's type
        from tqdm import tqdm

        return tqdm(
            total=total, desc="loading weights", unit="B", unit_scale=True, file=sys.stderr, leave=False
        )

    def _check_planned(self, names: Sequence[str]) -> None:
        missing = [n for n in names if n not in self._plan]
        if missing:
            raise KeyError(f"{missing[0]} was not planned; add it to the family's plan")

    def array(self, name: str) -> np.ndarray:
        """The planned tensor as a float32 host array (bf16 converted exactly); on a backend that
        keeps stored floats (`keeps_stored_floats`: numpy), a bf16 / f16 matrix comes as stored,
        a read-only view of the checkpoint's memory map, so it is never expanded to float32."""
        self._check_planned([name])
        if self.quantized.holds(name):
            data = self.quantized.weight(name).dequantize()
        elif self._keeps_stored(name):
            data = self.checkpoint.get_raw(name)
        else:
            data = np.asarray(self.checkpoint.get(name), dtype=np.float32)
        self._bar.update(self._stored_bytes(name))
        return data

    def _keeps_stored(self, name: str) -> bool:
        info = self.checkpoint.info(name)
        compact = info.dtype in COMPACT_FLOAT_DTYPES and len(info.shape) >= 2
        return compact and bool(getattr(self.backend, "keeps_stored_floats", False))

    def upload(self, array: np.ndarray) -> Tensor:
        """Matrices are stored as bf16 on backends that can, vectors stay f32. The arrays are the
        loader's own temporaries: a backend that keeps stored floats gets them read-only, which
        lets it keep them instead of copying (a layer's expert stack is a GiB on Qwen3.6)."""
        data = np.ascontiguousarray(array)
        if getattr(self.backend, "keeps_stored_floats", False):
            data = data.view()
            data.flags.writeable = False
        return self.backend.upload(data, "bf16" if array.ndim >= 2 else "f32")

    def tensor(self, name: str) -> Tensor:
        """A whole planned tensor; a quantized one goes packed to a backend with
        `upload_quantized(QuantizedWeight)`, dequantized to any other."""
        upload_quantized = getattr(self.backend, "upload_quantized", None)
        if upload_quantized is not None and self.quantized.holds(name):
            self._check_planned([name])
            weight = self.quantized.weight(name)
            self._bar.update(weight.nbytes)
            return upload_quantized(weight)
        return self.upload(self.array(name))

    def can_pack(self, names: Sequence[str]) -> bool:
        """Whether `packed` takes these names: the backend has `upload_quantized_rows` and every
        name is a quantized matrix of this checkpoint."""
        return hasattr(self.backend, "upload_quantized_rows") and all(self.quantized.holds(n) for n in names)

    def packed(self, names: Sequence[str], row_sets: Sequence[np.ndarray | None] = (None,),
               experts: int = 0) -> list[Tensor]:
        """Quantized matrices stacked by rows and uploaded packed (`can_pack` first): one tensor per
        row selection (None: every row), as `backend.upload_quantized_rows(weights, rows, experts)`;
        experts > 0 says the stack is that many equal expert blocks."""
        self._check_planned(names)
        weights = [self.quantized.weight(n) for n in names]
        for weight in weights:
            self._bar.update(weight.nbytes)
        upload = self.backend.upload_quantized_rows  # type: ignore[attr-defined]
        return [upload(weights, rows, experts) for rows in row_sets]

    def split_linear(self, parts: Sequence[RowPart]) -> SplitLinear:
        """The parts (linears of one input) stacked by rows into one weight per storage: the
        quantized matrices packed together when `can_pack` (fp8 / nvfp4 on the GPU), the others
        together as float. Each named matrix is read once, however many parts it gives."""
        self._check_planned([p.name for p in parts])
        packed = tuple(i for i, p in enumerate(parts) if self.can_pack([p.name]))
        plain = tuple(i for i in range(len(parts)) if i not in packed)
        groups = [self._packed_group(parts, packed)] if packed else []
        if plain:
            groups.append(self._float_group(parts, plain))
        return SplitLinear(tuple(groups))

    def _rows_of(self, part: RowPart) -> np.ndarray:
        return np.arange(self._plan[part.name][0]) if part.rows is None else np.asarray(part.rows)

    def _packed_group(self, parts: Sequence[RowPart], indices: tuple[int, ...]) -> WeightGroup:
        names = list(dict.fromkeys(parts[i].name for i in indices))
        heights = [self._plan[n][0] for n in names]
        offsets = dict(zip(names, np.cumsum([0, *heights[:-1]]).tolist()))
        rows = [offsets[parts[i].name] + self._rows_of(parts[i]) for i in indices]
        selection = np.concatenate(rows)
        every_row = np.array_equal(selection, np.arange(sum(heights)))
        (weight,) = self.packed(names, (None if every_row else selection,))
        return WeightGroup(weight, tuple(len(r) for r in rows), indices)

    def _float_group(self, parts: Sequence[RowPart], indices: tuple[int, ...]) -> WeightGroup:
        arrays = {name: self.array(name) for name in dict.fromkeys(parts[i].name for i in indices)}
        blocks = [arrays[parts[i].name][self._rows_of(parts[i])] for i in indices]  # [rows, K] each
        return WeightGroup(self.upload(np.concatenate(blocks)), tuple(len(b) for b in blocks), indices)

    def close(self) -> None:
        self._bar.close()
