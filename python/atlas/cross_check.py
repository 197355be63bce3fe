"""atlas on one backend against the numpy reference backend, intermediate by intermediate, each
op given the checked run's inputs (`python -m atlas.compare --against cpu`).

The checked run is the engine as it serves: the prompt in prefill passes (one, or of
`prefill_chunk` tokens each: later passes read the KV cache and DeltaNet states earlier ones left),
then its last `decode_steps` tokens one decode step each (the T = 1 kernels; eager, since a dump is attached),
every named intermediate captured (layers/__init__.py names them), rows in position order. The
numpy backend then runs each layer alone on the checked run's input to that layer (`embed` for
layer 0, `layer.{i-1}.out` after), all positions in one pass from a fresh state, and inside the
layer goes on from the checked run's value at every named intermediate (Step.feed): q, k and v
into attention, the conv output into the delta rule, the router's ids and weights into the
experts (an op the checked backend fused, the opt-in DeltaNet decode kernel, is checked at its
output from the inputs to it). The final norm and lm_head likewise. An intermediate's error is
therefore that of the ops since the names before it, not the sum of everything upstream, and the
first one past the tolerance names the op that is wrong. The error is the worst forward's (a
prefill pass's rows together, a decode step's row alone).

A checkpoint with the MTP head gets it checked too, teacher-forced on the checked run: head row i
reads the token at i + 1 and the checked run's final_norm row i (as speculative decoding feeds it),
all but the last `decode_steps` rows in one pass, then one row a step (its draft steps); numpy
runs the head over every row fed the checked head's intermediates (mtp.*), as a layer's.

Expert choices are compared as sets per position: a difference where the checked run's choice is
within twice its router-logit error of the reference's k-th logit is a near tie that rounding may
flip (noted), any other flags router_ids. Both runs' experts then see the checked run's choice.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .backends.base import Backend, Tensor
from .errors import AtlasError
from .layers.step import Step

if TYPE_CHECKING:
    from .config import ModelSpec
    from .engine import Engine
    from .kvcache.options import KVCacheOptions
    from .layers.mtp import MtpHead

R = TypeVar("R")

DEFAULT_TOLERANCE = 0.02  # relative L2 error given the inputs (the kernels' bf16 roundings: ~0.003 emulated)
TIE_MARGIN = 2.0  # a choice within this many router-logit errors of the boundary is a near tie


@dataclass
class Capture:
    """A run's named intermediates: name -> {position: row}, names in the order first seen."""

    rows: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)
    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # the current forward's
    forwards: list[list[int]] = field(default_factory=list)  # each forward's positions, in run order

    def __call__(self, name: str, array: np.ndarray) -> None:
        if name == "positions":
            self.positions = array
            self.forwards.append(array.tolist())
            return
        table = self.rows.setdefault(name, {})
        if array.shape[0] == self.positions.shape[0]:
            table.update(zip(self.positions.tolist(), array))
        elif array.shape[0] == 1:  # the last row only (a prefill's logits)
            table[int(self.positions[-1])] = array[0]
        else:
            raise AtlasError(f"intermediate {name} has {array.shape[0]} rows in a {self.positions.shape[0]}-token forward")

    def stacked(self, name: str, positions: list[int]) -> np.ndarray:
        """The rows of `name` at `positions` [len, ...]."""
        return np.stack([self.rows[name][p] for p in positions])

    def by_forward(self, positions: list[int]) -> list[list[int]]:
        """`positions` split by the forward that ran them (those of no recorded forward: one more
        group), so a decode step's row is judged alone, not averaged into a long prefill's."""
        wanted = set(positions)
        groups = [[p for p in forward if p in wanted] for forward in self.forwards]
        seen = {p for g in groups for p in g}
        groups.append([p for p in positions if p not in seen])
        return [g for g in groups if g]

    def all_rows(self, name: str) -> np.ndarray:
        """Every position 0..T-1 of `name` [T, ...] (a layer input must have all of them)."""
        table = self.rows[name]
        if sorted(table) != list(range(len(table))):
            raise AtlasError(f"intermediate {name} is missing positions; it cannot feed the reference")
        return self.stacked(name, list(range(len(table))))


@dataclass(frozen=True)
class NameReport:
    name: str
    shape: tuple[int, ...]  # rows compared first
    rel_err: float  # ||checked - reference|| / ||reference|| (ids: the fraction of positions that differ)
    max_abs: float
    flagged: bool
    note: str = ""

    def reason(self, tolerance: float) -> str:
        return self.note or f"relative error {self.rel_err:.4g} > {tolerance:g}"


@dataclass(frozen=True)
class CheckedRun:
    """How the checked run feeds the prompt: the last `decode_steps` tokens as decode steps, the
    rest in prefill passes of at most `prefill_chunk` tokens (None: the engine's default)."""

    decode_steps: int = 0
    prefill_chunk: int | None = None
    mtp: bool = True  # check the MTP head too, when the checkpoint has one

    def check(self, tokens: int) -> None:
        if not 0 <= self.decode_steps < tokens:
            raise AtlasError(f"--decode-steps must be in 0..{tokens - 1} for a {tokens}-token prompt, got {self.decode_steps}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise AtlasError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")


def check_backend(model_dir: Path, device: str, spec: ModelSpec, ids: list[int], *, run: CheckedRun = CheckedRun(),
                  tolerance: float = DEFAULT_TOLERANCE, reference_dir: Path | None = None,
                  kv_cache: KVCacheOptions | None = None) -> tuple[list[NameReport], str]:
    """The checked run of `ids` on `device`, released, then the numpy backend on each layer
    (of `reference_dir`'s checkpoint, default the same; both with `kv_cache`'s levels) -> (a
    report per intermediate, the device line)."""
    run.check(len(ids))  # before any weights load
    reference_dir = reference_dir or model_dir
    head = run.mtp and len(ids) > 1 and has_head(model_dir) and has_head(reference_dir)
    checked, device_line = on_engine(model_dir, device, spec, ids, lambda e: checked_runs(e, model_dir, ids, run, head),
                                     kv_cache=kv_cache, load_mtp=head)
    reference, _ = on_engine(reference_dir, "cpu", spec, ids, lambda e: reference_runs(e, reference_dir, ids, checked),
                             kv_cache=kv_cache, load_mtp=head)
    reports = compare_runs(checked.model, reference.model, tolerance)
    if checked.head is not None and reference.head is not None:
        reports += compare_runs(checked.head, reference.head, tolerance)
    return reports, device_line


@dataclass(frozen=True)
class Runs:
    """A run's captures: the model's, and the MTP head's when it was checked."""

    model: Capture
    head: Capture | None = None


def checked_runs(engine: Engine, model_dir: Path, ids: list[int], run: CheckedRun, head: bool) -> Runs:
    checked = checked_run(engine, ids, run)
    return Runs(checked, checked_head_run(engine, mtp_head(engine, model_dir), ids, checked, run) if head else None)


def reference_runs(engine: Engine, model_dir: Path, ids: list[int], checked: Runs) -> Runs:
    reference = reference_run(engine, ids, checked.model)
    if checked.head is None:
        return Runs(reference)
    return Runs(reference, reference_head_run(engine, mtp_head(engine, model_dir), ids, checked.model, checked.head))


def on_engine(model_dir: Path, device: str, spec: ModelSpec, ids: list[int], use: Callable[[Engine], R], *,
              kv_cache: KVCacheOptions | None = None, load_mtp: bool = False) -> tuple[R, str]:
    """use(an engine on `device` sized for ids, its KV cache at `kv_cache`'s levels; the memory
    check counts the MTP head when `use` loads it) and the device line; the engine and its memory
    are released on return, before the next one loads."""
    from .backends import create_backend
    from .backends.run_plan import RunPlan
    from .engine import Engine
    from .kvcache.options import KVCacheOptions
    from .safetensors import Checkpoint

    plan = RunPlan(max_seq_len=max(len(ids), 1), kv_cache=kv_cache or KVCacheOptions(), load_mtp=load_mtp)
    backend, device_line = create_backend(device, model_dir, spec, plan)
    engine = Engine(spec, Checkpoint.open(model_dir), backend, max_seq_len=plan.max_seq_len, kv_cache=plan.kv_cache)
    result = use(engine)
    del engine, backend
    gc.collect()
    return result, device_line


@contextmanager
def capturing(engine: Engine) -> Iterator[Capture]:
    """Attach a Capture as the engine's dump for the duration (an ATLAS_DUMP hook keeps receiving)."""
    capture, previous = Capture(), engine.dump

    def hook(name: str, tensor: Any) -> None:
        if previous is not None:
            previous(name, tensor)
        capture(name, engine.backend.to_numpy(tensor))

    engine.dump = hook
    try:
        yield capture
    finally:
        engine.dump = previous


def checked_run(engine: Engine, ids: list[int], run: CheckedRun) -> Capture:
    """The engine's prefill of ids[:-decode_steps] then one decode step per remaining token."""
    run.check(len(ids))
    split = len(ids) - run.decode_steps
    default_chunk = engine.prefill_chunk
    engine.prefill_chunk = run.prefill_chunk or default_chunk
    try:
        with capturing(engine) as capture:
            engine.prefill(ids[:split])
            for position in range(split, len(ids)):
                engine.decode(ids[position], position)
    finally:
        engine.prefill_chunk = default_chunk
    return capture


def reference_run(engine: Engine, ids: list[int], checked: Capture) -> Capture:
    """Each part of the model on the numpy `engine`, fed the checked run's inputs to it."""
    be, model = engine.backend, engine.model
    engine.reset()
    positions = be.upload(np.arange(len(ids), dtype=np.int32), "i32")
    reference = Capture(positions=np.arange(len(ids), dtype=np.int32))
    step = Step(be, positions, lambda name, tensor: reference(name, be.to_numpy(tensor)))
    step.emit("embed", model.embed(step, be.upload(np.asarray(ids, np.int32), "i32")))
    for i in range(len(model.layers)):
        layer_input = checked.all_rows("embed" if i == 0 else f"layer.{i - 1}.out")
        fed = replace(step, feed=layer_feed(be, checked, i, len(ids)))
        model.run_layer(fed, i, be.upload(layer_input, "f32"), engine.states[i])
    last = checked.all_rows(f"layer.{len(model.layers) - 1}.out")
    step.emit("final_norm", model.final_norm(step, be.upload(last, "f32")))
    rows = sorted(checked.rows.get("logits", {}))  # the checked run's: the prompt's last row, each decode step's
    if rows:
        reference.positions = np.asarray(rows, np.int32)
        model.logits(step, be.upload(checked.stacked("final_norm", rows), "f32"))  # [len(rows), V]
    return reference


def layer_feed(be: Backend, checked: Capture, layer: int, tokens: int) -> dict[str, Tensor]:
    """The checked run's intermediates inside layer `layer` (all but its output). A fused decode
    step writes no .conv / .core, so the reference computes those itself and the fused op is
    checked at its output."""
    return feed(be, checked, f"layer.{layer}.", f"layer.{layer}.out", tokens)


def feed(be: Backend, checked: Capture, prefix: str, output: str, tokens: int) -> dict[str, Tensor]:
    """The checked run's intermediates named `prefix`... but `output` that it has at each of the
    `tokens` positions, on `be`."""
    names = [n for n, table in checked.rows.items() if n.startswith(prefix) and n != output and len(table) == tokens]
    arrays = {name: checked.all_rows(name) for name in names}
    return {name: be.upload(a, "i32" if a.dtype.kind in "iu" else "f32") for name, a in arrays.items()}


# --- the MTP head -----------------------------------------------------------------------------
def has_head(model_dir: Path) -> bool:
    from .models.qwen3_5_moe_mtp import has_mtp_head
    from .safetensors import Checkpoint

    return has_mtp_head(Checkpoint.open(model_dir))


def mtp_head(engine: Engine, model_dir: Path) -> MtpHead:
    from .models.qwen3_5_moe_mtp import load_mtp_head
    from .safetensors import Checkpoint

    return load_mtp_head(engine.spec, Checkpoint.open(model_dir), engine.backend, engine.model)


def head_inputs(be: Backend, ids: list[int], checked: Capture, start: int, stop: int) -> tuple[Tensor, Tensor]:
    """Head rows start..stop-1: the tokens after them [n] and the checked final_norm rows [n, H]."""
    hidden = checked.stacked("final_norm", list(range(start, stop)))
    return be.upload(np.asarray(ids[start + 1 : stop + 1], np.int32), "i32"), be.upload(hidden, "f32")


def checked_head_run(engine: Engine, head: MtpHead, ids: list[int], checked: Capture, run: CheckedRun) -> Capture:
    """The head on the checked backend over rows 0..T-2: all but the last decode_steps rows in one
    pass, then one row a step."""
    be, capture, rows = engine.backend, Capture(), len(ids) - 1
    cache = head.new_state(be, len(ids))
    split = max(rows - run.decode_steps, 1)
    for start, stop in [(0, split), *((p, p + 1) for p in range(split, rows))]:
        positions = np.arange(start, stop, dtype=np.int32)
        capture("positions", positions)
        step = Step(be, be.upload(positions, "i32"), lambda name, tensor: capture(name, be.to_numpy(tensor)))
        head.forward(step, *head_inputs(be, ids, checked, start, stop), cache)
    return capture


def reference_head_run(engine: Engine, head: MtpHead, ids: list[int], checked: Capture, checked_head: Capture) -> Capture:
    """The head on the numpy `engine` over every row in one pass, fed the checked head's intermediates."""
    be, rows = engine.backend, len(ids) - 1
    positions = np.arange(rows, dtype=np.int32)
    reference = Capture(positions=positions)
    step = Step(be, be.upload(positions, "i32"), lambda name, tensor: reference(name, be.to_numpy(tensor)),
                feed(be, checked_head, "mtp.", "mtp.out", rows))
    head.forward(step, *head_inputs(be, ids, checked, 0, rows), head.new_state(be, len(ids)))
    return reference


def compare_runs(checked: Capture, reference: Capture, tolerance: float) -> list[NameReport]:
    """One report per intermediate both runs have, in the checked run's order."""
    reports: list[NameReport] = []
    for name, table in checked.rows.items():
        if name not in reference.rows:
            continue
        if name.endswith(".router_ids"):
            reports.append(router_report(name, checked, reference))
            continue
        positions = [p for p in sorted(table) if p in reference.rows[name]]
        reports.append(float_report(name, checked, reference, checked.by_forward(positions), tolerance))
    return reports


def float_report(name: str, checked: Capture, reference: Capture, forwards: list[list[int]],
                 tolerance: float) -> NameReport:
    """The worst forward's relative error of `name` (each forward's rows together)."""
    errors = [relative_error(checked.stacked(name, f), reference.stacked(name, f)) for f in forwards]
    ours = checked.stacked(name, [p for f in forwards for p in f])
    shape = ours.shape
    if not np.isfinite(ours).all():
        return NameReport(name, shape, float("inf"), float("inf"), True, "non-finite values")
    worst = max(range(len(forwards)), key=lambda i: errors[i][0])
    rel, max_abs = errors[worst][0], max(e[1] for e in errors)
    note = ""
    if rel > tolerance and len(forwards) > 1:
        where = forwards[worst]
        span = f"position {where[0]}" if len(where) == 1 else f"positions {where[0]}..{where[-1]}"
        note = f"relative error {rel:.4g} > {tolerance:g} in the forward of {span}"
    return NameReport(name, shape, rel, max_abs, rel > tolerance, note)


def relative_error(checked: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(||checked - reference|| / ||reference||, max |checked - reference|)."""
    diff = checked.astype(np.float64) - reference.astype(np.float64)
    scale = float(np.linalg.norm(reference.astype(np.float64)))
    error = float(np.linalg.norm(diff))
    rel = error / scale if scale > 0 else (0.0 if error == 0 else float("inf"))
    return rel, float(np.abs(diff).max()) if diff.size else 0.0


def router_report(name: str, checked: Capture, reference: Capture) -> NameReport:
    """router_ids compared as sets per position; near-tie differences are noted, others flagged."""
    logits_name = name.replace("router_ids", "router_logits")
    positions = sorted(checked.rows[name])
    ours, theirs = checked.stacked(name, positions), reference.stacked(name, positions)  # [T, k]
    ref_logits = reference.stacked(logits_name, positions).astype(np.float64)  # [T, E]
    our_logits = checked.stacked(logits_name, positions).astype(np.float64)
    ties, wrong = [], []
    for row, position in enumerate(positions):
        if set(ours[row].tolist()) == set(theirs[row].tolist()):
            continue
        error = float(np.abs(our_logits[row] - ref_logits[row]).max())
        boundary = np.sort(ref_logits[row])[::-1][ours.shape[1] - 1]  # the reference's k-th logit
        near = ref_logits[row][ours[row]].min() >= boundary - TIE_MARGIN * error
        (ties if near else wrong).append(position)
    note = f"{len(ties)} near-tie flip(s)" if ties else ""
    if wrong:
        note = f"expert choice differs beyond a near tie at position(s) {wrong[:5]}"
    differ = (len(ties) + len(wrong)) / max(len(positions), 1)
    return NameReport(name, ours.shape, differ, 0.0, bool(wrong), note)


def first_flagged(reports: list[NameReport]) -> NameReport | None:
    return next((r for r in reports if r.flagged), None)


def format_reports(reports: list[NameReport]) -> list[str]:
    width = max((len(r.name) for r in reports), default=4)
    lines = [f"{'name':{width}s}  {'shape':16s}  {'rel_err':>9s}  {'max_abs':>9s}"]
    for r in reports:
        shape = "[" + ", ".join(map(str, r.shape)) + "]"
        mark = "  <- outside" if r.flagged else ""
        note = f"  {r.note}" if r.note else ""
        lines.append(f"{r.name:{width}s}  {shape:16s}  {r.rel_err:9.6f}  {r.max_abs:9.3e}{mark}{note}")
    return lines
