"""The prompt cache on a multi-turn conversation (numpy backend, CPU): time to first token per turn
with the cache and without, on the same random model and the same turns.

    python bench/prompt_cache.py [--turns 6] [--first-tokens 1024] [--out bench/results/prompt-cache-cpu-<date>.json]

Each turn's prompt is the previous one minus its last 3 tokens (a chat template's generation
prompt, which the next turn renders differently), 4 re-rendered tokens, the previous answer and a
new user message of `--user-tokens`; each turn answers `--answer-tokens` greedily. Both engines
must give the same answers (checked: the cache changes no token). One thread, so the numbers
compare the work done rather than thread pools.
"""

from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = "1"  # before numpy loads

import json
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import click
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

from _checkpoints import write_checkpoint  # noqa: E402
from atlas.backends.base import SamplingParams  # noqa: E402
from atlas.backends.numpy_backend import NumpyBackend  # noqa: E402
from atlas.config import load_spec  # noqa: E402
from atlas.dump import write_json  # noqa: E402
from atlas.engine import Engine  # noqa: E402
from atlas.safetensors import Checkpoint  # noqa: E402
from bench_cli import run_click  # noqa: E402
from cpu import BENCH_MODEL, machine, result_path  # noqa: E402
from provenance import git_commit  # noqa: E402


def conversation(rng: np.random.Generator, first: int, user: int) -> tuple[list[int], list[int]]:
    """The first prompt and a pool of user-message tokens."""
    vocab = BENCH_MODEL.vocab_size
    return rng.integers(0, vocab, first).tolist(), rng.integers(0, vocab, user).tolist()


def run_turns(engine: Engine, first: list[int], user: list[int], turns: int, answer_tokens: int) -> list[dict[str, object]]:
    """Per turn: prompt tokens, cached tokens, seconds to the first token, the answer."""
    prompt, rows = first, []
    for _ in range(turns):
        stats = engine.generate(prompt, answer_tokens, SamplingParams(), None, set())
        rows.append({"prompt_tokens": len(prompt), "cached_tokens": stats.cached_tokens,
                     "first_token_s": round(stats.prefill_seconds, 4), "answer": stats.token_ids})
        prompt = prompt[:-3] + user[:4] + stats.token_ids + user
    return rows


@click.command()
@click.option("--turns", type=click.IntRange(min=2), default=6, show_default=True,
              help="turns of the conversation (the first has nothing to reuse)")
@click.option("--first-tokens", type=click.IntRange(min=1), default=1024, show_default=True,
              help="tokens of the first prompt")
@click.option("--user-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="tokens of each later user message")
@click.option("--answer-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="result JSON (default bench/results/prompt-cache-cpu-<date>.json)")
def main(turns: int, first_tokens: int, user_tokens: int, answer_tokens: int, out: Path | None) -> None:
    now = datetime.now(timezone.utc)
    out = out or REPO / "bench" / "results" / f"prompt-cache-cpu-{now:%Y%m%d-%H%M}.json"
    result_path(out)  # before the model is built
    first, user = conversation(np.random.default_rng(0), first_tokens, user_tokens)
    capacity = first_tokens + turns * (user_tokens + answer_tokens + 8)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), BENCH_MODEL, seed=0)
        for name, checkpoints in (("without_cache", 0), ("with_cache", 4)):
            engine = Engine(load_spec(Path(tmp)), Checkpoint.open(Path(tmp)), NumpyBackend(), max_seq_len=capacity,
                            prompt_cache=checkpoints)
            started = time.perf_counter()
            runs[name] = run_turns(engine, first, user, turns, answer_tokens)
            runs[name + "_total_s"] = round(time.perf_counter() - started, 3)
    same = [a["answer"] for a in runs["with_cache"]] == [a["answer"] for a in runs["without_cache"]]
    later = slice(1, None)  # the first turn has nothing to reuse
    ttft = {name: sum(r["first_token_s"] for r in runs[name][later]) for name in ("with_cache", "without_cache")}
    result = {
        "date": now.isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": machine(),
        "model": asdict(BENCH_MODEL),
        "settings": {"turns": turns, "first_tokens": first_tokens, "user_tokens": user_tokens,
                     "answer_tokens": answer_tokens, "checkpoints": 4},
        "answers_identical": same,
        "later_turns_first_token_s": {k: round(v, 3) for k, v in ttft.items()},
        "later_turns_speedup": round(ttft["without_cache"] / ttft["with_cache"], 2),
        **{name: [{k: v for k, v in r.items() if k != "answer"} for r in runs[name]] for name in ("with_cache", "without_cache")},
        "total_s": {name: runs[name + "_total_s"] for name in ("with_cache", "without_cache")},
    }
    write_json(out, result, indent=2)
    click.echo(json.dumps(result, indent=2))
    if not same:
        raise SystemExit("the prompt cache changed the answers")


if __name__ == "__main__":
    sys.exit(run_click(main, "bench/prompt_cache.py"))
