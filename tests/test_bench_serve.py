"""bench/serve.py against the demo on the CPU: it starts atlas.serve, every request completes with
exactly the tokens asked for, the statistics are consistent with each other, and bad flags are a
usage error (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("uvicorn")

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench" / "serve.py"


def test_load_on_the_demo(tmp_path: Path, rng: np.random.Generator) -> None:
    requests, concurrency = int(rng.integers(3, 7)), int(rng.integers(1, 4))
    inputs, outputs = int(rng.integers(8, 40)), int(rng.integers(2, 12))
    out = tmp_path / "serve.json"
    done = subprocess.run([sys.executable, str(BENCH), "--model", "atlas-demo", "--device", "cpu", "--requests", str(requests),
                           "--concurrency", str(concurrency), "--input-tokens", str(inputs), "--output-tokens", str(outputs),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads(out.read_text())
    result = document["results"]
    assert (result["completed"], result["failed"], result["output_tokens"]) == (requests, 0, requests * outputs)
    assert document["device"].startswith("cpu") and document["commit"]
    for name in ("ttft_ms", "e2e_ms", "itl_ms", "tpot_ms"):
        stats = result[name]
        assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"], (name, stats)
    assert result["ttft_ms"]["p99"] <= result["e2e_ms"]["p99"] + 1e-6
    assert result["output_tok_s"] == pytest.approx(requests * outputs / result["duration_s"], rel=0.02)


@pytest.mark.parametrize("flags", [[], ["--model", "atlas-demo", "--url", "http://127.0.0.1:1/v1"],
                                   ["--url", "http://x/v1", "--out", "/no/such/dir/x.json"]])
def test_bad_flags_are_usage_errors(flags: list[str]) -> None:
    done = subprocess.run([sys.executable, str(BENCH), *flags], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Error" in done.stderr and "Traceback" not in done.stderr, done.stderr
