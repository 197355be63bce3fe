"""Inputs no tool should meet with a traceback (found by auditing the CLIs): JSON nested past
Python's recursion limit, names longer than a file name, Unicode digits, a host no resolver takes,
counts in config.json past what the checkpoint holds, writes that fail after the checks passed,
a kernel-form switch read only at its first prompt. Each is one line (exit 2 from a CLI)."""

from __future__ import annotations

import errno
import json
import os
import re
import struct
from pathlib import Path
from typing import Any

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


# --- checkpoint files (found by corrupting copies of the demo checkpoint) ---------------------
def rewrite_header(shard: Path, change: Any, extra: bytes = b"") -> None:
    """The shard with its header passed through `change` (data kept; `extra` appended)."""
    data = shard.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = change(json.loads(data[8 : 8 + size]))
    encoded = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + size :] + extra)


def data_end(header: dict[str, Any]) -> int:
    return max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")


@pytest.mark.parametrize(("entry", "message"), [
    ({"dtype": ["BF16"], "shape": [1], "data_offsets": [0, 2]}, "unknown dtype \\['BF16'\\]"),
    ({"dtype": {"a": 1}, "shape": [1], "data_offsets": [0, 2]}, "unknown dtype"),
    ({"dtype": "BF16", "shape": [2**62, 0], "data_offsets": None}, "invalid shape"),  # no bytes, a huge dim
    ({"dtype": "BF16", "shape": [1] * 65, "data_offsets": None}, "invalid shape"),  # past numpy's 64 dims
])
def test_header_entries_that_crashed(tmp_path: Path, entry: dict[str, Any], message: str) -> None:
    from _demo_copy import demo_copy
    from atlas.safetensors import Checkpoint

    model_dir = demo_copy(tmp_path / "demo")

    def add(header: dict[str, Any]) -> dict[str, Any]:
        end = data_end(header)
        offsets = entry["data_offsets"] or [end, end]
        return {**header, "model.extra.weight": {**entry, "data_offsets": offsets}}

    rewrite_header(model_dir / "model.safetensors", add, extra=b"\0\0")
    with pytest.raises(AtlasError, match=message):
        Checkpoint.open(model_dir)


@pytest.mark.parametrize(("ids", "shown"), [(10**30, str(10**30)[:30]), ([0, -251], "-251"), ([2, 512], "512")])
def test_end_ids_outside_the_vocabulary(tmp_path: Path, ids: Any, shown: str) -> None:
    """A negative id had banned a real token (numpy indexes from the end), a huge one crashed the
    penalties, one past the vocabulary never ended a text."""
    from _demo_copy import demo_copy
    from atlas.config import load_spec

    model_dir = demo_copy(tmp_path / "demo")
    generation = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    (model_dir / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": ids}), encoding="utf-8")
    with pytest.raises(AtlasError, match=f"generation_config.json: field 'eos_token_id' holds {shown}, outside the "
                                         "vocabulary \\(0..511\\)"):
        load_spec(model_dir)


@pytest.mark.parametrize("factor", [1e-4, 1e-300, 1e300])
def test_a_yarn_factor_that_leaves_no_context(tmp_path: Path, factor: float) -> None:
    from _demo_copy import demo_copy
    from atlas.config import load_spec

    model_dir = demo_copy(tmp_path / "demo")
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "yarn", "factor": factor}
    (model_dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(AtlasError, match="'rope_parameters.factor' .* it must come to 1..2147483647"):
        load_spec(model_dir)


@pytest.mark.parametrize(("template", "message"), [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "range\\(\\) loops run past"),
    ("{{ 'x' * 10**10 }}", "'\\*' would make more than"),
    ("{{ [messages] * 10**9 }}", "'\\*' would make more than"),
    ("{{ 7 ** 100000000 }}", "'\\*\\*' would make more than"),
])
def test_chat_templates_that_would_run_for_hours_or_take_the_memory(template: str, message: str) -> None:
    from atlas.tokenizer import render_chat_template

    with pytest.raises(AtlasError, match=f"^tpl: the chat template failed .*{message}"):
        render_chat_template(template, [{"role": "user", "content": "hi"}], {}, "tpl")
    fine = "{% for m in messages %}{{ m.content * 3 }}{% endfor %}{{ 2 ** 10 }}{{ range(3) | list }}"
    assert render_chat_template(fine, [{"role": "user", "content": "hi"}], {}, "tpl") == "hihihi1024[0, 1, 2]"


def test_a_template_list_entry_with_an_odd_name_is_passed_over(tmp_path: Path) -> None:
    from _demo_copy import demo_copy
    from atlas.tokenizer import read_chat_template

    config = {"chat_template": [{"name": ["default"], "template": "x"}, {"name": "default", "template": "y"}]}
    assert read_chat_template(demo_copy(tmp_path / "demo"), config)[0] == "y"


def quantize_one_line(model_dir: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    from atlas.quantize import main

    code = main(["--model", str(model_dir), "--to", "fp8", "--out", str(out)])
    err = capsys.readouterr().err.split("\r")[-1]  # after the progress bar's last redraw
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("quantizing to")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("atlas.quantize: error:"), err
    line = lines[0]
    assert not out.exists() and not list(out.parent.glob("*.partial*"))
    return line


def test_quantize_refuses_what_it_would_write_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A NaN weight (no scale represents it: the output then failed to load), a stray scale beside
    a bf16 weight (it replaced the computed one, 5000x off), an incomplete MTP head (atlas.run
    refuses it, quantize wrote it) and a fused stack of the wrong rank (a traceback)."""
    from _demo_copy import demo_copy

    nan_dir = demo_copy(tmp_path / "nan")
    shard = nan_dir / "model.safetensors"
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    data = bytearray(shard.read_bytes())
    size = struct.unpack("<Q", data[:8])[0]
    begin = json.loads(data[8 : 8 + size])[name]["data_offsets"][0]
    data[8 + size + begin : 8 + size + begin + 2] = b"\xc0\x7f"  # a bf16 NaN
    shard.write_bytes(bytes(data))
    assert "holds NaN or infinite values" in quantize_one_line(nan_dir, tmp_path / "q1", capsys)

    cases = {
        "stray": ("model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv", "F32", [1, 1], "a quantized checkpoint's scale"),
        "mtp": ("mtp.fc.weight", "F32", [1, 1], "'mtp.fc.weight' .* has shape \\[1, 1\\], expected"),
        "rank": ("model.visual.mlp.experts.gate_up_proj", "F32", [1], "a fused expert stack is \\[experts, rows"),
    }
    for label, (extra, dtype, shape, message) in cases.items():
        model_dir = demo_copy(tmp_path / label)

        def add(header: dict[str, Any], extra: str = extra, dtype: str = dtype, shape: list[int] = shape) -> dict[str, Any]:
            end = data_end(header)
            return {**header, extra: {"dtype": dtype, "shape": shape, "data_offsets": [end, end + 4 * int(np.prod(shape))]}}

        rewrite_header(model_dir / "model.safetensors", add, extra=np.ones(1, np.float32).tobytes())
        line = quantize_one_line(model_dir, tmp_path / f"q-{label}", capsys)
        assert re.search(message, line), line


@pytest.mark.parametrize(("flags", "named"), [(["--choice", "\udcff"], "--choice"), (["--regex=a\udcff"], "--regex"),
                                              (["--grammar", 'root ::= "\udcff"'], "--grammar")])
def test_arguments_that_are_not_utf8(flags: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Bytes that are not UTF-8 reach Python as lone surrogates: --choice had crashed encoding them,
    --regex and --grammar had loaded the weights to say no token continues the text."""
    from atlas.run import main

    line = one_line(capsys, main([*flags, "--device", "cpu"]), "atlas.run")
    assert line.startswith(f"atlas.run: error: {named}: not UTF-8 text (byte 0xff at character "), line


def test_a_file_name_that_is_not_utf8_is_still_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from atlas.run import main

    prompt = tmp_path / "prompt-\udcff.txt"  # the bytes b"prompt-\xff.txt": a valid Linux file name
    prompt.write_text("Flat is", encoding="utf-8")
    assert main(["--prompt-file", str(prompt), "-n", "2", "--device", "cpu"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("schema", ['{"const": "\\ud800"}', '{"enum": ["a\\udcff"]}',
                                    '{"type": "object", "properties": {"\\udcff": {"type": "string"}}}'])
def test_a_schema_with_a_lone_surrogate(schema: str, capsys: pytest.CaptureFixture[str]) -> None:
    """No UTF-8 output can match such a schema: it had crashed (a property name) or been called
    NaN (a const)."""
    from atlas import LLM
    from atlas.run import main

    line = one_line(capsys, main(["--json-schema", schema, "-n", "2", "--device", "cpu"]), "atlas.run")
    assert "holds an unpaired UTF-16 surrogate" in line, line
    with pytest.raises(AtlasError, match="holds an unpaired UTF-16 surrogate"):
        LLM(device="cpu").generate("Flat is", max_tokens=2, json_schema=json.loads(schema))


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux) to fill standard output")
@pytest.mark.parametrize("tool", [["atlas.run", "-n", "3", "--device", "cpu"], ["atlas.info"]])
def test_a_full_standard_output_is_one_line(tool: list[str]) -> None:
    """`atlas.run > file` on a full disk had ended in a traceback (OSError: No space left on device)."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "python")}
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", *tool], stdout=full, stderr=subprocess.PIPE, text=True,
                              env=env, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.rstrip().endswith(f"{tool[0]}: error: cannot write the output (No space left on device); "
                                         "free some space or write elsewhere"), done.stderr[-500:]


@pytest.mark.parametrize(("tool", "flags", "expected"), [
    ("atlas.run", ["--json-schema", ""], "--json-schema is empty"),  # had read the current directory
    ("atlas.run", ["--json-schema", "[]"], "--json-schema [] is JSON but not an object"),  # had been "no such file"
    ("atlas.run", ["--json-schema", "true"], "--json-schema true is JSON but not an object"),
    ("atlas.run", ["--temperature", "inf"], "temperature must be a finite number >= 0"),
    ("atlas.quantize", ["--to", "fp8", "--out", ""], "--out is empty"),  # had said the current directory exists
    ("atlas.quantize", ["--to", "fp8", "--out", " "], "--out is empty"),
    ("atlas.serve", ["--host", ""], "--host is empty"),  # had been "cannot listen on :0"
])
def test_empty_or_mistyped_values_are_named(tool: str, flags: list[str], expected: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    main = importlib.import_module(tool).main
    line = one_line(capsys, main([*flags, "--device", "cpu"] if tool != "atlas.quantize" else flags), tool)
    assert line.startswith(f"{tool}: error: {expected}"), line


def test_a_write_refused_for_another_reason_does_not_ask_for_space(tmp_path: Path) -> None:
    from atlas.quantize import write_error

    full = write_error(tmp_path / "out", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    missing = write_error(tmp_path / "out", OSError(errno.ENOENT, os.strerror(errno.ENOENT)))
    assert "free some space" in str(full) and "free some space" not in str(missing)


@pytest.mark.parametrize("flags", [["-n", "99999999999"], ["--max-seq-len", "1"]])
def test_a_length_that_cannot_fit_is_refused_before_the_weights_load(
        flags: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The check had waited for the weights (minutes for a 35B model) to say the context is too small."""
    from atlas.engine_flags import EngineFlags
    from atlas.run import main

    def load(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the weights loaded before the length was checked")

    monkeypatch.setattr(EngineFlags, "load", load)
    line = one_line(capsys, main([*flags, "--device", "cpu", "-p", "Flat is"]), "atlas.run")
    assert "positions but this model holds" in line, line
