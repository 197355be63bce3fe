"""Inputs no tool should meet with a traceback (found by auditing the CLIs): JSON nested past
Python's recursion limit, names longer than a file name, Unicode digits, a host no resolver takes,
counts in config.json past what the checkpoint holds, writes that fail after the checks passed,
a kernel-form switch read only at its first prompt. Each is one line (exit 2 from a CLI)."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from atlas.errors import AtlasError

DEEP = "[" * 5000 + "]" * 5000  # past json's recursion limit


def one_line(capsys: pytest.CaptureFixture[str], code: int, prog: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"{prog}: error:"), err
    return lines[0]


LONG_INT = "1" * 5000  # past int()'s 4300-digit limit


@pytest.mark.parametrize("flags", [["--json-schema", f'{{"a": {DEEP}}}'], ["--chat-template-kwargs", f'{{"a": {DEEP}}}'],
                                   ["--hf-overrides", f'{{"a": {DEEP}}}'], ["--json-schema", f'{{"anyOf": [{"{"}' * 3000],
                                   ["--chat-template-kwargs", f'{{"a": {LONG_INT}}}'], ["--hf-overrides", f'{{"a": {LONG_INT}}}']])
def test_deep_json_flags(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from atlas.run import main

    line = one_line(capsys, main([*flags, "--device", "cpu"]), "atlas.run")
    assert any(words in line for words in ("nested too deeply", "is not JSON", "must be a JSON object", "too long to read")), line


def test_deep_json_files(tmp_path: Path) -> None:
    from atlas.config import load_spec
    from atlas.safetensors import parse_header

    (tmp_path / "config.json").write_text(f'{{"model_type": {DEEP}}}', encoding="utf-8")
    with pytest.raises(AtlasError, match="is not valid JSON .*nested too deeply"):
        load_spec(tmp_path)
    header = json.dumps({"__metadata__": {}})[:-1].encode() + b', "x": ' + DEEP.encode() + b"}"
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(AtlasError, match="header is not valid JSON"):
        parse_header(shard)


def test_a_deep_batch_line_is_that_lines_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from atlas.batch import main

    good = {"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": {"model": "atlas-demo", "prompt": "Flat is", "max_tokens": 2}}
    (tmp_path / "in.jsonl").write_text(DEEP + "\n" + json.dumps(good) + "\n", encoding="utf-8")
    assert main(["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--device", "cpu"]) == 0
    first, second = (json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines())
    assert first["error"]["code"] == "invalid_json" and "nested too deeply" in first["error"]["message"]
    assert second["error"] is None and second["response"]["status_code"] == 200


@pytest.mark.parametrize("host", ["a" * 64, "a..b"])
def test_a_host_no_resolver_takes(host: str, capsys: pytest.CaptureFixture[str]) -> None:
    from atlas.serve import main

    assert f"--host {host}" in one_line(capsys, main(["--host", host, "--port", "0", "--device", "cpu"]), "atlas.serve")


def test_unicode_digits_are_not_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    from atlas.backends.cuda.select import device_ordinal
    from atlas.run import main

    with pytest.raises(AtlasError, match="ATLAS_CUDA_DEVICE='²' is not a GPU index"):
        device_ordinal({"ATLAS_CUDA_DEVICE": "²"})
    assert device_ordinal({"ATLAS_CUDA_DEVICE": " 3 "}) == 3
    assert "--kv-high-precision-layers" in one_line(capsys, main(["--kv-high-precision-layers", "²"]), "atlas.run")


def test_counts_past_the_checkpoint_are_one_line_at_once(tmp_path: Path) -> None:
    """A layer or expert count config.json inflates: named before a plan of that size is built
    (a million layers once took minutes and GiBs), and a size past int32 is refused while reading."""
    import shutil

    from atlas.config import load_spec
    from atlas.demo import DEMO_DIR
    from atlas.models.qwen3_5_moe import detect_layout
    from atlas.safetensors import Checkpoint

    config = json.loads((DEMO_DIR / "config.json").read_text(encoding="utf-8"))
    for field, value in (("num_hidden_layers", 10**7), ("num_experts", 10**6)):
        model_dir = tmp_path / field
        shutil.copytree(DEMO_DIR, model_dir)
        changed = {**config, field: value, "layer_types": None}
        (model_dir / "config.json").write_text(json.dumps(changed), encoding="utf-8")
        with pytest.raises(AtlasError, match=f"config.json has {field} = {value} but .* has no '"):
            detect_layout(load_spec(model_dir), Checkpoint.open(model_dir))
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 10**400}), encoding="utf-8")
    with pytest.raises(AtlasError, match="'hidden_size' must be at most 2147483647"):
        load_spec(tmp_path)


def test_a_write_that_fails_after_the_checks_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from atlas import dump

    def full_disk(src: object, dst: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dump.os, "replace", full_disk)
    target = tmp_path / "out.json"
    with pytest.raises(AtlasError, match=f"^{target} cannot be written \\(No space left on device\\); write elsewhere$"):
        dump.write_json(target, {"a": 1})
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(AtlasError, match="File name too long"):
        dump.check_writable(tmp_path / ("x" * 300), "--json")


def test_a_dump_dir_that_takes_no_run_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from atlas import dump
    from atlas.run import main

    def refused(*args: object, **kwargs: object) -> str:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setenv("ATLAS_DUMP", "layers")
    monkeypatch.setenv("ATLAS_DUMP_DIR", str(tmp_path))
    monkeypatch.setattr(dump.tempfile, "mkdtemp", refused)
    code = main(["--max-tokens", "1", "--device", "cpu"])
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the load's progress lines
    assert code == 2 and last.startswith("atlas.run: error: ATLAS_DUMP_DIR") and "(Permission denied)" in last, last


def test_the_delta_rule_switch_is_checked_when_the_backend_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from atlas.backends.cuda.backend import CudaBackend
    from test_cuda_select import make_runtime

    rt, _ = make_runtime()
    monkeypatch.setenv("ATLAS_DELTA_RULE", "wy")
    with pytest.raises(AtlasError, match="^ATLAS_DELTA_RULE='wy' is not a "):
        CudaBackend(rt, use_graphs=False)
    monkeypatch.setenv("ATLAS_DELTA_RULE", "chunked")
    CudaBackend(rt, use_graphs=False)
