"""ATLAS_DUMP: write each layer's named intermediates to disk while the engine runs (no rebuild).

ATLAS_DUMP=layers   hidden-state norms per layer and position
ATLAS_DUMP=experts  router logits top-10, chosen expert ids and weights, routed / shared expert norms
ATLAS_DUMP=all      both, plus every named intermediate as a full .npy tensor
ATLAS_DUMP_DIR      where runs go (default ./atlas-dump); each engine writes a fresh `run-*` directory
                    (made at its first forward):

  index.json             run metadata, every name seen, one entry per forward (step, file,
                         first_position, tokens)
  step-0000.json         {"positions", "norms": {name: [T]}, "experts": {"layer.i": {...}},
                          "tensors": {name: {"file", "shape", "dtype"}}}
  step-0000/<name>.npy   (all only) the tensor as the backend computed it, as float32 / int32

Norms are the L2 norm over the last axis, one per position. The engine announces each forward
with a "positions" tensor; decode steps run eagerly while a dump is attached (no graph replay).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .backends.base import Backend, Tensor
from .errors import AtlasError

DumpMode = Literal["layers", "experts", "all"]
DUMP_MODES: tuple[DumpMode, ...] = ("layers", "experts", "all")
DEFAULT_DUMP_DIR = "atlas-dump"
ROUTER_TOP = 10
FORMAT = "atlas-dump/1"

# names of the hidden states [T, H] whose norms `layers` records (layers/__init__.py names them)
HIDDEN_NAME = re.compile(r"^(embed|final_norm|layer\.\d+\.(input_norm|attn_out|post_norm|mlp_out|out))$")
EXPERT_NAME = re.compile(r"^(layer\.\d+)\.mlp\.(router_logits|router_ids|router_weights|routed|shared)$")


def dump_mode_from_env(environ: dict[str, str] | None = None) -> DumpMode | None:
    """ATLAS_DUMP -> a mode; unset or empty -> None."""
    value = (os.environ if environ is None else environ).get("ATLAS_DUMP", "").strip()
    if not value:
        return None
    if value not in DUMP_MODES:
        raise AtlasError(
            f"ATLAS_DUMP={value!r} is not one of {', '.join(DUMP_MODES)}; set one of them or unset it"
        )
    return value  # type: ignore[return-value]


def dump_from_env(backend: Backend, run_info: dict[str, Any]) -> LayerDump | None:
    """A LayerDump writing under ATLAS_DUMP_DIR when ATLAS_DUMP is set, else None."""
    mode = dump_mode_from_env()
    if mode is None:
        return None
    root = Path(os.environ.get("ATLAS_DUMP_DIR") or DEFAULT_DUMP_DIR)
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable")
    except OSError as err:
        raise dump_dir_error(root, err) from None
    return LayerDump(backend, mode, root, run_info)


DUMP_FIX = "free some space, or point ATLAS_DUMP_DIR at a disk with room"


def dump_dir_error(root: Path, err: OSError) -> AtlasError:
    return AtlasError(
        f"ATLAS_DUMP_DIR {str(root)!r} cannot hold dumps ({err.strerror or err}); point it at a writable directory"
    )


def new_run_dir(root: Path) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    try:
        return Path(tempfile.mkdtemp(prefix=f"run-{stamp}-", dir=root))
    except OSError as err:
        raise dump_dir_error(root, err) from None


@dataclass
class StepRecord:
    index: int
    positions: list[int]
    norms: dict[str, list[float]] = field(default_factory=dict)
    experts: dict[str, dict[str, Any]] = field(default_factory=dict)
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def stem(self) -> str:
        return f"step-{self.index:04d}"

    def index_entry(self) -> dict[str, Any]:
        first = self.positions[0] if self.positions else None
        return {
            "step": self.index, "file": f"{self.stem}.json", "first_position": first,
            "tokens": len(self.positions),
        }  # fmt: skip

    def as_json(self) -> dict[str, Any]:
        return {
            "step": self.index, "positions": self.positions, "norms": self.norms,
            "experts": self.experts, "tensors": self.tensors,
        }  # fmt: skip


class LayerDump:
    """The engine's dump hook (`engine.dump = LayerDump(...)`): called with every named
    intermediate; converts it to numpy at once (backends may reuse the buffer later)."""

    def __init__(self, backend: Backend, mode: DumpMode, root: Path, run_info: dict[str, Any]):
        self.backend = backend
        self.mode = mode
        self.root = Path(root)
        self._run_dir: Path | None = None  # made on the first write: a failed load leaves nothing
        self.run_info = {"format": FORMAT, "mode": mode, "backend": backend.name, **run_info}
        self.steps: list[StepRecord] = []
        self.names: set[str] = set()

    @property
    def run_dir(self) -> Path:
        if self._run_dir is None:
            self._run_dir = new_run_dir(self.root)
        return self._run_dir

    def __call__(self, name: str, tensor: Tensor) -> None:
        array = self.backend.to_numpy(tensor)
        if name == "positions":
            self.steps.append(StepRecord(len(self.steps), [int(p) for p in array.reshape(-1)]))
            return
        if not self.steps:  # a forward that did not announce itself: positions unknown
            self.steps.append(StepRecord(0, []))
        step = self.steps[-1]
        self.names.add(name)
        try:
            self.record(step, name, array)
            if name in ("final_norm", "logits"):
                self.write_step(step)
        except AtlasError:  # a full disk: this step goes whole (the index never listed it); earlier steps stay
            shutil.rmtree(self.run_dir / step.stem, ignore_errors=True)
            with suppress(OSError):
                (self.run_dir / f"{step.stem}.json").unlink(missing_ok=True)
            raise

    def record(self, step: StepRecord, name: str, array: np.ndarray) -> None:
        if self.mode in ("layers", "all") and HIDDEN_NAME.match(name):
            step.norms[name] = row_norms(array)
        if self.mode in ("experts", "all") and (match := EXPERT_NAME.match(name)):
            layer = step.experts.setdefault(match.group(1), {})
            layer.update(expert_fields(match.group(2), array))
        if self.mode == "all":
            step.tensors[name] = self.save_tensor(step, name, array)

    def save_tensor(self, step: StepRecord, name: str, array: np.ndarray) -> dict[str, Any]:
        relative = f"{step.stem}/{name}.npy"
        path = self.run_dir / relative
        try:
            path.parent.mkdir(exist_ok=True)
        except OSError as err:
            raise dump_dir_error(self.root, err) from None
        with atomic_path(path, DUMP_FIX) as scratch:
            with open(scratch, "wb") as handle:
                np.save(handle, array)
        return {"file": relative, "shape": list(array.shape), "dtype": str(array.dtype)}

    def write_step(self, step: StepRecord) -> None:
        write_json(self.run_dir / f"{step.stem}.json", step.as_json(), indent=None, fix=DUMP_FIX)
        steps = [s.index_entry() for s in self.steps]
        index = {**self.run_info, "steps": steps, "names": sorted(self.names)}
        write_json(self.run_dir / "index.json", index, fix=DUMP_FIX)


def row_norms(array: np.ndarray) -> list[float]:
    """L2 norm over the last axis, one per position: [T, ...] -> [T]."""
    rows = array.reshape(array.shape[0], -1).astype(np.float64)
    return np.linalg.norm(rows, axis=-1).tolist()


def expert_fields(kind: str, array: np.ndarray) -> dict[str, Any]:
    """One MoE intermediate -> the JSON fields it contributes to its layer's record."""
    if kind == "router_logits":
        top = min(ROUTER_TOP, array.shape[-1])
        ids = np.argsort(-array, axis=-1, kind="stable")[:, :top]  # [T, top]
        values = np.take_along_axis(array, ids, -1)  # [T, top]
        return {"router_top_ids": ids.tolist(), "router_top_logits": values.tolist()}
    if kind == "router_ids":
        return {"expert_ids": array.tolist()}
    if kind == "router_weights":
        return {"expert_weights": array.tolist()}
    return {f"{kind}_norms": row_norms(array)}  # routed / shared expert outputs [T, H]


@contextmanager
def atomic_path(path: Path, fix: str = "write elsewhere") -> Iterator[Path]:
    """Write to a scratch name beside `path` (one per process), then rename: no partial file is
    ever left, also when the rename fails. fix: what the error line tells the user to do."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield scratch
        os.replace(scratch, path)
    except BaseException as err:
        with suppress(OSError):
            scratch.unlink(missing_ok=True)
        if isinstance(err, OSError):  # a full disk, a directory that takes no files after all
            raise AtlasError(f"{path} cannot be written ({err.strerror or err}); {fix}") from None
        raise


def check_writable(path: Path, flag: str) -> None:
    """An output file atomic_path can write (checked before long work): its directory exists and
    takes files, and it is not a directory itself."""
    try:
        where = path.resolve().parent
        writable = where.is_dir() and os.access(where, os.W_OK)
        is_dir = path.is_dir()
    except OSError as err:  # a name too long, a loop of links
        raise AtlasError(f"{flag} {str(path)[:80]}: {err.strerror or err}; write elsewhere") from None
    if not writable:
        raise AtlasError(f"{flag} {path}: its directory does not exist or cannot be written; write elsewhere")
    if is_dir:
        raise AtlasError(f"{flag} {path} is a directory; name a file")


def write_json(path: Path, payload: dict[str, Any], indent: int | None = 1, fix: str = "write elsewhere") -> None:
    with atomic_path(path, fix) as scratch:
        scratch.write_text(json.dumps(payload, indent=indent) + "\n")
