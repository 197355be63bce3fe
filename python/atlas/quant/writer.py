"""Streaming safetensors writer: tensors are buffered up to a shard budget, each shard is written
once, and `finish` names the files (model.safetensors, or numbered shards plus the index)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import AtlasError
from ..safetensors import DTYPES, INDEX_FILE, SINGLE_FILE

STORAGE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
DEFAULT_SHARD_BYTES = 4 * 1024**3
HEADER_ALIGN = 8


def storage_name(array: np.ndarray) -> str:
    name = STORAGE_NAMES.get(array.dtype)
    if name is None:
        raise ValueError(f"no safetensors dtype for {array.dtype}")
    return name


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, array in tensors.items():
        header[name] = {
            "dtype": storage_name(array), "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }  # fmt: skip
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % HEADER_ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())


@dataclass
class ShardWriter:
    directory: Path
    shard_bytes: int = DEFAULT_SHARD_BYTES
    _pending: dict[str, np.ndarray] = field(default_factory=dict)
    _pending_bytes: int = 0
    _shards: list[list[str]] = field(default_factory=list)
    _names: set[str] = field(default_factory=set)  # every tensor added
    total_bytes: int = 0

    def add(self, name: str, array: np.ndarray) -> None:
        if name in self._names:
            raise AtlasError(f"tensor {name!r} would be written twice; the source checkpoint holds it beside "
                             "the tensor it is made from")
        self._names.add(name)
        if self._pending and self._pending_bytes + array.nbytes > self.shard_bytes:
            self._flush()
        self._pending[name] = array
        self._pending_bytes += array.nbytes
        self.total_bytes += array.nbytes

    def _flush(self) -> None:
        write_safetensors(self._shard_path(len(self._shards)), self._pending)
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def _shard_path(self, index: int) -> Path:
        return self.directory / f"shard-{index:05d}.partial"

    def finish(self) -> list[Path]:
        """Write the last shard and give every shard its final name; returns the files."""
        if self._pending or not self._shards:
            self._flush()
        count = len(self._shards)
        if count == 1:
            final = self.directory / SINGLE_FILE
            self._shard_path(0).rename(final)
            return [final]
        names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        for i, name in enumerate(names):
            self._shard_path(i).rename(self.directory / name)
        weight_map = {t: names[i] for i, shard in enumerate(self._shards) for t in shard}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return [self.directory / name for name in names] + [self.directory / INDEX_FILE]
