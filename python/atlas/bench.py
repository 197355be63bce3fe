"""`python -m atlas.bench`: a model's prompt-processing and generation speed on this machine, as
llama.cpp's llama-bench measures it. ppN prefills an N-token prompt of random ids from a fresh
state (tokens/s of the prefill); tgN generates N tokens greedily after a one-token prompt, the
model's end-of-sequence tokens ignored (tokens/s of the decode after the first token, MTP drafts
included when the checkpoint speculates). Each test runs -r times after an untimed warm-up run
(the GPU's first run also captures its CUDA graphs); the table gives the mean and the standard
deviation of the runs' rates, on stdout, as markdown, JSON, JSONL or CSV."""

from __future__ import annotations

import csv
import io
import json
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import click

from .cli import run_command
from .engine_flags import EngineFlags, engine_options
from .errors import AtlasError

if TYPE_CHECKING:
    import numpy as np

    from .llm import LLM

FORMATS = ("md", "json", "jsonl", "csv")
COLUMNS = ("model", "size", "quant", "backend", "spec", "test", "t/s")


@dataclass(frozen=True)
class BenchTest:
    prompt_tokens: int
    gen_tokens: int  # 0: a prompt-processing test

    @property
    def name(self) -> str:
        return f"tg{self.gen_tokens}" if self.gen_tokens else f"pp{self.prompt_tokens}"


@dataclass(frozen=True)
class ModelFacts:
    model: str  # the --model argument, or atlas-demo
    size_bytes: int  # the checkpoint's tensors
    quant: str  # bf16, fp8 or nvfp4
    backend: str  # cpu or cuda
    device: str  # llm.device, in full
    spec: str  # MTP speculation, or why it is off


@dataclass(frozen=True)
class BenchRecord:
    facts: ModelFacts
    test: BenchTest
    samples_ts: list[float]  # tokens/s of each timed run

    @property
    def avg_ts(self) -> float:
        return statistics.fmean(self.samples_ts)

    @property
    def stddev_ts(self) -> float:
        return statistics.stdev(self.samples_ts) if len(self.samples_ts) > 1 else 0.0

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self.facts), "test": self.test.name, "n_prompt": self.test.prompt_tokens,
                "n_gen": self.test.gen_tokens, "samples_ts": self.samples_ts, "avg_ts": self.avg_ts,
                "stddev_ts": self.stddev_ts}

    def row(self) -> list[str]:
        f = self.facts
        size = f"{f.size_bytes / (1 << 30):.2f} GiB" if f.size_bytes >= 1 << 30 else f"{f.size_bytes / (1 << 20):.2f} MiB"
        spec = f.spec.split(":")[0]  # "MTP k=2", or "off" without its reason
        return [f.model, size, f.quant, f.backend, spec, self.test.name, f"{self.avg_ts:.2f} ± {self.stddev_ts:.2f}"]


def tests_of(prompts: tuple[int, ...], gens: tuple[int, ...]) -> list[BenchTest]:
    """The pp tests, then the tg tests (0 in a list: none of that kind, as llama-bench's -p 0)."""
    if any(n < 0 for n in prompts) or any(n < 0 or n == 1 for n in gens):
        raise AtlasError("-p takes token counts >= 0 and -n counts >= 2 (the decode rate is over the tokens after "
                         "the first); 0 runs no test of that kind")
    tests = [BenchTest(n, 0) for n in prompts if n] + [BenchTest(1, n) for n in gens if n]
    if not tests:
        raise AtlasError("no test to run: give -p or -n a count above 0")
    return tests


def run_test(llm: LLM, test: BenchTest, repetitions: int, rng: np.random.Generator) -> list[float]:
    """The test's rate in each of `repetitions` timed runs, after one untimed warm-up run."""
    from .llm import GenerateOptions

    opts = GenerateOptions(max_tokens=max(test.gen_tokens, 1), ignore_eos=True)
    samples = []
    for run in range(repetitions + 1):
        ids = rng.integers(0, llm.parts.spec.vocab_size, test.prompt_tokens).tolist()  # fresh: no prompt-cache hit
        result = llm.generate_with(llm.prepare(ids, opts), opts, None)
        if run:
            samples.append(result.decode_tok_s if test.gen_tokens else result.prefill_tok_s)
    return samples


def model_facts(llm: LLM, model: str | None) -> ModelFacts:
    from .demo import DEMO_NAME
    from .safetensors import Checkpoint
    from .targets import recognise_quant

    checkpoint = Checkpoint.open(llm.model_dir)
    try:
        size = sum(checkpoint.info(name).nbytes for name in checkpoint.names())
    finally:
        checkpoint.close()
    return ModelFacts(model or DEMO_NAME, size, recognise_quant(llm.model_dir), llm.device.split(" ")[0],
                      llm.device, llm.speculation)


def render(records: list[BenchRecord], form: str) -> str:
    if form == "json":
        return json.dumps([r.as_json() for r in records], indent=2) + "\n"
    if form == "jsonl":
        return "".join(json.dumps(r.as_json()) + "\n" for r in records)
    if form == "csv":
        out = io.StringIO()
        rows = [r.as_json() for r in records]
        writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows({**row, "samples_ts": ";".join(f"{s:.4f}" for s in row["samples_ts"])} for row in rows)
        return out.getvalue()
    lines = [f"| {' | '.join(COLUMNS)} |", f"|{'|'.join('---:' if c == 't/s' else '---' for c in COLUMNS)}|"]
    return "\n".join([*lines, *(f"| {' | '.join(r.row())} |" for r in records)]) + "\n"


@dataclass(frozen=True)
class BenchArgs:
    model: str | None
    n_prompt: tuple[int, ...]
    n_gen: tuple[int, ...]
    repetitions: int
    output: str
    seed: int | None
    engine: EngineFlags


def bench(args: BenchArgs) -> None:
    import numpy as np

    args.engine.check()
    tests = tests_of(args.n_prompt, args.n_gen)
    longest = max(max(t.prompt_tokens, t.gen_tokens) for t in tests)  # positions a test needs
    held = args.engine.max_seq_len
    if held is not None and 0 < held < longest:  # said before a checkpoint of many GB loads
        raise AtlasError(f"--max-seq-len {held} holds fewer positions than the longest test needs ({longest}); "
                         "raise it or leave it out")
    engine = args.engine if held is not None else replace(args.engine, max_seq_len=longest)
    llm = engine.load(str(engine.resolve(args.model)))
    facts = model_facts(llm, args.model)
    click.echo(f"atlas.bench: {facts.model} on {facts.device}; speculation {facts.spec}", err=True)
    rng = np.random.default_rng(args.seed)
    records = []
    for test in tests:
        click.echo(f"atlas.bench: {test.name}: {args.repetitions} runs after a warm-up ...", err=True)
        records.append(BenchRecord(facts, test, run_test(llm, test, args.repetitions, rng)))
    click.echo(render(records, args.output), nl=False)
    click.echo(f"atlas.bench: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, atlas {version()}", err=True)


def version() -> str:
    from . import __version__

    return str(__version__)


class CountList(click.ParamType):
    """llama-bench's comma lists: "128,512" (the flag may also be repeated)."""

    name = "N[,N...]"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        try:
            return tuple(int(part) for part in str(value).split(","))
        except ValueError:
            self.fail(f"{value!r} is not a comma list of token counts (e.g. 128,512)", param, ctx)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-m", "--model", default=None, help="Directory, HF repo id in the local cache, or registry name (default: atlas-demo).")
@click.option("-p", "--n-prompt", type=CountList(), multiple=True, help="Prompt lengths to prefill (ppN; default 512).")
@click.option("-n", "--n-gen", type=CountList(), multiple=True, help="Tokens to generate (tgN; default 128).")
@click.option("-r", "--repetitions", type=click.IntRange(1, 1000), default=5, show_default=True, help="Timed runs of each test.")
@click.option("-o", "--output", type=click.Choice(FORMATS), default="md", show_default=True, help="The results' format on stdout.")
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Seed of the random prompt ids (default: fresh).")
@engine_options
def command(**kwargs: Any) -> None:
    """Prompt processing (ppN) and generation (tgN) speed, as llama.cpp's llama-bench measures it."""
    engine = EngineFlags.pop_from(kwargs)
    prompts = tuple(n for group in kwargs.pop("n_prompt") for n in group) or (512,)
    gens = tuple(n for group in kwargs.pop("n_gen") for n in group) or (128,)
    bench(BenchArgs(n_prompt=prompts, n_gen=gens, engine=engine, **kwargs))


def main(argv: list[str] | None = None, usage: str | None = None) -> int:
    return run_command(command, argv, "atlas.bench", usage=usage)


if __name__ == "__main__":
    sys.exit(main())
