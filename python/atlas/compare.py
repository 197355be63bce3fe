"""`python -m atlas.compare`: atlas against the Hugging Face transformers oracle, layer by layer.

Both run the same prompt ids in one forward pass: atlas on the chosen backend first (then
released), then transformers in float32 (--oracle-device; auto: the GPU when atlas ran on cuda and
torch sees one, else the CPU). Per layer it prints the norm ratio ||atlas|| / ||transformers|| and
the cosine similarity of the layer outputs (the residual stream after the layer, all positions),
and the overlap of the top-k router logits and of the chosen experts. The FIRST layer whose norm
ratio or cosine falls outside [0.977, 1.021] is flagged.
Exit 0: all layers pass; 1: a layer is flagged; 2: bad input (one line).

`--reference DIR` runs transformers on another checkpoint (e.g. the original of a converted copy).

`--against cpu` checks a backend against atlas' own numpy backend instead, every named
intermediate, each op given the checked run's inputs (atlas.cross_check): `--device cuda --against
cpu` names the first op whose output is wrong, `--decode-steps N` runs the prompt's last N tokens as
decode steps (the one-token kernels), `--prefill-chunk N` prefills in passes of N tokens,
`--tolerance` is the relative error allowed. No torch needed.
`--kv-cache-dtype` / `--kv-high-precision-layers` set atlas' KV cache levels (both runs).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import click
import numpy as np

from .backends import DEVICES
from .cli import run_command
from .cross_check import DEFAULT_TOLERANCE, CheckedRun, check_backend, first_flagged, format_reports, on_engine
from .engine_flags import KV_CACHE_DTYPE, KV_HIGH_PRECISION_LAYERS
from .errors import AtlasError
from .kvcache.names import DEFAULT_LEVEL
from .kvcache.options import KVCacheOptions
from .oracle_trace import LayerTrace, atlas_trace, oracle_device, transformers_trace
from .run import MODEL_HELP, default_prompt

if TYPE_CHECKING:
    from .config import ModelSpec

BAND = (0.977, 1.021)
FLAGGED_EXIT = 1


@dataclass(frozen=True)
class CompareArgs:
    model: str | None
    reference: str | None
    prompt: str | None
    device: str
    top_k: int
    chat: bool
    oracle_device: str  # auto: atlas' device when torch sees it, else cpu
    layers: int | None  # compare the first N layers only (both models are cut)
    against: str = "transformers"  # or cpu: atlas' numpy backend, intermediate by intermediate
    decode_steps: int = 0  # --against cpu: the prompt's last N tokens as decode steps
    prefill_chunk: int | None = None  # --against cpu: prefill passes of at most N tokens
    tolerance: float = DEFAULT_TOLERANCE  # --against cpu: relative error allowed per intermediate
    kv_cache_dtype: str = DEFAULT_LEVEL  # atlas' KV cache level (both atlas runs under --against cpu)
    kv_high_precision_layers: str = "auto"

    @property
    def kv_cache(self) -> KVCacheOptions:
        return KVCacheOptions(self.kv_cache_dtype, self.kv_high_precision_layers)


@dataclass(frozen=True)
class LayerReport:
    index: int
    kind: str  # linear_attention / full_attention
    norm_ratio: float
    cosine: float
    top_k_overlap: float | None  # mean over positions of |top-k atlas ∩ top-k oracle| / k
    chosen_overlap: float | None  # the same for the experts each router chose

    @property
    def passes(self) -> bool:
        low, high = BAND
        return low <= self.norm_ratio <= high and low <= self.cosine <= high

    def reason(self) -> str:
        low, high = BAND
        if not low <= self.norm_ratio <= high:
            return f"norm ratio {self.norm_ratio:.4f} outside [{low}, {high}]"
        return f"cosine {self.cosine:.4f} below {low}"


def compare_layers(
    ours: LayerTrace, oracle: LayerTrace, kinds: tuple[str, ...], top_k: int
) -> list[LayerReport]:
    reports = []
    for i, kind in enumerate(kinds):
        a = ours.outputs[i].astype(np.float64).reshape(-1)
        b = oracle.outputs[i].astype(np.float64).reshape(-1)
        norm_a, norm_b = float(np.linalg.norm(a)), float(np.linalg.norm(b))
        ratio = norm_a / norm_b if norm_b > 0 else float("inf")
        cosine = float(a @ b / (norm_a * norm_b)) if norm_a > 0 and norm_b > 0 else 0.0
        top = overlap_of_top(ours.router_logits[i], oracle.router_logits[i], top_k)
        chosen = overlap(ours.chosen[i], oracle.chosen[i])
        reports.append(LayerReport(i, kind, ratio, cosine, top, chosen))
    return reports


def overlap_of_top(ours: np.ndarray | None, oracle: np.ndarray | None, k: int) -> float | None:
    """Mean fraction of the k largest router logits [T, E] the two agree on (as sets, per position)."""
    if ours is None or oracle is None:
        return None
    k = min(k, ours.shape[-1])
    return overlap(np.argsort(-ours, axis=-1)[:, :k], np.argsort(-oracle, axis=-1)[:, :k])


def overlap(ours: np.ndarray | None, oracle: np.ndarray | None) -> float | None:
    """Mean over positions of |ours ∩ oracle| / k for expert ids [T, k]."""
    if ours is None or oracle is None:
        return None
    rows = [len(set(a.tolist()) & set(b.tolist())) / len(a) for a, b in zip(ours, oracle)]
    return sum(rows) / len(rows)


def format_report(reports: list[LayerReport], top_k: int) -> list[str]:
    lines = [f"layer  type              norm_ratio    cosine  top{top_k}_overlap  chosen_overlap"]
    for r in reports:
        top = "-" if r.top_k_overlap is None else f"{r.top_k_overlap:.3f}"
        chosen = "-" if r.chosen_overlap is None else f"{r.chosen_overlap:.3f}"
        mark = "" if r.passes else "  <- outside"
        numbers = f"{r.norm_ratio:10.6f}  {r.cosine:8.6f}  {top:>13s}  {chosen:>14s}"
        lines.append(f"{r.index:5d}  {r.kind:16s}  {numbers}{mark}")
    return lines


def first_failure(reports: list[LayerReport]) -> LayerReport | None:
    return next((r for r in reports if not r.passes), None)


def logits_line(ours: LayerTrace, oracle: LayerTrace) -> str:
    a, b = ours.logits.astype(np.float64), oracle.logits.astype(np.float64)
    cosine = float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b)))
    agree = int((a.argmax(-1) == b.argmax(-1)).sum())
    return f"logits: cosine {cosine:.6f}, argmax agrees at {agree}/{a.shape[0]} positions"


def compare(args: CompareArgs) -> int:
    check_options(args)
    if args.against == "transformers":
        oracle_device(args.oracle_device, "")  # torch missing or no GPU for it: say so before any load
    model_dir, reference_dir, spec, ids = prepare(args)
    if args.against == "cpu":
        return cross_check(args, (model_dir, reference_dir), spec, ids)
    ours, atlas_device = on_engine(model_dir, args.device, spec, ids, lambda e: atlas_trace(e, ids, spec.num_hidden_layers),
                                   kv_cache=args.kv_cache)
    torch_device = oracle_device(args.oracle_device, atlas_device)
    oracle = transformers_trace(reference_dir, ids, spec.num_hidden_layers, torch_device)
    click.echo(f"atlas.compare: {len(ids)} prompt tokens; atlas {model_dir} on {atlas_device}")
    click.echo(f"atlas.compare: oracle transformers float32 {reference_dir} on {torch_device}")
    reports = compare_layers(ours, oracle, spec.layer_types, args.top_k)
    failed = first_failure(reports)
    return verdict(
        [*format_report(reports, args.top_k), logits_line(ours, oracle)],
        None if failed is None else f"FIRST FLAGGED LAYER: {failed.index} ({failed.kind}): {failed.reason()}",
        f"PASS: every layer's norm ratio and cosine within [{BAND[0]}, {BAND[1]}]",
    )


def verdict(table: list[str], failure: str | None, passed: str) -> int:
    """Print the table and the verdict line -> the exit code."""
    for line in table:
        click.echo(line)
    click.echo(passed if failure is None else failure)
    return 0 if failure is None else FLAGGED_EXIT


def check_options(args: CompareArgs) -> None:
    if args.against == "transformers" and (args.decode_steps or args.prefill_chunk or args.tolerance != DEFAULT_TOLERANCE):
        raise AtlasError(
            "--decode-steps, --prefill-chunk and --tolerance apply to --against cpu only; drop them or add --against cpu"
        )
    if args.against == "cpu" and args.oracle_device != "auto":
        raise AtlasError("--oracle-device applies to --against transformers only; drop it")
    if not 0 < args.tolerance < 1:
        raise AtlasError(f"--tolerance must be in (0, 1) (a relative error), got {args.tolerance}")
    args.kv_cache.check()


def prepare(args: CompareArgs) -> tuple[Path, Path, ModelSpec, list[int]]:
    """(model dir, reference dir, the spec cut to --layers, the prompt's ids)."""
    from .config import load_spec
    from .llm import encode_prompt
    from .resolve import resolve_model
    from .tokenizer import Tokenizer

    model_dir = resolve_model(args.model)
    reference_dir = model_dir if args.reference is None else resolve_model(args.reference, "--reference")
    full_spec = load_spec(model_dir)
    check_same_shape(full_spec, load_spec(reference_dir), reference_dir)
    prompt = args.prompt if args.prompt is not None else default_prompt(model_dir, args.model)
    ids = encode_prompt(Tokenizer.open(model_dir), prompt, args.chat)
    return model_dir, reference_dir, first_layers(full_spec, args.layers), ids


def cross_check(args: CompareArgs, dirs: tuple[Path, Path], spec: ModelSpec, ids: list[int]) -> int:
    """--against cpu: every intermediate of the checked backend against the numpy backend."""
    model_dir, reference_dir = dirs
    run = CheckedRun(args.decode_steps, args.prefill_chunk)
    reports, device_line = check_backend(model_dir, args.device, spec, ids, run=run, tolerance=args.tolerance,
                                         reference_dir=reference_dir, kv_cache=args.kv_cache)
    split = len(ids) - args.decode_steps
    from .engine import PREFILL_CHUNK

    passes = f"prefill passes of <= {args.prefill_chunk or PREFILL_CHUNK}"
    click.echo(f"atlas.compare: {len(ids)} prompt tokens ({split} in {passes}, {args.decode_steps} decode steps); "
               f"atlas {model_dir} on {device_line}")
    click.echo(f"atlas.compare: reference numpy float32 {reference_dir}, each op fed the checked run's inputs")
    flagged = first_flagged(reports)
    return verdict(
        format_reports(reports),
        None if flagged is None else f"FIRST FLAGGED: {flagged.name}: {flagged.reason(args.tolerance)}",
        f"PASS: every intermediate within relative error {args.tolerance:g}",
    )


def first_layers(spec: ModelSpec, layers: int | None) -> ModelSpec:
    """The spec cut to its first `layers` layers (--layers: a deep model's head fits in memory)."""
    if layers is None:
        return spec
    if not 1 <= layers <= spec.num_hidden_layers:
        raise AtlasError(f"--layers must be 1..{spec.num_hidden_layers} for this model, got {layers}")
    return replace(spec, num_hidden_layers=layers, layer_types=spec.layer_types[:layers])


def check_same_shape(spec: ModelSpec, reference: ModelSpec, reference_dir: Path) -> None:
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "num_experts", "layer_types"):
        ours, theirs = getattr(spec, key), getattr(reference, key)
        if ours != theirs:
            raise AtlasError(
                f"--reference {reference_dir} has {key} {theirs}, the model {ours}; "
                "compare a checkpoint against the same architecture"
            )


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--reference", default=None, help="Checkpoint transformers runs (default: --model).")
@click.option("--prompt", default=None, help="Prompt text (default for the demo: its first words).")
@click.option(
    "--device", type=click.Choice(DEVICES), default="auto", show_default=True, help="atlas' backend."
)
@click.option("--top-k", type=click.IntRange(min=1), default=10, show_default=True, help="Router logits compared per position.")
@click.option(
    "--oracle-device", type=click.Choice(("auto", "cpu", "cuda")), default="auto", show_default=True,
    help="Where transformers runs; auto: atlas' device when torch sees it, else cpu.",
)
@click.option("--layers", type=int, default=None, help="Compare only the first N layers (default: all).")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option(
    "--against", type=click.Choice(("transformers", "cpu")), default="transformers", show_default=True,
    help="The reference: transformers float32 layer by layer, or atlas' numpy backend intermediate by intermediate.",
)
@click.option("--decode-steps", type=click.IntRange(min=0), default=0, show_default=True,
              help="--against cpu: run the prompt's last N tokens as decode steps.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=None,
              help="--against cpu: prefill in passes of at most N tokens (default: one pass).")
@click.option("--tolerance", type=float, default=DEFAULT_TOLERANCE, show_default=True,
              help="--against cpu: relative error allowed per intermediate.")
@KV_CACHE_DTYPE
@KV_HIGH_PRECISION_LAYERS
def command(**kwargs: object) -> int:
    """Compare atlas with transformers (float32) layer by layer on one prompt, or (--against cpu) a
    backend with the numpy backend, intermediate by intermediate."""
    return compare(CompareArgs(**kwargs))  # type: ignore[arg-type]


def main(argv: list[str] | None = None, usage: str | None = None) -> int:
    """Entry point; returns the exit code."""
    return run_command(command, argv, "atlas.compare", usage=usage)


if __name__ == "__main__":
    sys.exit(main())
