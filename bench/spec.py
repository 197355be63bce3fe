"""MTP speculative decoding on the numpy backend: decode tok/s without speculation and with
K = 1, 2, 3, the acceptance rate, tokens per verify pass, and whether the output is unchanged;
greedy, and sampled with Qwen3.6's recommended settings (a fixed seed, so the tokens compare).

    python scripts/train_demo_mtp.py /tmp/demo-mtp          # the demo with a trained head (~2 min)
    python bench/spec.py --model /tmp/demo-mtp [--tokens 185] [--out bench/results/spec-cpu-<date>.json]

One thread (as bench/cpu.py), the demo's prompt; each configuration is warmed up once, then the
best of 3 runs is kept.
"""

from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = "1"  # before numpy loads

import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))

from atlas.backends.base import SamplingParams  # noqa: E402
from atlas.backends.numpy_backend import NumpyBackend  # noqa: E402
from atlas.config import load_spec  # noqa: E402
from atlas.demo import DEMO_PROMPT  # noqa: E402
from atlas.dump import check_writable, write_json  # noqa: E402
from atlas.engine import Engine  # noqa: E402
from atlas.errors import AtlasError  # noqa: E402
from atlas.models.qwen3_5_moe_mtp import MTP_PREFIX, check_mtp_head, has_mtp_head  # noqa: E402
from atlas.safetensors import Checkpoint  # noqa: E402
from atlas.speculative import SpeculativeEngine  # noqa: E402
from atlas.tokenizer import Tokenizer  # noqa: E402
from bench_cli import run_click  # noqa: E402
from decode import RECOMMENDED_SAMPLING  # noqa: E402
from provenance import git_commit  # noqa: E402

RUNS = 3
SEED = 1234
WARMUP_TOKENS = 8
MODES = {"greedy": SamplingParams(), "sampled": SamplingParams(**RECOMMENDED_SAMPLING)}


def measure(engine: Engine, prompt: list[int], tokens: int, sampling: SamplingParams) -> dict[str, Any]:
    engine.generate(prompt, WARMUP_TOKENS, sampling, SEED, set())  # warm-up
    runs = [engine.generate(prompt, tokens, sampling, SEED, set()) for _ in range(RUNS)]
    best = min(runs, key=lambda s: s.decode_seconds)
    result: dict[str, Any] = {
        "decode_tok_s": round((len(best.token_ids) - 1) / best.decode_seconds, 1),
        "token_ids": best.token_ids,
    }
    if hasattr(best, "drafted"):
        result.update(
            drafted=best.drafted, accepted=best.accepted, rounds=best.rounds,
            acceptance=round(best.acceptance_rate, 4),
            tokens_per_pass=round((len(best.token_ids) - 1) / best.rounds, 3),
        )  # fmt: skip
    return result


@click.command()
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--tokens", type=click.IntRange(min=2), default=185, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(model_dir: Path, tokens: int, out: Path | None) -> None:
    if out is not None:
        check_writable(out, "--out")  # before the measurements
    spec, checkpoint = load_spec(model_dir), Checkpoint.open(model_dir)
    if not has_mtp_head(checkpoint):
        raise AtlasError(f"--model {model_dir}: the checkpoint has no MTP head (no {MTP_PREFIX}* tensors); give a "
                         "model with one (python scripts/train_demo_mtp.py /tmp/demo-mtp trains the demo's)")
    check_mtp_head(spec, checkpoint)
    prompt = Tokenizer.open(model_dir).encode(DEMO_PROMPT)
    capacity = len(prompt) + max(tokens, WARMUP_TOKENS)  # the warm-up's tokens fit too
    configs: dict[str, Any] = {}
    for mode, sampling in MODES.items():
        plain = measure(Engine(spec, checkpoint, NumpyBackend(), max_seq_len=capacity), prompt, tokens, sampling)
        configs[mode] = {"no_spec": {k: v for k, v in plain.items() if k != "token_ids"}}
        for k in (1, 2, 3):
            engine = SpeculativeEngine(spec, checkpoint, NumpyBackend(), k, max_seq_len=capacity)
            result = measure(engine, prompt, tokens, sampling)
            result["same_tokens_as_no_spec"] = result.pop("token_ids") == plain["token_ids"]
            result["speedup"] = round(result["decode_tok_s"] / plain["decode_tok_s"], 2)
            configs[mode][f"k{k}"] = result
    now = datetime.now(timezone.utc)
    report = {
        "date": now.isoformat(timespec="seconds"), "commit": git_commit(), "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(), "threads": 1, "model": str(model_dir),
        "prompt": DEMO_PROMPT, "new_tokens": tokens, "runs": RUNS, "seed": SEED,
        "sampled_settings": RECOMMENDED_SAMPLING, "results": configs,
    }  # fmt: skip
    text = json.dumps(report, indent=1)
    click.echo(text)
    if out is not None:
        write_json(out, report)


if __name__ == "__main__":
    sys.exit(run_click(main, "bench/spec.py"))
