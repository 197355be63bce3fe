"""Quantized weights as a checkpoint stores them, found per tensor by their companion scales.

A planned name `<m>.weight` is quantized when the checkpoint stores it as e4m3 with
`<m>.weight_scale_inv` (fp8) or as uint8 with `<m>.weight_scale` and `<m>.weight_scale_2` (nvfp4);
any other tensor (excluded modules, norms, embeddings) is read as stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import AtlasError
from ..safetensors import Checkpoint
from .fp8_block import block_grid, dequantize_fp8_block
from .nvfp4 import dequantize_nvfp4
from .scheme import QuantScheme, read_scheme

SCALE_DTYPES = frozenset({"BF16", "F16", "F32"})
Shape = tuple[int, ...]


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantized [N, K] weight: its stored parts, keyed by suffix ("weight", "weight_scale_inv"
    for fp8; "weight", "weight_scale", "weight_scale_2", "input_scale" for nvfp4), as stored."""

    name: str  # the logical checkpoint name, "<m>.weight"
    method: str  # "fp8" or "nvfp4"
    shape: tuple[int, int]  # logical [N, K]
    parts: dict[str, np.ndarray]
    block: tuple[int, int]  # fp8 weight_block_size (unused by nvfp4)

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.parts.values())

    def dequantize(self) -> np.ndarray:
        """The weight as float32 [N, K]."""
        if self.method == "fp8":
            return dequantize_fp8_block(self.parts["weight"], self.parts["weight_scale_inv"], self.block)
        return dequantize_nvfp4(self.parts["weight"], self.parts["weight_scale"], self.parts["weight_scale_2"])


def model_dir_of(checkpoint: Checkpoint) -> Path:
    source = Path(checkpoint.source)
    return source if source.is_dir() else source.parent


@dataclass(frozen=True)
class QuantizedTensors:
    """The quantized view of a checkpoint (empty for bf16 ones)."""

    checkpoint: Checkpoint
    scheme: QuantScheme

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> QuantizedTensors:
        return cls(checkpoint, read_scheme(model_dir_of(checkpoint)))

    def holds(self, name: str) -> bool:
        if self.scheme.method == "bf16" or not name.endswith(".weight") or name not in self.checkpoint:
            return False
        stored = self.checkpoint.dtype(name)
        return stored == "F8_E4M3" if self.scheme.method == "fp8" else stored == "U8"

    def _part(self, name: str, suffix: str) -> str:
        part = name[: -len("weight")] + suffix
        if part not in self.checkpoint:
            raise AtlasError(
                f"{name!r} is stored {self.checkpoint.dtype(name)} ({self.scheme.method}) but "
                f"{part!r} is missing from {self.checkpoint.source}; the checkpoint is incomplete"
            )
        return part

    def suffixes(self) -> tuple[str, ...]:
        if self.scheme.method == "fp8":
            return ("weight", "weight_scale_inv")
        return ("weight", "weight_scale", "weight_scale_2", "input_scale")

    def part_names(self, name: str) -> dict[str, str]:
        names = {s: self._part(name, s) for s in self.suffixes() if s != "input_scale"}
        optional = name[: -len("weight")] + "input_scale"
        if self.scheme.method == "nvfp4" and optional in self.checkpoint:
            names["input_scale"] = optional
        return names

    def shape(self, name: str) -> tuple[int, int]:
        """The logical [N, K] of a quantized weight, after checking its parts agree."""
        stored = self.checkpoint.shape(name)
        names = self.part_names(name)
        if len(stored) != 2:
            raise self._bad(name, f"has {len(stored)} dimensions; quantized weights are matrices")
        if self.scheme.method == "fp8":
            return self._check_fp8(name, stored, names["weight_scale_inv"])
        return self._check_nvfp4(name, stored, names)

    def _bad(self, name: str, problem: str) -> AtlasError:
        return AtlasError(
            f"{name!r} in {self.checkpoint.source} {problem}; the checkpoint is corrupt or not {self.scheme.method}"
        )

    def _check_fp8(self, name: str, stored: Shape, scale_name: str) -> tuple[int, int]:
        expected = block_grid(stored, self.scheme.block)
        found = self.checkpoint.shape(scale_name)
        if tuple(found) != expected:
            blocks = f"for weight {list(stored)} in {list(self.scheme.block)} blocks"
            raise self._bad(scale_name, f"has shape {list(found)}, expected {list(expected)} {blocks}")
        if self.checkpoint.dtype(scale_name) not in SCALE_DTYPES:
            raise self._bad(scale_name, f"is {self.checkpoint.dtype(scale_name)}, expected BF16, F16 or F32")
        return stored[0], stored[1]

    def _check_nvfp4(self, name: str, stored: Shape, names: dict[str, str]) -> tuple[int, int]:
        n, k = stored[0], stored[1] * 2
        scale, scale_2 = names["weight_scale"], names["weight_scale_2"]
        expected = (n, k // self.scheme.group_size)
        found = (self.checkpoint.dtype(scale), tuple(self.checkpoint.shape(scale)))
        if found != ("F8_E4M3", expected):
            raise self._bad(scale, f"is {found[0]} {list(found[1])}, expected F8_E4M3 {list(expected)}")
        for single in (scale_2, names.get("input_scale")):  # input_scale is optional (unused by W4A16)
            if single is not None and (
                self.checkpoint.dtype(single) != "F32" or int(np.prod(self.checkpoint.shape(single))) != 1
            ):
                raise self._bad(single, "is not one F32 value")
        return n, k

    def check(self, name: str, expected: Shape) -> None:
        found = self.shape(name)
        if found != tuple(expected):
            raise AtlasError(
                f"quantized tensor {name!r} in {self.checkpoint.source} holds a {list(found)} weight, "
                f"expected {list(expected)} from config.json; the checkpoint does not match its config"
            )

    def nbytes(self, name: str) -> int:
        return sum(self.checkpoint.info(p).nbytes for p in self.part_names(name).values())

    def weight(self, name: str) -> QuantizedWeight:
        names = self.part_names(name)
        parts = {suffix: self.checkpoint.get_raw(part) for suffix, part in names.items()}
        self._check_scales(names, parts)
        return QuantizedWeight(name, self.scheme.method, self.shape(name), parts, self.scheme.block)

    def _check_scales(self, names: dict[str, str], parts: dict[str, np.ndarray]) -> None:
        """Every scale finite and not negative: a NaN or inf scale makes its whole block garbage,
        a negative one flips its block's signs, both silently (a quantizer writes amax / max >= 0)."""
        for suffix, part in names.items():
            flaw = None if suffix == "weight" else scale_flaw(parts[suffix], e4m3=suffix == "weight_scale")
            if flaw is not None:
                raise self._bad(part, f"holds {flaw}")


def scale_flaw(raw: np.ndarray, e4m3: bool) -> str | None:
    """What is wrong with a tensor of scales, if anything: "a NaN or infinite scale" or "a negative
    scale". e4m3 scales are checked on their bytes (NaN is S.1111.111; -0 is harmless), faster
    than decoding the billions of them a Qwen3.6 nvfp4 checkpoint holds."""
    if e4m3:
        codes = raw.view(np.uint8)
        magnitude = codes & 0x7F
        nan, negative = (magnitude == 0x7F).any(), ((codes >= 0x80) & (magnitude != 0)).any()
    else:  # bf16 (ml_dtypes), f16 or f32 as stored
        values = raw.astype(np.float32)
        nan, negative = not np.isfinite(values).all(), (values < 0).any()
    return "a NaN or infinite scale" if nan else "a negative scale" if negative else None
