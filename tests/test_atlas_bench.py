"""`python -m atlas.bench` (llama-bench's measurements): each test's runs, what each run generates,
the rates and the outputs' forms, and bad flags as one line."""

from __future__ import annotations

import csv
import io
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlas import bench
from atlas.demo import DEMO_DIR
from atlas.llm import LLM


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what came before (the rng fixture's seed line) is not the command's
    code = bench.main(["--device", "cpu", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def stored_bytes(model_dir: Path) -> int:
    """The tensors' bytes, read from the safetensors headers here (not atlas's reader)."""
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(end - start for name, entry in header.items() if name != "__metadata__"
                     for start, end in [entry["data_offsets"]])
    return total


def test_runs_each_test_after_a_warm_up(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                        rng: np.random.Generator) -> None:
    """ppN: an N-token prompt, one token; tgN: a one-token prompt, N tokens whatever the eos; each
    run's prompt fresh (no prompt-cache hit), -r timed runs after one warm-up; the JSON's rates are
    what the runs measured."""
    calls: list[tuple[list[int], Any]] = []
    rates: list[tuple[float, float]] = []
    real = LLM.generate_with

    def recorded(self: LLM, prompt_ids: list[int], opts: Any, on_text: Any) -> Any:
        result = real(self, prompt_ids, opts, on_text)
        calls.append((prompt_ids, opts))
        rates.append((result.prefill_tok_s, result.decode_tok_s))
        return result

    monkeypatch.setattr(LLM, "generate_with", recorded)
    prompt, gen, reps = int(rng.integers(4, 40)), int(rng.integers(2, 12)), int(rng.integers(1, 4))
    code, out, err = run(capsys, "-p", str(prompt), "-n", str(gen), "-r", str(reps), "-o", "json")
    assert code == 0, err
    records = json.loads(out)
    assert [r["test"] for r in records] == [f"pp{prompt}", f"tg{gen}"]
    assert len(calls) == 2 * (reps + 1)
    for (ids, opts), want_len, want_tokens in zip(calls, [prompt] * (reps + 1) + [1] * (reps + 1),
                                                  [1] * (reps + 1) + [gen] * (reps + 1)):
        assert len(ids) == want_len and opts.max_tokens == want_tokens and opts.ignore_eos and opts.temperature == 0
    assert len({tuple(ids) for ids, _ in calls[: reps + 1]}) == reps + 1 or prompt < 6
    pp, tg = records
    assert pp["samples_ts"] == [r[0] for r in rates[1 : reps + 1]]  # the warm-up is not timed
    assert tg["samples_ts"] == [r[1] for r in rates[reps + 2 :]]
    for record in records:
        assert record["avg_ts"] == pytest.approx(statistics.fmean(record["samples_ts"]))
        assert all(s > 0 for s in record["samples_ts"])
        assert (record["backend"], record["quant"], record["model"]) == ("cpu", "bf16", "atlas-demo")
        assert record["size_bytes"] == stored_bytes(DEMO_DIR)


def test_output_forms(capsys: pytest.CaptureFixture[str]) -> None:
    code, table, err = run(capsys, "-p", "8,16", "-n", "3", "-r", "2", "--seed", "1")
    assert code == 0 and "atlas.bench: tg3: 2 runs after a warm-up" in err
    lines = table.splitlines()
    assert lines[0] == "| model | size | quant | backend | spec | test | t/s |" and len(lines) == 2 + 3
    assert [line.split(" | ")[5] for line in lines[2:]] == ["pp8", "pp16", "tg3"]
    assert all(" ± " in line and line.split(" | ")[4] == "off" for line in lines[2:])
    code, text, _ = run(capsys, "-p", "8", "-n", "0", "-r", "2", "-o", "csv")
    (row,) = list(csv.DictReader(io.StringIO(text)))
    assert code == 0 and row["test"] == "pp8" and len(row["samples_ts"].split(";")) == 2
    code, text, _ = run(capsys, "-p", "0", "-n", "2", "-r", "1", "-o", "jsonl")
    assert code == 0 and [json.loads(line)["test"] for line in text.splitlines()] == ["tg2"]


@pytest.mark.parametrize("argv, needle", [
    (["-p", "x"], "comma list"),
    (["-n", "1"], "-n counts >= 2"),
    (["-p", "0", "-n", "0"], "no test to run"),
    (["-r", "0"], "--repetitions"),
    (["-c", "8", "-p", "64"], "--max-seq-len 8"),
    (["-o", "xml"], "--output"),
    (["-m", "/no/such/model"], "/no/such/model"),
])
def test_bad_flags_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    code, out, err = run(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and not out and lines[-1].startswith("atlas.bench: error:") and needle in lines[-1], err
