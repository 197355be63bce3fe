"""The bench scripts' bad input (a flag out of range, an --out that cannot be written, a broken
--model, a server that is not there, no GPU) is one line on stderr that starts with the script's
prefix, exit code 2, no traceback and no output file, as bench/quant.py does."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from _demo_copy import demo_copy  # noqa: E402
from atlas.demo import DEMO_DIR  # noqa: E402
from bench_cli import gpu_missing  # noqa: E402

TIMEOUT_S = 120


def run_bench(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    return subprocess.run([sys.executable, str(REPO / "bench" / script), *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env, cwd=REPO)


def assert_one_line(done: subprocess.CompletedProcess[str], prefix: str, out_dir: Path | None = None) -> str:
    """Exit 2, one non-empty stderr line starting with `prefix`, no traceback, nothing in out_dir."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith(prefix), done.stderr[-3000:]
    if out_dir is not None:
        assert not out_dir.exists() or list(out_dir.iterdir()) == [], list(out_dir.iterdir())
    return lines[0]


def gpu_here() -> bool:
    return shutil.which("nvidia-smi") is not None or gpu_missing() is None


needs_no_gpu = pytest.mark.skipif(gpu_here(), reason="a GPU is here: the script would run instead of saying 'no GPU'")


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


# bench/decode.py


@needs_no_gpu
def test_decode_without_a_gpu(out_dir: Path) -> None:
    assert_one_line(run_bench("decode.py", "--out", str(out_dir / "d.json")), "no GPU: ", out_dir)


@needs_no_gpu
def test_decode_transformers_only_without_a_gpu(out_dir: Path) -> None:
    pytest.importorskip("torch")
    line = assert_one_line(run_bench("decode.py", "--transformers-only", "--out", str(out_dir / "hf.json")), "no GPU: ",
                           out_dir)
    assert "torch" in line


@pytest.mark.parametrize("flags", [["--budget-s", "-1"], ["--budget-s", "nan"], ["--budget-s", "0"], ["--layers", "0"]])
def test_decode_bad_numbers(flags: list[str], out_dir: Path) -> None:
    line = assert_one_line(run_bench("decode.py", "--out", str(out_dir / "d.json"), *flags), "bench/decode.py: error: ",
                           out_dir)
    assert flags[0] in line


def against_file(out_dir: Path, what: str) -> Path:
    path = out_dir.parent / "results.json"
    label = "qwen3.6-35b-a3b dims, 40 layers, synthetic weights"
    body = {"not json": "{bad", "no decode": json.dumps({"model": label}),
            "other model": json.dumps({"model": label.replace("40", "4"), "decode_tok_s": 100.0})}[what]
    path.write_text(body, encoding="utf-8")
    return path


@pytest.mark.parametrize(("what", "flags", "named"), [
    ("not json", ["--transformers-only"], "not a readable JSON"),
    ("no decode", ["--transformers-only"], "no decode_tok_s"),
    ("other model", ["--transformers-only"], "--layers"),
    ("other model", [], "only with --transformers-only"),
    ("other model", ["--transformers-only", "--decode-only"], "one mode at a time"),
])  # fmt: skip
def test_decode_transformers_against_checked(what: str, flags: list[str], named: str, out_dir: Path) -> None:
    """--against names an atlas run of this model; checked before anything loads."""
    against = against_file(out_dir, what)
    done = run_bench("decode.py", "--out", str(out_dir / "hf.json"), "--against", str(against), *flags)
    assert named in assert_one_line(done, "bench/decode.py: error: ", out_dir)
    assert done.stdout == ""


@pytest.mark.parametrize("where", ["directory", "missing directory"])
def test_decode_out_checked_first(where: str, out_dir: Path) -> None:
    out = out_dir if where == "directory" else out_dir / "missing" / "d.json"
    done = run_bench("decode.py", "--out", str(out))
    assert "--out" in assert_one_line(done, "bench/decode.py: error: ", out_dir)
    assert "loading" not in done.stdout  # before the run


def test_decode_full_disk_leaves_no_json(out_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The JSON is written atomically: a disk that fills up midway leaves no half-written file."""
    import decode

    monkeypatch.setattr(decode, "run_prefill_forms",
                        lambda spec, rng: {"prefill_attention": "simt", "prefill_tok_s_by_form": {"simt": 1.0}})
    plain_write_text = Path.write_text

    def full_disk(path: Path, text: str, *args: object, **kwargs: object) -> int:
        if out_dir not in path.parents:
            return plain_write_text(path, text, *args, **kwargs)  # type: ignore[arg-type]
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text[: len(text) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(Path, "write_text", full_disk)
    assert decode.main(["--out", str(out_dir / "d.json"), "--prefill-only"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("bench/decode.py: error: ") and "No space" in lines[0], err
    assert list(out_dir.iterdir()) == []


# bench/module_load_probe.py


@needs_no_gpu
def test_module_load_probe_without_a_gpu() -> None:
    done = run_bench("module_load_probe.py")
    assert_one_line(done, "no GPU: ")
    assert done.stdout == ""


# bench/structured.py


@pytest.mark.parametrize("flags", [["--vocab", "-5"], ["--vocab", "1"], ["--seed", "-1"]])
def test_structured_bad_numbers(flags: list[str]) -> None:
    assert flags[0] in assert_one_line(run_bench("structured.py", *flags), "bench/structured.py: error: ")


@pytest.mark.parametrize("where", ["directory", "missing directory"])
def test_structured_out_checked_before_the_run(where: str, out_dir: Path) -> None:
    out = out_dir if where == "directory" else out_dir / "missing" / "x.json"
    done = run_bench("structured.py", "--vocab", "2000", "--out", str(out))
    assert "--out" in assert_one_line(done, "bench/structured.py: error: ", out_dir)
    assert "json_object" not in done.stdout  # no shape was timed


# bench/spec.py


def broken_model(path: Path, what: str) -> Path:
    demo_copy(path)
    if what == "truncated safetensors":
        weights = path / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif what == "short safetensors header":
        weights = path / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    elif what == "bad config.json":
        (path / "config.json").write_text("{bad", encoding="utf-8")
    return path


@pytest.mark.parametrize("what", ["truncated safetensors", "short safetensors header", "bad config.json"])
def test_spec_broken_model(what: str, tmp_path: Path, out_dir: Path) -> None:
    model = broken_model(tmp_path / "model", what)
    done = run_bench("spec.py", "--model", str(model), "--out", str(out_dir / "s.json"))
    assert_one_line(done, "bench/spec.py: error: ", out_dir)


def test_spec_model_without_an_mtp_head(out_dir: Path) -> None:
    done = run_bench("spec.py", "--model", str(DEMO_DIR), "--tokens", "5", "--out", str(out_dir / "s.json"))
    assert "MTP head" in assert_one_line(done, "bench/spec.py: error: ", out_dir)
    assert done.stdout == ""  # checked before any measurement


@pytest.mark.parametrize("flags", [["--tokens", "1"], ["--out", "missing/s.json"]])
def test_spec_bad_flags(flags: list[str], out_dir: Path) -> None:
    flags = [str(out_dir / f) if f.endswith(".json") else f for f in flags]
    done = run_bench("spec.py", "--model", str(DEMO_DIR), *flags)
    assert flags[0] in assert_one_line(done, "bench/spec.py: error: ", out_dir)


def test_spec_few_tokens_work(tmp_path: Path) -> None:
    """--tokens takes any value from 2 up: the warm-up's 8 tokens fit the engines' context too."""
    pytest.importorskip("torch")
    from test_speculative import add_mtp_head

    model = demo_copy(tmp_path / "model")
    add_mtp_head(model, 7, fused=True)
    out = tmp_path / "s.json"
    done = run_bench("spec.py", "--model", str(model), "--tokens", "2", "--out", str(out))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["new_tokens"] == 2 and set(report["results"]["greedy"]) == {"no_spec", "k1", "k2", "k3"}


# bench/cpu.py


@pytest.mark.parametrize("flags", [["--tokens", "-1"], ["--tokens", "1"], ["--prompt-tokens", "0"], ["--out", "."]])
def test_cpu_bad_flags(flags: list[str], out_dir: Path) -> None:
    flags = [str(out_dir) if f == "." else f for f in flags]
    done = run_bench("cpu.py", *flags)
    assert flags[0] in assert_one_line(done, "bench/cpu.py: error: ", out_dir)


# bench/prompt_cache.py


@pytest.mark.parametrize("flags", [["--turns", "-1"], ["--turns", "1"], ["--first-tokens", "0"],
                                   ["--user-tokens", "-2"], ["--answer-tokens", "0"], ["--out", "."]])
def test_prompt_cache_bad_flags(flags: list[str], out_dir: Path) -> None:
    flags = [str(out_dir) if f == "." else f for f in flags]
    done = run_bench("prompt_cache.py", *flags)
    assert flags[0] in assert_one_line(done, "bench/prompt_cache.py: error: ", out_dir)


# bench/serve.py


@pytest.mark.parametrize(("flags", "named"), [(["--url", "http://127.0.0.1:1/v1"], "127.0.0.1:1"),
                                              (["--url", "notaurl"], "notaurl"), (["--url", "http:///v1"], "http:///v1"),
                                              (["--model", "/nonexistent"], "/nonexistent"),
                                              (["--url", "http://x/v1", "--out", "."], "is a directory"),
                                              (["--url", "http://x/v1", "--requests", "0"], "--requests")])
def test_serve_unreachable_or_bad(flags: list[str], named: str, out_dir: Path) -> None:
    flags = [str(out_dir) if f == "." else f for f in flags]
    with_out = flags if "--out" in flags else [*flags, "--out", str(out_dir / "serve.json")]
    done = run_bench("serve.py", *with_out)
    assert named in assert_one_line(done, "bench/serve.py: error: ", out_dir)
