"""Decode speed of the numpy backend against transformers on CPU, on the same random tiny model.

    python bench/cpu.py [--tokens 64] [--out bench/results/cpu-<date>.json]

One run: writes a random qwen3_5_moe checkpoint with transformers, decodes greedily with both,
records tok/s, their ratio (numpy / transformers) and whether the tokens agree. Both run on one
thread, so the ratio compares the implementations rather than thread pools on a shared machine.
"""

from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = "1"  # before numpy / torch load

import json
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import click
import numpy as np
import torch

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "tests"))

from _checkpoints import TinyModel, write_checkpoint  # noqa: E402
from atlas.backends.base import SamplingParams  # noqa: E402
from atlas.backends.numpy_backend import NumpyBackend  # noqa: E402
from atlas.config import load_spec  # noqa: E402
from atlas.dump import check_writable, write_json  # noqa: E402
from atlas.engine import Engine  # noqa: E402
from atlas.errors import AtlasError  # noqa: E402
from atlas.safetensors import Checkpoint  # noqa: E402
from bench_cli import run_click  # noqa: E402
from provenance import git_commit  # noqa: E402

BENCH_MODEL = TinyModel(
    vocab_size=2048, hidden_size=256, num_hidden_layers=8, full_attention_interval=4,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
    linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=32,
    num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=128,
)  # fmt: skip


WARMUP_TOKENS = 4


def numpy_decode(model_dir: Path, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    engine = Engine(load_spec(model_dir), Checkpoint.open(model_dir), NumpyBackend(),
                    max_seq_len=len(prompt) + max(tokens, WARMUP_TOKENS))  # the warm-up's tokens fit too
    engine.generate(prompt, WARMUP_TOKENS, SamplingParams(), None, set())  # warm-up
    stats = engine.generate(prompt, tokens, SamplingParams(), None, set())
    return (len(stats.token_ids) - 1) / stats.decode_seconds, stats.token_ids


def transformers_decode(model: torch.nn.Module, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """Decode rate from generate(tokens) minus generate(1): the prefill cancels out."""
    ids = torch.tensor([prompt])

    def timed(new_tokens: int) -> tuple[float, torch.Tensor]:
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return time.perf_counter() - started, out

    timed(WARMUP_TOKENS)  # warm-up
    one, _ = timed(1)
    full, out = timed(tokens)
    return (tokens - 1) / (full - one), out[0, len(prompt) :].tolist()


def result_path(out: Path) -> None:
    """--out's directory made (as the default bench/results/ may need) and checked before the run."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise AtlasError(f"--out {out}: cannot make its directory ({err.strerror or err}); write elsewhere") from None
    check_writable(out, "--out")


def machine() -> dict[str, object]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "threads": 1,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "numpy": np.__version__,
        "torch": torch.__version__,
    }


@click.command()
@click.option("--tokens", type=click.IntRange(min=2), default=64, show_default=True, help="tokens to decode")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None, help="result JSON (default bench/results/cpu-<date>.json)")
def main(tokens: int, prompt_tokens: int, out: Path | None) -> None:
    now = datetime.now(timezone.utc)
    out = out or REPO / "bench" / "results" / f"cpu-{now:%Y%m%d-%H%M%S}.json"
    result_path(out)  # before the model is built
    prompt = np.random.default_rng(0).integers(0, BENCH_MODEL.vocab_size, prompt_tokens).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        reference = write_checkpoint(Path(tmp), BENCH_MODEL, seed=0)
        numpy_rate, numpy_tokens = numpy_decode(Path(tmp), prompt, tokens)
    hf_rate, hf_tokens = transformers_decode(reference, prompt, tokens)
    result = {
        "date": now.isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": machine(),
        "model": asdict(BENCH_MODEL),
        "prompt_tokens": prompt_tokens,
        "decode_tokens": tokens,
        "numpy_decode_tok_s": round(numpy_rate, 2),
        "transformers_decode_tok_s": round(hf_rate, 2),
        "ratio_numpy_over_transformers": round(numpy_rate / hf_rate, 3),
        "tokens_match": numpy_tokens == hf_tokens,
    }
    write_json(out, result, indent=2)
    click.echo(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(run_click(main, "bench/cpu.py"))
