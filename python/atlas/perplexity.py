"""`python -m atlas.perplexity`: a model's perplexity on a text, as llama.cpp's llama-perplexity
measures it, and the KL divergence of one run from another (a quantized format, a KV cache level
or another device against a bf16 run), as its --kl-divergence does.

The text's tokens are cut into chunks of --ctx tokens, each run from a fresh state (BOS first when
the tokenizer has one); the second half of each chunk is scored (tokens ctx/2+1 .. ctx-1, as
llama.cpp's), so every scored token sees at least ctx / 2 before it, and only those rows' logits
are made. PPL = exp(mean NLL), with the standard error of the mean NLL carried through exp.
--save-logprobs FILE keeps the text's tokens, the chunking, the tokenizer's fingerprint and each
scored position's NLL and --top most likely ids with their log-probabilities (npz).
--kl-divergence FILE runs the saved text and chunking again and compares, position by position:
the KL divergence of this run's distribution from the saved one's over the saved top ids (this
run's log-probabilities at those ids read exactly) plus one bucket for the rest, which is at most
the full divergence (merging outcomes never raises it); top-1 agreement; both perplexities.

Bad input (a missing or non-UTF-8 file, a text shorter than --ctx, a saved file that is not one,
or from another tokenizer) is one line, exit 2, before the weights load; files are written whole
or not at all."""

from __future__ import annotations

import hashlib
import math
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np

from .backends import DEVICES
from .cli import run_command
from .dump import atomic_path, check_writable, write_json
from .engine_flags import KV_CACHE_DTYPE, KV_HIGH_PRECISION_LAYERS
from .errors import AtlasError
from .run import MODEL_HELP

DEFAULT_CTX = 512  # llama.cpp's default chunk
DEFAULT_TOP = 32  # ids saved per scored position
MAX_TOP = 256
MIN_CTX = 8
SAVED = {"tokens": (1, "iu"), "ctx": (0, "iu"), "vocab": (0, "iu"), "tokenizer": (0, "U"), "nll": (1, "f"),
         "top_ids": (2, "iu"), "top_logprobs": (2, "f")}  # key -> (dimensions, dtype kinds)


@dataclass(frozen=True)
class Scored:
    """A run's scored positions: NLL [S], the most likely ids and their log-probabilities [S, K],
    and (comparing) this run's log-probabilities at the saved run's ids [S, K']."""

    nll: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    at_saved: np.ndarray | None = None


def chunks(tokens: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """Whole chunks of ctx tokens (a shorter tail is left out, as llama.cpp leaves it)."""
    out = [list(tokens[i : i + ctx]) for i in range(0, len(tokens) - ctx + 1, ctx)]
    if bos is not None:
        for chunk in out:
            chunk[0] = bos
    return out


def scored_per_chunk(ctx: int) -> int:
    return ctx - ctx // 2 - 1  # rows ctx/2 .. ctx-2 score tokens ctx/2+1 .. ctx-1


def perplexity(nll: np.ndarray) -> tuple[float, float]:
    """(exp(mean NLL), its standard error through exp)."""
    mean = float(np.mean(nll))
    spread = float(np.std(nll, ddof=1) / math.sqrt(nll.size)) if nll.size > 1 else 0.0
    return math.exp(mean), math.exp(mean) * spread


def score_chunks(engine: Any, parts: list[list[int]], top: int, saved_ids: np.ndarray | None) -> Scored:
    """Each chunk's second half through Engine.prefill_logits: NLL and the top ids per position,
    and with saved_ids [S, K'] this run's log-probabilities at them. llama.cpp's running PPL per
    chunk goes to stderr."""
    per = scored_per_chunk(len(parts[0]))
    total = per * len(parts)
    nll, ids = np.zeros(total), np.zeros((total, top), np.int32)
    logprobs = np.zeros((total, top), np.float32)
    at_saved = None if saved_ids is None else np.zeros(saved_ids.shape, np.float32)
    for i, chunk in enumerate(parts):
        for a, b, logits in engine.prefill_logits(chunk, len(chunk) // 2):
            rows = slice(i * per + a - len(chunk) // 2, i * per + b - len(chunk) // 2)
            for r, score in zip(range(rows.start, rows.stop), engine.score_rows(logits, chunk[a + 1 : b + 1], top)):
                nll[r] = -score.logprob
                ids[r], logprobs[r] = zip(*score.top)
            if at_saved is not None:
                at_saved[rows] = logprobs_at(engine.backend, logits, saved_ids[rows])
        click.echo(f"[{i + 1}]{perplexity(nll[: (i + 1) * per])[0]:.4f},", err=True, nl=i + 1 == len(parts))
    return Scored(nll, ids, logprobs, at_saved)


def logprobs_at(backend: Any, logits: Any, ids: np.ndarray) -> np.ndarray:
    """log-softmax of logits [n, V] at ids [n, K], a column at a time (Backend.logprob_rows)."""
    out = np.empty(ids.shape, np.float32)
    for j in range(ids.shape[1]):
        summary = backend.logprob_rows(logits, backend.upload(np.ascontiguousarray(ids[:, j], np.int32), "i32"), 0)
        lse = backend.to_numpy(summary.lse).astype(np.float64)  # [n, 2]
        out[:, j] = backend.to_numpy(summary.picked) - (lse[:, 0] + lse[:, 1])
    return out


def divergence(saved_logprobs: np.ndarray, at_saved: np.ndarray) -> np.ndarray:
    """KL(saved || this run) [S] over the saved top ids [S, K] and one bucket for the rest: p the
    saved run's probabilities at its ids, q this run's at the same ids."""
    p = np.exp(saved_logprobs.astype(np.float64))  # [S, K]
    q = np.exp(at_saved.astype(np.float64))  # [S, K]
    p_rest = np.clip(1.0 - p.sum(1), 0.0, None)  # [S]
    q_rest = np.clip(1.0 - q.sum(1), 1e-300, None)  # [S]
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * (np.log(p) - np.log(np.clip(q, 1e-300, None))), 0.0).sum(1)  # [S]
        rest = np.where(p_rest > 0, p_rest * (np.log(p_rest) - np.log(q_rest)), 0.0)  # [S]
    return np.clip(terms + rest, 0.0, None)


def tokenizer_fingerprint(model_dir: Path) -> str:
    return hashlib.sha256((model_dir / "tokenizer.json").read_bytes()).hexdigest()


def read_saved(path: Path) -> dict[str, np.ndarray]:
    """A --save-logprobs file, every array checked (kind, dimensions, agreeing lengths, finite)."""
    try:
        with np.load(path, allow_pickle=False) as saved:
            arrays = {key: saved[key] for key in SAVED if key in saved.files}
    except (OSError, ValueError, EOFError, TypeError, AttributeError, zipfile.BadZipFile, zlib.error) as err:  # TypeError / AttributeError: an .npy
        raise AtlasError(f"{path} cannot be read as saved log-probabilities ({err}); give a file --save-logprobs wrote") from None
    missing = [key for key in SAVED if key not in arrays]
    if missing:
        raise AtlasError(f"{path} lacks {', '.join(missing)}: give a file --save-logprobs wrote")
    bad = [key for key, (ndim, kinds) in SAVED.items() if arrays[key].ndim != ndim or arrays[key].dtype.kind not in kinds]
    top_ids, top_logprobs, nll = arrays["top_ids"], arrays["top_logprobs"], arrays["nll"]
    if bad or top_ids.shape != top_logprobs.shape or top_ids.shape[0] != nll.shape[0] or not 1 <= top_ids.shape[1] <= MAX_TOP:
        raise AtlasError(f"{path}: its arrays ({', '.join(bad) or 'their lengths'}) are not what --save-logprobs writes; save the run again")
    probabilities = np.isfinite(nll).all() and np.isfinite(top_logprobs).all() and (nll >= 0).all() and (top_logprobs <= 0).all()
    if not probabilities or not ((0 <= top_ids) & (top_ids < int(arrays["vocab"]))).all():
        raise AtlasError(f"{path}: log-probabilities that are not finite and <= 0, or ids outside its vocabulary; "
                         "save the run again")
    return arrays


def write_saved(path: Path, tokens: list[int], ctx: int, fingerprint: tuple[int, str], scored: Scored) -> None:
    with atomic_path(path) as scratch, scratch.open("wb") as out:
        np.savez(out, tokens=np.array(tokens, dtype=np.int64), ctx=np.array(ctx), vocab=np.array(fingerprint[0]),
                 tokenizer=np.array(fingerprint[1]), nll=scored.nll, top_ids=scored.top_ids, top_logprobs=scored.top_logprobs)


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
    top: int | None  # ids saved per position (default DEFAULT_TOP; comparing: the saved run's)
    save_logprobs: str | None
    kl_divergence: str | None  # a saved file to compare with
    json_out: str | None
    device: str
    kv_cache_dtype: str
    kv_high_precision_layers: str


@dataclass(frozen=True)
class Plan:
    tokens: list[int]
    ctx: int
    chunks: int
    top: int


def plan(args: PerplexityArgs, tokens: list[int], saved: dict[str, np.ndarray] | None, capacity: int) -> Plan:
    """What to score: the text's tokens, or the saved run's (its ctx, at most its chunks)."""
    ctx, top = args.ctx, args.top
    if saved is not None:
        if ctx is not None and ctx != int(saved["ctx"]):
            raise AtlasError(f"--ctx {ctx} differs from the saved run's {int(saved['ctx'])}: leave --ctx out to compare")
        if top is not None:
            raise AtlasError("--top is the saved run's when comparing: leave it out")
        tokens, ctx, top = [int(t) for t in saved["tokens"]], int(saved["ctx"]), int(saved["top_ids"].shape[1])
    if len(tokens) < MIN_CTX:
        raise AtlasError(f"the text has {len(tokens)} tokens; give one of at least {MIN_CTX}")
    ctx = min(DEFAULT_CTX, len(tokens)) if ctx is None else ctx
    top = DEFAULT_TOP if top is None else top
    if not MIN_CTX <= ctx <= capacity:
        raise AtlasError(f"--ctx must be in {MIN_CTX}..{capacity} (this model's context), got {ctx}")
    if not 1 <= top <= MAX_TOP:
        raise AtlasError(f"--top must be in 1..{MAX_TOP}, got {top}")
    if len(tokens) < ctx:
        raise AtlasError(f"the text has {len(tokens)} tokens, fewer than --ctx {ctx}: give a longer text or a smaller --ctx")
    count = len(tokens) // ctx if args.chunks is None else min(args.chunks, len(tokens) // ctx)
    if saved is not None:
        held = saved["nll"].shape[0] // scored_per_chunk(ctx)
        if saved["nll"].shape[0] != held * scored_per_chunk(ctx) or held < 1:
            raise AtlasError(f"{args.kl_divergence} scored {saved['nll'].shape[0]} positions, not whole chunks of {ctx}; save the run again")
        count = min(count, held)
    return Plan(tokens, ctx, count, top)


def check_outputs(args: PerplexityArgs) -> None:
    if args.kl_divergence is not None and args.file is not None:
        raise AtlasError("--kl-divergence scores the saved run's text: leave --file out")
    for flag, out in (("--save-logprobs", args.save_logprobs), ("--json", args.json_out)):
        if out is not None:
            check_writable(Path(out), flag)


def run(args: PerplexityArgs) -> dict[str, Any]:
    from .config import load_spec
    from .llm import LLM
    from .resolve import resolve_model
    from .tokenizer import Tokenizer

    check_outputs(args)
    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer.open(model_dir)
    fingerprint = (tokenizer.vocab_size, tokenizer_fingerprint(model_dir))
    saved = read_saved(Path(args.kl_divergence)) if args.kl_divergence is not None else None
    if saved is not None and (int(saved["vocab"]), str(saved["tokenizer"])) != fingerprint:
        raise AtlasError(f"{args.kl_divergence} was saved with another tokenizer: compare runs of one model's tokenizer")
    text = read_text(args.file, model_dir) if saved is None else ""
    what = plan(args, tokenizer.encode(text, add_special_tokens=False), saved, load_spec(model_dir).context_length)
    llm = LLM(str(model_dir), args.device, args.kv_cache_dtype, args.kv_high_precision_layers, spec_k=0,
              max_seq_len=what.ctx, prompt_cache=0)
    parts = chunks(what.tokens, what.ctx, tokenizer.bos_token_id)[: what.chunks]
    scored_count = len(parts) * scored_per_chunk(what.ctx)
    click.echo(f"atlas.perplexity: {llm.model_dir} on {llm.device}; {len(parts)} chunks of {what.ctx} tokens, "
               f"{scored_count} scored", err=True)
    saved_ids = None if saved is None else saved["top_ids"][:scored_count]
    scored = score_chunks(llm.parts.engine, parts, what.top, saved_ids)
    ppl, err = perplexity(scored.nll)
    report: dict[str, Any] = {"model": str(llm.model_dir), "device": llm.device, "kv_cache": args.kv_cache_dtype,
                              "ctx": what.ctx, "chunks": len(parts), "tokens_scored": scored_count, "ppl": ppl, "ppl_stderr": err}
    if saved is not None:
        report.update(compare(saved, scored))
    if args.save_logprobs is not None:
        write_saved(Path(args.save_logprobs), what.tokens, what.ctx, fingerprint, scored)
    return report


def compare(saved: dict[str, np.ndarray], run: Scored) -> dict[str, Any]:
    """The comparison with the saved run over the positions both scored."""
    assert run.at_saved is not None
    n = run.nll.size
    kld = divergence(saved["top_logprobs"][:n], run.at_saved)
    base_nll, base_top1 = saved["nll"][:n], saved["top_ids"][:n, 0]
    return {"base_ppl": perplexity(base_nll)[0], "ppl_ratio": math.exp(float(np.mean(run.nll - base_nll))),
            "kld_mean": float(kld.mean()), "kld_stderr": float(kld.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
            "kld_p99": float(np.percentile(kld, 99)), "kld_max": float(kld.max()), "kld_top": int(run.at_saved.shape[1]),
            "top1_agreement": float(np.mean(base_top1 == run.top_ids[:, 0]))}


def report_lines(report: dict[str, Any]) -> list[str]:
    lines = [f"PPL = {report['ppl']:.4f} +/- {report['ppl_stderr']:.4g} "
             f"({report['tokens_scored']} tokens in {report['chunks']} chunks of {report['ctx']})"]
    if "kld_mean" in report:
        lines += [f"saved run's PPL = {report['base_ppl']:.4f}, ratio {report['ppl_ratio']:.5f}",
                  f"KL divergence (its top {report['kld_top']} + rest) = {report['kld_mean']:.6g} +/- "
                  f"{report['kld_stderr']:.4g}, 99th percentile {report['kld_p99']:.6g}, max {report['kld_max']:.6g}",
                  f"top-1 agreement = {100 * report['top1_agreement']:.2f} %"]
    return lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--file", "-f", default=None, help="A UTF-8 text to score ('-': stdin); default: the demo's own text.")
@click.option("--ctx", "-c", type=click.IntRange(min=1), default=None,
              help=f"Tokens per chunk (default {DEFAULT_CTX}, or the text's length when shorter); the second half is scored.")
@click.option("--chunks", type=click.IntRange(min=1), default=None, help="Score at most this many chunks.")
@click.option("--top", type=click.IntRange(min=1), default=None,
              help=f"Most likely ids kept per scored position by --save-logprobs (default {DEFAULT_TOP}; at most {MAX_TOP}).")
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
        write_json(Path(kwargs["json_out"]), report)


def main(argv: list[str] | None = None, usage: str | None = None) -> int:
    return run_command(command, argv, "atlas.perplexity", usage=usage)


if __name__ == "__main__":
    sys.exit(main())
