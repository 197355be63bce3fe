"""`python -m atlas.verify`: check the installed kernels on this GPU against the numpy reference
backend, intermediate by intermediate (atlas.cross_check), before trusting them with a model.

On the embedded demo model: bf16 in one prefill pass and in passes of 7 tokens, each KV cache
level, and the fp8 and nvfp4 formats (the demo quantized by atlas.quantize into a temporary
directory); each check prefills a fresh random prompt and runs 3 decode steps. `--model M` adds the
same check on a checkpoint of your own (its first `--layers` layers: the numpy reference holds them
in host memory). A check whose tuple the wheel lacks is skipped with the reason: a per-target wheel
without the demo's kernels verifies with `--model` alone.

Exit 0: nothing flagged; 1: a check flagged an intermediate or failed; 2: no CUDA backend here,
or bad input (one line).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import click
import numpy as np

from .cli import run_command
from .cross_check import DEFAULT_TOLERANCE, CheckedRun, NameReport, check_backend, first_flagged
from .errors import AtlasError
from .kvcache.names import DEFAULT_LEVEL, LEVEL_NAMES
from .kvcache.options import KVCacheOptions
from .run import MODEL_HELP

DECODE_STEPS = 3
PASS_TOKENS = 7  # the passes check: later passes read the cache and states earlier ones left
PROMPT_TOKENS = (20, 48)  # a check's random prompt length: at least twice PASS_TOKENS, past the GEMV bound


@dataclass(frozen=True)
class Check:
    name: str
    model_dir: Callable[[], Path]  # made on demand (a quantized demo is written only when its check runs)
    run: CheckedRun = CheckedRun(DECODE_STEPS)
    kv_cache: KVCacheOptions | None = None
    layers: int | None = None  # the first N layers only


@dataclass(frozen=True)
class Outcome:
    name: str
    status: str  # PASS, FLAGGED, FAILED, SKIPPED
    detail: str = ""

    @property
    def bad(self) -> bool:
        return self.status in ("FLAGGED", "FAILED")


@dataclass
class Verifier:
    rng: np.random.Generator
    tolerance: float = DEFAULT_TOLERANCE
    outcomes: list[Outcome] = field(default_factory=list)

    def check(self, check: Check) -> Outcome:
        """One check: skipped when its tuple cannot run here, else the cross-check's verdict (an
        exception on the way is the check's failure, and the next check still runs)."""
        from .backends import create_backend
        from .compare import first_layers
        from .config import load_spec

        try:
            model_dir = check.model_dir()
            spec = first_layers(load_spec(model_dir), check.layers)
            create_backend("cuda", model_dir, spec)
        except AtlasError as err:
            return self.record(Outcome(check.name, "SKIPPED", str(err)))
        except Exception as err:  # noqa: BLE001 - a driver fault fails this check, not the whole run
            return self.record(failed(check.name, err))
        ids = self.rng.integers(0, spec.vocab_size, size=int(self.rng.integers(*PROMPT_TOKENS))).tolist()
        try:
            reports, _ = check_backend(model_dir, "cuda", spec, ids, run=check.run, tolerance=self.tolerance,
                                       kv_cache=check.kv_cache)
        except Exception as err:  # noqa: BLE001 - a kernel fault fails this check, not the whole run
            return self.record(failed(check.name, err))
        return self.record(verdict(check.name, reports, self.tolerance))

    def record(self, outcome: Outcome) -> Outcome:
        self.outcomes.append(outcome)
        return outcome


def failed(name: str, err: Exception) -> Outcome:
    return Outcome(name, "FAILED", f"{type(err).__name__}: {' '.join(str(err).split())}")


def verdict(name: str, reports: list[NameReport], tolerance: float) -> Outcome:
    flagged = first_flagged(reports)
    if flagged is not None:
        return Outcome(name, "FLAGGED", f"{flagged.name}: {flagged.reason(tolerance)}")
    floats = [r for r in reports if not r.name.endswith(".router_ids")]
    worst = max(floats, key=lambda r: r.rel_err)
    return Outcome(name, "PASS", f"worst relative error {worst.rel_err:.2e} ({worst.name})")


def demo_checks(workdir: Path) -> Iterator[Check]:
    from .demo import DEMO_DIR
    from .quantize import QuantizeArgs, quantize

    def demo() -> Path:
        return DEMO_DIR

    yield Check("demo bf16, one prefill pass", demo)
    yield Check(f"demo bf16, prefill passes of {PASS_TOKENS}", demo, CheckedRun(DECODE_STEPS, PASS_TOKENS))
    for level in (name for name in LEVEL_NAMES if name != DEFAULT_LEVEL):
        yield Check(f"demo, KV cache {level}", demo, kv_cache=KVCacheOptions(level, 0))
    for fmt in ("fp8", "nvfp4"):
        yield Check(f"demo {fmt}", lambda fmt=fmt: quantize(QuantizeArgs(str(DEMO_DIR), fmt, workdir / fmt, 1 << 30)))


def verify(model: str | None, layers: int | None, seed: int | None, tolerance: float) -> int:
    from .backends import create_backend
    from .compare import first_layers
    from .config import load_spec
    from .demo import DEMO_DIR
    from .resolve import resolve_model

    if not 0 < tolerance < 1:
        raise AtlasError(f"--tolerance must be in (0, 1) (a relative error), got {tolerance}")
    if layers is not None and model is None:
        raise AtlasError("--layers cuts the checkpoint --model names; add --model or drop --layers")
    own = None if model is None else resolve_model(model)
    if own is not None:
        first_layers(load_spec(own), layers)  # a bad --layers is one line before anything runs
    try:  # no CUDA backend for what was asked (no GPU, no binding, no tuple): one line, exit 2
        _, device_line = create_backend("cuda", own or DEMO_DIR, load_spec(own or DEMO_DIR))
    except AtlasError as err:
        hint = "" if own else " (atlas.verify checks the embedded demo; --model M checks a checkpoint the wheel has kernels for)"
        raise AtlasError(f"{err}{hint}") from None
    seed = int(np.random.default_rng().integers(1 << 31)) if seed is None else seed
    click.echo(f"atlas.verify: {device_line}; seed {seed} (--seed {seed} draws the same prompts)")
    verifier = Verifier(np.random.default_rng(seed), tolerance)
    with tempfile.TemporaryDirectory(prefix="atlas-verify-") as workdir:
        checks = list(demo_checks(Path(workdir)))
        if own is not None:
            checks.append(Check(f"{model}{'' if layers is None else f', first {layers} layers'}", lambda: own, layers=layers))
        for check in checks:
            outcome = verifier.check(check)
            click.echo(f"{outcome.status:8s} {outcome.name}: {outcome.detail}")
    bad = [o for o in verifier.outcomes if o.bad]
    skipped = sum(o.status == "SKIPPED" for o in verifier.outcomes)
    if skipped == len(verifier.outcomes):
        raise AtlasError("every check was skipped: nothing was verified (the reasons are above)")
    if bad:
        click.echo(f"FAILED: {len(bad)} of {len(verifier.outcomes)} checks ({skipped} skipped); first: {bad[0].name}")
        return 1
    click.echo(f"PASS: {len(verifier.outcomes) - skipped} checks within relative error {tolerance:g} ({skipped} skipped)")
    return 0


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default=None, help=f"Also check this checkpoint. {MODEL_HELP}")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="--model: check only its first N layers (the numpy reference holds them in host memory).")
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Seed of the random prompts (default: fresh).")
@click.option("--tolerance", type=float, default=DEFAULT_TOLERANCE, show_default=True,
              help="Relative error allowed per intermediate.")
def command(model: str | None, layers: int | None, seed: int | None, tolerance: float) -> int:
    """Check this GPU's kernels against the numpy reference, op by op."""
    return verify(model, layers, seed, tolerance)


def main(argv: list[str] | None = None, usage: str | None = None) -> int:
    """Entry point; returns the exit code."""
    return run_command(command, argv, "atlas.verify", usage=usage)


if __name__ == "__main__":
    sys.exit(main())
