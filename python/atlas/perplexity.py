"""`python -m atlas.perplexity`: a model's perplexity on a text, as llama.cpp's llama-perplexity
measures it, and the KL divergence of one run from another (a quantized format, a KV cache level
or another device against a bf16 run), as its --kl-divergence does.

The text's tokens are cut into chunks of --ctx tokens, each run from a fresh state (BOS first when
the tokenizer adds one); the second half of each chunk is scored, so every scored token sees at
least ctx / 2 tokens before it. PPL = exp(mean NLL), with the standard error of the mean NLL
carried through exp. --save-logprobs FILE keeps the text's tokens, the chunking and each scored
position's NLL and TOP most likely ids and log-probabilities (npz). --kl-divergence FILE runs the
saved text and chunking again and compares: the KL divergence of this run's distribution from the
saved one's over the saved top ids plus one bucket for the rest (the full divergence is at least
this: merging outcomes never raises it), top-1 agreement, and both perplexities. A saved id
missing from this run's 4 x TOP most likely takes an even share of this run's remaining mass (an
estimate; the count of such ids is reported).

Bad input (a missing or non-UTF-8 file, a text shorter than --ctx, a saved file from another
text) is one line, exit 2; the files are written whole or not at all."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np

from .backends import DEVICES
from .cli import run_command
from .dump import atomic_path
from .engine_flags import KV_CACHE_DTYPE, KV_HIGH_PRECISION_LAYERS
from .errors import AtlasError
from .run import MODEL_HELP

DEFAULT_CTX = 512  # llama.cpp's default chunk
DEFAULT_TOP = 32  # ids saved per scored position
COMPARE_WIDTH = 4  # a comparing run lists this many times the saved top
MIN_CTX = 8
SAVED_KEYS = ("tokens", "ctx", "nll", "top_ids", "top_logprobs")


@dataclass(frozen=True)
class Scored:
    """The scored positions of a run: NLL [S] and the top ids / log-probabilities [S, K]."""

    nll: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def chunks(tokens: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """Whole chunks of ctx tokens (a shorter tail is left out, as llama.cpp leaves it)."""
    out = [list(tokens[i : i + ctx]) for i in range(0, len(tokens) - ctx + 1, ctx)]
    if bos is not None:
        for chunk in out:
            chunk[0] = bos
    return out


def scored_range(ctx: int) -> slice:
    """The prompt tokens scored in a chunk: those after its first half."""
    return slice(ctx // 2 + 1, ctx)


def perplexity(nll: np.ndarray) -> tuple[float, float]:
    """(exp(mean NLL), its standard error through exp)."""
    mean = float(np.mean(nll))
    spread = float(np.std(nll, ddof=1) / math.sqrt(nll.size)) if nll.size > 1 else 0.0
    return math.exp(mean), math.exp(mean) * spread


def score_chunks(engine: Any, parts: list[list[int]], top: int, progress: bool = True) -> Scored:
    """Each chunk through Engine.prefill_scored; llama.cpp's running PPL per chunk on stderr."""
    nll: list[float] = []
    ids: list[list[int]] = []
    logprobs: list[list[float]] = []
    for i, chunk in enumerate(parts, start=1):
        _, scores = engine.prefill_scored(chunk, top)
        for score in scores[scored_range(len(chunk))]:
            nll.append(-score.logprob)
            ids.append([a for a, _ in score.top])
            logprobs.append([b for _, b in score.top])
        if progress:
            click.echo(f"[{i}]{perplexity(np.array(nll))[0]:.4f},", err=True, nl=i == len(parts))
    return Scored(np.array(nll), np.array(ids, dtype=np.int32).reshape(len(nll), top),
                  np.array(logprobs, dtype=np.float32).reshape(len(nll), top))


def divergence(base: Scored, run: Scored, vocab: int) -> tuple[np.ndarray, int]:
    """Per position KL(base || run) over base's top ids + one bucket for the rest, and how many
    base ids were missing from run's list (each given an even share of run's remaining mass)."""
    p = np.exp(base.top_logprobs.astype(np.float64))  # [S, K]
    p_rest = np.clip(1.0 - p.sum(1), 0.0, None)  # [S]
    listed = np.exp(run.top_logprobs.astype(np.float64))  # [S, K']
    run_rest = np.clip(1.0 - listed.sum(1), 1e-300, None) / max(vocab - listed.shape[1], 1)  # [S] per unlisted id
    match = base.top_ids[:, :, None] == run.top_ids[:, None, :]  # [S, K, K']
    found = match.any(2)  # [S, K]
    q = np.where(found, (match * listed[:, None, :]).sum(2), run_rest[:, None])  # [S, K]
    q_rest = np.clip(1.0 - q.sum(1), 1e-300, None)  # [S]
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * (np.log(p) - np.log(np.clip(q, 1e-300, None))), 0.0).sum(1)
        tail = np.where(p_rest > 0, p_rest * (np.log(p_rest) - np.log(q_rest)), 0.0)
    return np.clip(terms + tail, 0.0, None), int((~found).sum())


def read_saved(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as saved:
            missing = [key for key in SAVED_KEYS if key not in saved.files]
            arrays = {key: saved[key] for key in SAVED_KEYS if key in saved.files}
    except (OSError, ValueError, EOFError) as err:
        raise AtlasError(f"{path} cannot be read as saved log-probabilities ({err}); give a file --save-logprobs wrote") from None
    if missing:
        raise AtlasError(f"{path} lacks {', '.join(missing)}: give a file --save-logprobs wrote")
    scored = arrays["nll"].shape[:1]
    shapes_ok = (arrays["tokens"].ndim == 1 and arrays["ctx"].ndim == 0 and arrays["nll"].ndim == 1
                 and arrays["top_ids"].ndim == 2 and arrays["top_ids"].shape == arrays["top_logprobs"].shape
                 and arrays["top_ids"].shape[:1] == scored and arrays["top_ids"].shape[1] >= 1)
    kinds_ok = all(arrays[key].dtype.kind in "iu" for key in ("tokens", "ctx", "top_ids"))
    if not (shapes_ok and kinds_ok):
        raise AtlasError(f"{path}: its arrays do not have the shapes --save-logprobs writes; save the run again")
    return arrays


def write_saved(path: Path, tokens: list[int], ctx: int, scored: Scored) -> None:
    with atomic_path(path) as scratch, scratch.open("wb") as out:
        np.savez(out, tokens=np.array(tokens, dtype=np.int64), ctx=np.array(ctx), nll=scored.nll,
                 top_ids=scored.top_ids, top_logprobs=scored.top_logprobs)


def read_text(file: str | None, model_dir: Path) -> str:
    """--file's text ('-': stdin); without one, the demo's own text (other models need --file)."""
    from .demo import DEMO_DIR, zen_of_python

    if file is None:
        if model_dir.resolve() != DEMO_DIR.resolve():
            raise AtlasError("--file is required (a UTF-8 text to score) with a model other than the demo")
        return zen_of_python()
    try:
        return sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise AtlasError(f"--file {file} cannot be read as UTF-8 text ({err})") from None


@dataclass(frozen=True)
class PerplexityArgs:
    model: str | None
    file: str | None  # the text ('-': stdin); default: the demo's text
    ctx: int | None  # tokens per chunk (default DEFAULT_CTX, or the text's length when shorter)
    chunks: int | None  # score at most this many chunks
    top: int  # ids saved per position
    save_logprobs: str | None
    kl_divergence: str | None  # a saved file to compare with
    json_out: str | None
    device: str
    kv_cache_dtype: str
    kv_high_precision_layers: str

    @staticmethod
    def top_limit() -> int:
        return 1024 // COMPARE_WIDTH  # a comparing run lists COMPARE_WIDTH x as many (the backends list 1024)


def plan(args: PerplexityArgs, tokens: list[int], saved: dict[str, np.ndarray] | None, capacity: int) -> tuple[list[int], int]:
    """(the tokens, ctx): the text's, or the saved run's under --kl-divergence."""
    ctx = args.ctx
    if saved is not None:
        saved_ctx = int(saved["ctx"])
        if ctx is not None and ctx != saved_ctx:
            raise AtlasError(f"--ctx {ctx} differs from the saved run's {saved_ctx}: leave --ctx out to compare")
        tokens, ctx = [int(t) for t in saved["tokens"]], saved_ctx
    if ctx is None:
        ctx = min(DEFAULT_CTX, len(tokens))
    if not MIN_CTX <= ctx <= capacity:
        raise AtlasError(f"--ctx must be in {MIN_CTX}..{capacity} (this model's context), got {ctx}")
    if len(tokens) < ctx:
        raise AtlasError(f"the text has {len(tokens)} tokens, fewer than --ctx {ctx}: give a longer text or a smaller --ctx")
    return tokens, ctx


def run(args: PerplexityArgs) -> dict[str, Any]:
    from .config import load_spec
    from .llm import LLM
    from .resolve import resolve_model
    from .tokenizer import Tokenizer

    if not 1 <= args.top <= args.top_limit():
        raise AtlasError(f"--top must be in 1..{args.top_limit()}, got {args.top}")
    if args.kl_divergence is not None and args.file is not None:
        raise AtlasError("--kl-divergence scores the saved run's text: leave --file out")
    for flag, out in (("--save-logprobs", args.save_logprobs), ("--json", args.json_out)):
        if out is not None and not Path(out).resolve().parent.is_dir():
            raise AtlasError(f"{flag} {out}: its directory does not exist; create it or write elsewhere")
    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer.open(model_dir)
    base = read_saved(Path(args.kl_divergence)) if args.kl_divergence is not None else None
    if base is not None and not 1 <= base["top_ids"].shape[1] <= args.top_limit():
        raise AtlasError(f"{args.kl_divergence} keeps {base['top_ids'].shape[1]} ids a position; at most {args.top_limit()} compare")
    text = read_text(args.file, model_dir) if base is None else ""
    capacity = load_spec(model_dir).max_position_embeddings
    tokens, ctx = plan(args, tokenizer.encode(text, add_special_tokens=False), base, capacity)  # before the weights load
    bad = [t for t in tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise AtlasError(f"the saved run's token {bad[0]} is outside this model's vocabulary: compare runs of one model")
    llm = LLM(str(model_dir), args.device, args.kv_cache_dtype, args.kv_high_precision_layers, spec_k=0,
              max_seq_len=ctx, prompt_cache=0)
    parts = chunks(tokens, ctx, tokenizer.bos_token_id)[: args.chunks]
    click.echo(f"atlas.perplexity: {llm.model_dir} on {llm.device}; {len(parts)} chunks of {ctx} tokens, "
               f"{len(parts) * (ctx - scored_range(ctx).start)} scored", err=True)
    top = args.top if base is None else COMPARE_WIDTH * int(base["top_ids"].shape[1])
    scored = score_chunks(llm.parts.engine, parts, top)
    ppl, err = perplexity(scored.nll)
    report: dict[str, Any] = {"model": str(llm.model_dir), "device": llm.device, "kv_cache": args.kv_cache_dtype,
                              "ctx": ctx, "chunks": len(parts), "tokens_scored": int(scored.nll.size),
                              "ppl": ppl, "ppl_stderr": err}
    if base is not None:
        report.update(compare(base, scored, tokenizer.vocab_size))
    if args.save_logprobs is not None:
        write_saved(Path(args.save_logprobs), tokens, ctx, scored)
    return report


def compare(saved: dict[str, np.ndarray], run: Scored, vocab: int) -> dict[str, Any]:
    n = run.nll.size
    if saved["nll"].shape[0] < n:
        raise AtlasError(f"the saved run scored {saved['nll'].shape[0]} positions, this one {n}: save it with as many --chunks")
    base = Scored(saved["nll"][:n], saved["top_ids"][:n], saved["top_logprobs"][:n])
    kld, missing = divergence(base, run, vocab)
    base_ppl, _ = perplexity(base.nll)
    return {"base_ppl": base_ppl, "ppl_ratio": math.exp(float(np.mean(run.nll - base.nll))),
            "kld_mean": float(kld.mean()), "kld_stderr": float(kld.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
            "kld_p99": float(np.percentile(kld, 99)), "top1_agreement": float(np.mean(base.top_ids[:, 0] == run.top_ids[:, 0])),
            "kld_top": int(base.top_ids.shape[1]), "kld_ids_estimated": missing}


def report_lines(report: dict[str, Any]) -> list[str]:
    lines = [f"PPL = {report['ppl']:.4f} +/- {report['ppl_stderr']:.4g} "
             f"({report['tokens_scored']} tokens in {report['chunks']} chunks of {report['ctx']})"]
    if "kld_mean" in report:
        lines += [f"base PPL = {report['base_ppl']:.4f}, ratio {report['ppl_ratio']:.5f}",
                  f"KL divergence (top {report['kld_top']} + rest) = {report['kld_mean']:.6g} +/- {report['kld_stderr']:.4g}, "
                  f"99th percentile {report['kld_p99']:.6g}; ids estimated: {report['kld_ids_estimated']}",
                  f"top-1 agreement = {100 * report['top1_agreement']:.2f} %"]
    return lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--file", "-f", default=None, help="A UTF-8 text to score ('-': stdin); default: the demo's own text.")
@click.option("--ctx", "-c", type=click.IntRange(min=1), default=None,
              help=f"Tokens per chunk (default {DEFAULT_CTX}, or the text's length when shorter); the second half is scored.")
@click.option("--chunks", type=click.IntRange(min=1), default=None, help="Score at most this many chunks.")
@click.option("--top", type=click.IntRange(min=1), default=DEFAULT_TOP, show_default=True,
              help="Most likely ids kept per scored position by --save-logprobs.")
@click.option("--save-logprobs", metavar="FILE", default=None, help="Save the tokens and each position's top ids (npz), for --kl-divergence.")
@click.option("--kl-divergence", metavar="FILE", default=None,
              help="Score the text a --save-logprobs FILE holds and compare: KL divergence, top-1 agreement, PPL ratio.")
@click.option("--json", "json_out", metavar="FILE", default=None, help="Also write the numbers as JSON.")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@KV_CACHE_DTYPE
@KV_HIGH_PRECISION_LAYERS
def command(**kwargs: Any) -> None:
    """Perplexity of a model on a text (llama.cpp's method), and KL divergence from a saved run."""
    report = run(PerplexityArgs(**kwargs))
    for line in report_lines(report):
        click.echo(line)
    if kwargs["json_out"] is not None:
        with atomic_path(Path(kwargs["json_out"])) as scratch:
            scratch.write_text(json.dumps(report, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    return run_command(command, argv, "atlas.perplexity")


if __name__ == "__main__":
    sys.exit(main())
