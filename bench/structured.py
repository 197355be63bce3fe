"""Structured output's worst step on the host: which tokens of a Qwen3.6-sized vocabulary may come
next, checked one by one (what a pick does when none of the most likely ids fits), per shape.

    python bench/structured.py [--vocab 248320] [--out bench/results/structured-cpu-<date>.json]

The vocabulary is synthetic (seeded random byte strings of 1-8 bytes over letters, digits, spaces
and JSON punctuation: no tokenizer is downloaded), so the numbers compare shapes and versions of
the matcher on one machine, not the real tokenizer. Each shape is timed twice from the same
state: `first_walk_s` fills the shape's moves cache, `second_walk_s` reads it.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import click
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))

from _json_grammar import JSON_GRAMMAR  # noqa: E402
from atlas.dump import check_writable, write_json  # noqa: E402
from atlas.structured import OutputConstraint, OutputFormat  # noqa: E402
from bench_cli import run_click  # noqa: E402
from provenance import git_commit  # noqa: E402

ALPHABET = b'abcdefghijklmnopqrstuvwxyz  ,."{}:0123456789ABCDEF_-\n'
PERSON = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"}}}
# name -> (LLM.generate keyword, its value, the text already written)
SHAPES = {
    "json_object": ("json_object", True, b""),
    "schema_start": ("json_schema", PERSON, b""),
    "schema_mid_string": ("json_schema", PERSON, b'{"name": "ab'),
    "regex_words": ("regex", r"[0-9]{3}-[a-z]+( [a-z]+)*", b""),
    "regex_bounded_1500": ("regex", r"[a-z ]{0,1500}", b""),
    "regex_words_300": ("regex", r"([a-z]+ ){0,300}end", b""),
    "regex_nested_50": ("regex", r"((a|b)*c(a|b)*){50}", b""),
    "grammar_json_nested": ("grammar", JSON_GRAMMAR, b'{"a": [{"b": [1, {"c": "x'),
}


def vocabulary(size: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(ALPHABET, dtype=np.uint8)
    lengths = rng.integers(1, 9, size)
    return [bytes(alphabet[rng.integers(0, alphabet.size, int(n))]) for n in lengths]


def time_shape(tokens: list[bytes], kind: str, spec: object, written: bytes) -> dict[str, float | int]:
    started = time.perf_counter()
    constraint = OutputConstraint(tokens, {len(tokens) - 1}, OutputFormat.of(**{kind: spec}).shape())
    compile_s = time.perf_counter() - started
    if written and not constraint.matcher.feed(written):
        raise SystemExit(f"{written!r} does not fit the shape")
    walks, allowed = [], 0
    for _ in range(2):
        started = time.perf_counter()
        allowed = sum(constraint.allows(token) for token in range(len(tokens) - 1))
        walks.append(time.perf_counter() - started)
    return {"compile_s": round(compile_s, 3), "first_walk_s": round(walks[0], 3), "second_walk_s": round(walks[1], 3),
            "allowed": allowed}


@click.command()
@click.option("--vocab", type=click.IntRange(min=2), default=248320, show_default=True,
              help="tokens in the synthetic vocabulary, the last one the end token (Qwen3.6: 248320)")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="JSON result file")
def main(vocab: int, seed: int, out: Path | None) -> None:
    if out is not None:
        check_writable(out, "--out")  # before the minutes of timing
    tokens = vocabulary(vocab, seed)
    shapes = {}
    for name, (kind, spec, written) in SHAPES.items():
        shapes[name] = time_shape(tokens, kind, spec, written)
        print(f"{name:20s} {shapes[name]}", flush=True)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": git_commit(),
              "machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "load_average_1m": round(os.getloadavg()[0], 2)},
              "vocab": vocab, "seed": seed, "shapes": shapes}
    if out is not None:
        write_json(out, result, indent=2)
        print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(run_click(main, "bench/structured.py"))
