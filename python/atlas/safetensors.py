"""Memory-mapped safetensors reader: single file or sharded, no pickle, no torch.

Every header is validated when the checkpoint is opened, so a broken download fails at once
with one line naming the file and the tensor, not halfway through loading.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import ml_dtypes
import numpy as np

from .config import read_json_object
from .errors import AtlasError
from . import json_text

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HEADER_LENGTH_BYTES = 8

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
REFETCH_HINT = "the download is incomplete or corrupt; fetch the checkpoint again"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    path: Path
    start: int  # absolute byte offset of the data in the file
    nbytes: int


@dataclass
class ShardFile:
    """One .safetensors file: its validated header and (lazily) its memory map."""

    path: Path
    tensors: dict[str, TensorInfo]
    _map: mmap.mmap | None = field(default=None, repr=False)

    @classmethod
    def open(cls, path: Path) -> ShardFile:
        return cls(path, parse_header(path))

    def buffer(self) -> mmap.mmap:
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._map


def parse_header(path: Path) -> dict[str, TensorInfo]:
    """Read and validate the header of one safetensors file."""
    header, data_start, file_size = read_header(path)
    header.pop("__metadata__", None)
    tensors = {
        name: parse_entry(path, name, entry, data_start, file_size) for name, entry in header.items()
    }
    check_no_overlap(path, tensors)
    return tensors


def read_metadata(path: Path) -> dict[str, str]:
    """The header's __metadata__ (string to string); {} when it has none."""
    metadata = read_header(path)[0].get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise AtlasError(f"{path}: __metadata__ is not a string-to-string object; {REFETCH_HINT}")
    return metadata


def read_header(path: Path) -> tuple[dict[str, object], int, int]:
    """(the header as JSON, where the data starts, the file's size)."""
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(HEADER_LENGTH_BYTES)
            if len(prefix) < HEADER_LENGTH_BYTES:
                raise AtlasError(f"{path} is truncated ({file_size} bytes); {REFETCH_HINT}")
            (header_len,) = struct.unpack("<Q", prefix)
            data_start = HEADER_LENGTH_BYTES + header_len
            if data_start > file_size:
                raise AtlasError(
                    f"{path}: header length {header_len} is larger than the file "
                    f"({file_size} bytes); {REFETCH_HINT}"
                )
            header_bytes = f.read(header_len)
    except OSError as err:
        raise AtlasError(f"{path} cannot be read ({err.strerror}); check the file") from None
    try:
        header = json_text.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise AtlasError(f"{path}: the header is not valid JSON; {REFETCH_HINT}") from None
    if not isinstance(header, dict):
        raise AtlasError(f"{path}: the header is not a JSON object; {REFETCH_HINT}")
    return header, data_start, file_size


MAX_DIMS = 64  # numpy's limit


def parse_entry(path: Path, name: str, entry: object, data_start: int, file_size: int) -> TensorInfo:
    def bad(problem: str) -> AtlasError:
        return AtlasError(f"{path}: tensor {name!r} {problem}; {REFETCH_HINT}")

    if not isinstance(entry, dict):
        raise bad("has a header entry that is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise AtlasError(
            f"{path}: tensor {name!r} has unknown dtype {repr(dtype)[:40]} (atlas reads {', '.join(DTYPES)}); "
            "convert the checkpoint to one of these"
        )
    if not is_int_list(shape) or any(d < 0 for d in shape) or len(shape) > MAX_DIMS or \
            prod(max(d, 1) for d in shape) > file_size:  # an empty tensor's other dims are no larger either
        raise bad(f"has an invalid shape {json.dumps(shape)[:80]}")
    if not is_int_list(offsets) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        raise bad(f"has invalid data_offsets {offsets!r}")
    begin, end = offsets
    expected = prod(shape) * DTYPES[dtype].itemsize
    if end - begin != expected:
        raise bad(f"spans {end - begin} bytes but shape {shape} x {dtype} needs {expected}")
    if data_start + end > file_size:
        raise bad(
            f"has data_offsets {offsets} past the end of the file "
            f"({file_size - data_start} data bytes)"
        )
    return TensorInfo(name, dtype, tuple(shape), path, data_start + begin, expected)


def is_int_list(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


def check_no_overlap(path: Path, tensors: dict[str, TensorInfo]) -> None:
    ordered = sorted((t for t in tensors.values() if t.nbytes), key=lambda t: t.start)
    for before, after in zip(ordered, ordered[1:]):
        if after.start < before.start + before.nbytes:
            raise AtlasError(
                f"{path}: tensors {before.name!r} and {after.name!r} overlap; {REFETCH_HINT}"
            )


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Exact bf16 -> f32: the bf16 bits are the upper half of the f32 bits."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


class Checkpoint:
    """Tensors of a checkpoint directory by name, memory-mapped."""

    def __init__(self, source: Path, shards: dict[Path, ShardFile], where: dict[str, Path]):
        self.source = source  # the file that lists the tensors (named in errors)
        self._shards = shards
        self._where = where  # tensor name -> shard path

    @classmethod
    def open(cls, model_dir: Path) -> Checkpoint:
        model_dir = Path(model_dir)
        index = model_dir / INDEX_FILE
        if index.is_file():
            return cls.open_index(index)
        single = model_dir / SINGLE_FILE
        if single.is_file():
            return cls.open_files(single, [single])
        loose = sorted(model_dir.glob("*.safetensors"))
        if loose:
            return cls.open_files(model_dir, loose)
        raise AtlasError(
            f"{model_dir} has no {SINGLE_FILE} or {INDEX_FILE}; point --model at a directory "
            "holding a safetensors checkpoint"
        )

    @classmethod
    def open_files(cls, source: Path, paths: list[Path]) -> Checkpoint:
        shards = {path: ShardFile.open(path) for path in paths}
        where: dict[str, Path] = {}
        for path, shard in shards.items():
            for name in shard.tensors:
                if name in where:
                    raise AtlasError(
                        f"tensor {name!r} is in both {where[name]} and {path}; remove the stray file"
                    )
                where[name] = path
        return cls(source, shards, where)

    @classmethod
    def open_index(cls, index: Path) -> Checkpoint:
        weight_map = read_weight_map(index)
        shards: dict[Path, ShardFile] = {}
        for file_name in sorted(set(weight_map.values())):
            if Path(file_name).name != file_name or file_name in ("", ".", ".."):
                raise AtlasError(
                    f"{index} names shard {file_name!r}, which is not a file name in its directory; "
                    f"{REFETCH_HINT}"
                )
            path = index.parent / file_name
            if not path.is_file():
                raise AtlasError(
                    f"{index} lists shard {file_name!r}, which is missing; {REFETCH_HINT}"
                )
            shards[path] = ShardFile.open(path)
        where = {name: index.parent / file_name for name, file_name in weight_map.items()}
        for name, path in where.items():
            if name not in shards[path].tensors:
                raise AtlasError(
                    f"{index} places tensor {name!r} in {path.name}, but that file does not hold it; "
                    f"{REFETCH_HINT}"
                )
        return cls(index, shards, where)

    # --- lookup -------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)

    def info(self, name: str) -> TensorInfo:
        path = self._where.get(name)
        if path is None:
            raise AtlasError(
                f"tensor {name!r} is missing from {self.source}; the checkpoint is incomplete "
                "or not of the model type its config.json names"
            )
        return self._shards[path].tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype(self, name: str) -> str:
        return self.info(name).dtype

    # --- data ---------------------------------------------------------------------------------
    def get_raw(self, name: str) -> np.ndarray:
        """The tensor as stored (bf16 as ml_dtypes.bfloat16): a read-only view of the map."""
        info = self.info(name)
        count = prod(info.shape)
        flat = np.frombuffer(
            self._shards[info.path].buffer(), DTYPES[info.dtype], count, info.start
        )  # [numel]
        return flat.reshape(info.shape)

    def get(self, name: str) -> np.ndarray:
        """Float tensors as float32 (bf16 and fp8 exactly), integer tensors as stored."""
        raw = self.get_raw(name)
        dtype = self.dtype(name)
        if dtype == "BF16":
            return bf16_bits_to_f32(raw.view(np.uint16))
        if dtype in FLOAT_DTYPES and dtype != "F32":
            return raw.astype(np.float32)
        return raw

    def close(self) -> None:
        """Drop the memory maps; arrays already returned keep them alive until released."""
        for shard in self._shards.values():
            shard._map = None


def read_weight_map(index: Path) -> dict[str, str]:
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise AtlasError(f"{index} has no valid 'weight_map' object; {REFETCH_HINT}")
    return weight_map
