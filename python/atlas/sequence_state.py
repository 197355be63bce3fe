"""Saved sequences: one sequence's state in a file, so a conversation resumes later, after a
restart or on another server with the same model, without its prompt running again (llama.cpp's
slot save / restore; llama_state_seq_save_file).

What is saved is the longest point the prompt cache could resume a generation from: the live
states (every token fed so far) or a prompt-cache checkpoint (atlas.prompt_cache); a speculative
engine resumes at checkpoints only. Restoring puts the engine's state there, so the next prompt
that starts with the saved tokens runs only its remaining ones. The file is safetensors:

  tokens                         I32 [n]     the saved tokens
  layer.{i}.k.{field}, .v.{field}            a full-attention layer's rows 0..n-1 as its cache stores
                                             them ("rows" for a plain cache, a quantized level's packed
                                             fields otherwise: nothing is converted either way)
  layer.{i}.conv, .recurrent     F32         a Gated DeltaNet layer's states after token n-1
  mtp.k.{field}, mtp.v.{field}               the MTP head's rows (speculative engines)
  hidden, head_input             F32 [1, H]  the last token's rows, when the point is a checkpoint

and __metadata__ {"format": FORMAT, "layout": what an engine must match to restore it}.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .backends.base import KVCache, Tensor
from .errors import AtlasError
from .layers.linear_attention import DeltaNetState
from .prompt_cache import StateCheckpoint, common_prefix
from .quant.writer import write_safetensors
from .safetensors import Checkpoint, read_metadata
from .snapshot import copy_tensor

if TYPE_CHECKING:
    from .engine import Engine

FORMAT = "atlas-sequence/1"
CACHE_OFF = "the prompt cache is off (prompt_cache=0, --prompt-cache 0)"
ROW_NAMES = ("hidden", "head_input")


@dataclass(frozen=True)
class SequenceFile:
    tokens: int  # the tokens saved or restored
    nbytes: int  # the file's size


@dataclass(frozen=True)
class ResumePoint:
    ids: list[int]
    checkpoint: StateCheckpoint | None  # None: the live states


def save_sequence(engine: Engine, path: Path, within: list[int] | None = None) -> SequenceFile:
    """Write the engine's longest resumable point to `path` (replaced whole, never half written);
    with `within`, the longest whose tokens begin it (a prompt's own state, not its answer's)."""
    with engine.turns.lock:  # not in the middle of another thread's step
        point = resume_point(engine, within)
        tensors = sequence_tensors(engine, point)
    metadata = {"format": FORMAT, "layout": json.dumps(layout(engine), sort_keys=True)}
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        write_safetensors(partial, tensors, metadata)
        os.replace(partial, path)
    except OSError as err:
        partial.unlink(missing_ok=True)
        raise AtlasError(f"cannot write {path} ({err.strerror}); check the directory and its free space") from None
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return SequenceFile(len(point.ids), path.stat().st_size)


def restore_sequence(engine: Engine, path: Path) -> SequenceFile:
    """Put the engine's state where a saved sequence left it; a stream open on the engine is
    overtaken (its state is gone). A file this engine cannot take changes nothing."""
    if not engine.prompt_cache.enabled:
        raise AtlasError(f"{CACHE_OFF}, so no prompt could resume from a restored sequence; turn it on")
    saved = open_sequence_file(path)
    try:
        check_layout(engine, path)
        with engine.turns.lock:
            ids = saved_tokens(engine, path, saved)
            check_tensors(engine, path, saved, len(ids))
            engine.turns.start()
            engine.reset()
            try:
                write_back(engine, saved, ids)
            except BaseException:  # half written
                engine.prompt_cache.forget()
                raise
    finally:
        saved.close()
    return SequenceFile(len(ids), path.stat().st_size)


def erase_sequence(engine: Engine) -> int:
    """Forget the sequence the engine holds (the next prompt runs from its first token); returns
    how many tokens it held."""
    with engine.turns.lock:
        engine.turns.start()
        held = len(engine.prompt_cache.history or [])
        engine.prompt_cache.reset()
    return held


# --- saving --------------------------------------------------------------------------------------
def resume_point(engine: Engine, within: list[int] | None = None) -> ResumePoint:
    """The longest point the engine could resume at, among those whose tokens begin `within` when
    given (a checkpoint over the live states on a tie: it also serves a prompt equal to its tokens)."""
    cache = engine.prompt_cache
    if not cache.enabled:
        raise AtlasError(f"{CACHE_OFF}, so no sequence is kept to save; turn it on")
    points = [ResumePoint(list(c.ids), c) for c in cache.checkpoints if engine.resumable(len(c.ids), c)]
    if cache.history and engine.resumable(len(cache.history), None):
        points.append(ResumePoint(list(cache.history), None))
    points = [p for p in points if within is None or common_prefix(p.ids, within)]
    return max(points, key=lambda p: (len(p.ids), p.checkpoint is not None), default=ResumePoint([], None))


def sequence_tensors(engine: Engine, point: ResumePoint) -> dict[str, np.ndarray]:
    be, n = engine.backend, len(point.ids)
    tensors = {"tokens": np.array(point.ids, dtype=np.int32)}  # [n]
    delta = dict(delta_states(engine, point.checkpoint))
    for i, state in enumerate(engine.states):
        if isinstance(state, KVCache):
            tensors.update(cache_tensors(engine, f"layer.{i}", state, n))
        elif isinstance(state, DeltaNetState):
            conv, recurrent = delta[i]
            tensors[f"layer.{i}.conv"] = be.to_numpy(conv)  # [C, K-1]
            tensors[f"layer.{i}.recurrent"] = be.to_numpy(recurrent)  # [Hv, Dk, Dv]
    for name, (cache, rows) in engine.extra_caches().items():
        tensors.update(cache_tensors(engine, name, cache, min(rows, n)))
    if point.checkpoint is not None:
        tensors["hidden"] = be.to_numpy(point.checkpoint.hidden)  # [1, H]
        if point.checkpoint.has_head_input:
            tensors["head_input"] = be.to_numpy(point.checkpoint.head_input)  # [1, H]
    return tensors


def delta_states(engine: Engine, checkpoint: StateCheckpoint | None) -> list[tuple[int, tuple[Tensor, Tensor]]]:
    """(layer, (conv, recurrent)) of each DeltaNet layer: the checkpoint's copies, or the live states."""
    if checkpoint is not None:
        return [(i, (conv, recurrent)) for i, conv, recurrent in checkpoint.states.saved]
    return [(i, (s.conv, s.recurrent)) for i, s in enumerate(engine.states) if isinstance(s, DeltaNetState)]


def cache_tensors(engine: Engine, name: str, cache: KVCache, rows: int) -> dict[str, np.ndarray]:
    be = engine.backend
    return {f"{name}.{part}.{field}": array
            for part, stored in (("k", cache.k), ("v", cache.v))
            for field, array in be.cache_rows(stored, rows).items()}


def layout(engine: Engine) -> dict[str, Any]:
    """What a restoring engine must share with the saving one beyond the tensors' shapes: the
    model's layers, how its caches store rows, and the backend that stored them."""
    spec = engine.spec
    return {"layer_types": list(spec.layer_types), "hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size,
            "kv_cache": list(engine.kv_plan), "backend": engine.backend.name, "extra_caches": sorted(engine.extra_caches())}


# --- restoring -----------------------------------------------------------------------------------
def open_sequence_file(path: Path) -> Checkpoint:
    if not path.is_file():
        raise AtlasError(f"{path} does not exist; save the sequence first")
    try:
        metadata = read_metadata(path)
        saved = Checkpoint.open_files(path, [path])
    except AtlasError:
        raise AtlasError(f"{path} is not a saved sequence atlas can read (truncated or another file); "
                         "save the sequence again") from None
    if metadata.get("format") != FORMAT or "tokens" not in saved:
        saved.close()
        raise AtlasError(f"{path} is not an {FORMAT} file; save the sequence with atlas")
    return saved


def check_layout(engine: Engine, path: Path) -> None:
    try:
        theirs = json.loads(read_metadata(path).get("layout", "{}"))
    except ValueError:
        theirs = None
    if not isinstance(theirs, dict):
        raise AtlasError(f"{path}: its layout metadata is not a JSON object; save the sequence again")
    ours = layout(engine)
    differ = sorted(key for key in ours if theirs.get(key) != ours[key])
    if differ:
        shown = "; ".join(f"{key}: saved {theirs.get(key)!r}, here {ours[key]!r}" for key in differ)
        raise AtlasError(f"{path} was saved by another model or cache setting ({shown}); restore it where it was "
                         "saved, or save the sequence again here")


def saved_tokens(engine: Engine, path: Path, saved: Checkpoint) -> list[int]:
    tokens = saved.get_raw("tokens")
    if tokens.ndim != 1 or saved.dtype("tokens") != "I32":
        raise AtlasError(f"{path}: tokens is not an I32 vector; save the sequence again")
    if len(tokens) and not (0 <= int(tokens.min()) and int(tokens.max()) < engine.spec.vocab_size):
        raise AtlasError(f"{path}: a token id is outside this model's vocabulary; save the sequence again")
    return [int(t) for t in tokens]


def check_tensors(engine: Engine, path: Path, saved: Checkpoint, n: int) -> None:
    """The file holds exactly the tensors the engine would save for n tokens, shaped so."""
    if n > engine.max_seq_len:
        raise AtlasError(f"{path} holds {n} tokens, more than this engine's context of {engine.max_seq_len}; "
                         "load the model with a longer context (--max-model-len)")
    expected = {name: (array.shape, array.dtype) for name, array in expected_tensors(engine, n, saved).items()}
    found = set(saved.names()) - {"tokens"}
    if found != set(expected):
        odd = sorted(found ^ set(expected))[:3]
        raise AtlasError(f"{path} does not hold this model's state (tensors {', '.join(odd)} differ); save the sequence again")
    for name, (shape, dtype) in expected.items():
        raw = saved.get_raw(name)
        if raw.shape != shape or raw.dtype != dtype:
            raise AtlasError(f"{path}: {name} is {raw.dtype} {raw.shape}, this engine keeps {dtype} {shape}; "
                             "save the sequence again")


def expected_tensors(engine: Engine, n: int, saved: Checkpoint) -> dict[str, np.ndarray]:
    """Empty arrays of the shape and dtype of each tensor the engine would save for n tokens (the
    MTP rows as many as the file holds; the last token's rows when the file has them)."""
    out: dict[str, np.ndarray] = {}
    for i, state in enumerate(engine.states):
        if isinstance(state, KVCache):
            out.update(cache_shapes(engine, f"layer.{i}", state, n))
        elif isinstance(state, DeltaNetState):
            out[f"layer.{i}.conv"] = np.empty(tuple(state.conv.shape), np.float32)
            out[f"layer.{i}.recurrent"] = np.empty(tuple(state.recurrent.shape), np.float32)
    for name, (cache, _) in engine.extra_caches().items():
        out.update(cache_shapes(engine, name, cache, min(first_rows(saved, name), n)))
    hidden = (1, engine.spec.hidden_size)
    out.update({row: np.empty(hidden, np.float32) for row in ROW_NAMES if row in saved})
    return out


def first_rows(saved: Checkpoint, name: str) -> int:
    """How many rows of cache `name` the file holds (0 when none)."""
    fields = [n for n in saved.names() if n.startswith(f"{name}.k.")]
    return saved.shape(fields[0])[0] if fields else 0


def cache_shapes(engine: Engine, name: str, cache: KVCache, rows: int) -> dict[str, np.ndarray]:
    return {key: np.empty((rows, *array.shape[1:]), array.dtype)
            for key, array in cache_tensors(engine, name, cache, 0).items()}


def write_back(engine: Engine, saved: Checkpoint, ids: list[int]) -> None:
    """Write the file's tensors into the engine's fresh states and tell the prompt cache."""
    be = engine.backend
    for i, state in enumerate(engine.states):
        if isinstance(state, KVCache):
            write_cache(engine, saved, f"layer.{i}", state)
        elif isinstance(state, DeltaNetState):
            copy_tensor(be, state.conv, be.upload(np.array(saved.get_raw(f"layer.{i}.conv")), "f32"))
            copy_tensor(be, state.recurrent, be.upload(np.array(saved.get_raw(f"layer.{i}.recurrent")), "f32"))
    engine.prompt_cache.restored(ids)
    if "hidden" in saved:
        rows = {row: be.upload(np.array(saved.get_raw(row)), "f32") for row in ROW_NAMES if row in saved}
        engine.prompt_cache.save(engine.states, rows["hidden"], rows.get("head_input"))
    extra = engine.extra_caches()
    for name, (cache, _) in extra.items():
        write_cache(engine, saved, name, cache)
    engine.extra_caches_restored({name: first_rows(saved, name) for name in extra})


def write_cache(engine: Engine, saved: Checkpoint, name: str, cache: KVCache) -> None:
    for part, stored in (("k", cache.k), ("v", cache.v)):
        prefix = f"{name}.{part}."
        fields = {key[len(prefix):]: np.array(saved.get_raw(key)) for key in saved.names() if key.startswith(prefix)}
        if fields and len(next(iter(fields.values()))):
            engine.backend.write_cache_rows(stored, fields)
