"""`python -m atlas.quantize`: the published tensor layouts and configs, the official exclusions,
quantize -> load -> dequantize round trips, sharding, and atomic output with one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from _checkpoints import TinyModel, write_checkpoint
from atlas.demo import DEMO_DIR
from atlas.quant.exclusions import is_excluded
from atlas.quant.stored import QuantizedTensors
from atlas.quantize import main
from atlas.safetensors import Checkpoint
from atlas.targets import recognise_quant

REPO = Path(__file__).resolve().parent.parent
EXCLUDED_SUFFIXES = (
    "embed_tokens.weight", "norm.weight", "mlp.gate.weight", "mlp.shared_expert_gate.weight",
    "linear_attn.A_log", "linear_attn.conv1d.weight", "linear_attn.dt_bias",
    "linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight",
)  # fmt: skip
PART_SUFFIXES = ("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale")


def quantize_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "atlas.quantize", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture(scope="module")
def demo_quantized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("quantized")
    result = {}
    for method in ("fp8", "nvfp4"):
        shards = ["--shard-mb", "1"] if method == "nvfp4" else []  # 1.1 MB: two shards and an index
        done = quantize_cli("--to", method, "--out", str(out / method), *shards)
        assert done.returncode == 0, done.stderr
        assert f"quantizing to {method}" in done.stderr  # the progress bar
        result[method] = out / method
    return result


def logical_names(checkpoint: Checkpoint) -> list[str]:
    return [n for n in checkpoint.names() if not n.endswith(PART_SUFFIXES)]


@pytest.mark.parametrize("method", ["fp8", "nvfp4"])
def test_layout_and_exclusions(demo_quantized: dict[str, Path], method: str) -> None:
    source, out = Checkpoint.open(DEMO_DIR), Checkpoint.open(demo_quantized[method])
    assert recognise_quant(demo_quantized[method]) == method
    sharded = (demo_quantized[method] / "model.safetensors.index.json").is_file()
    assert sharded == (method == "nvfp4") and sharded != (demo_quantized[method] / "model.safetensors").is_file()
    assert logical_names(out) == source.names()
    quantized = [n for n in source.names() if out.dtype(n) != source.dtype(n)]
    for name in source.names():
        if name.endswith(EXCLUDED_SUFFIXES) or name == "lm_head.weight":
            assert out.dtype(name) == source.dtype(name) == "BF16", name
            assert np.array_equal(out.get_raw(name), source.get_raw(name)), name
    assert len(quantized) == len(set(quantized)) > 0
    for name in quantized:
        n, k = source.shape(name)
        base = name[: -len("weight")]
        if method == "fp8":
            assert (out.dtype(name), out.shape(name)) == ("F8_E4M3", (n, k))
            assert (out.dtype(base + "weight_scale_inv"), out.shape(base + "weight_scale_inv")) == ("F32", (-(-n // 128), -(-k // 128)))
        else:
            assert (out.dtype(name), out.shape(name)) == ("U8", (n, k // 2))
            assert (out.dtype(base + "weight_scale"), out.shape(base + "weight_scale")) == ("F8_E4M3", (n, k // 16))
            assert (out.dtype(base + "weight_scale_2"), out.shape(base + "weight_scale_2")) == ("F32", ())
            assert out.dtype(base + "input_scale") == "F32"
    expected_quantized = {n for n in source.names() if n.endswith(".weight") and len(source.shape(n)) == 2
                          and not n.endswith(EXCLUDED_SUFFIXES) and n != "lm_head.weight"}  # fmt: skip
    assert set(quantized) == expected_quantized


def test_configs_as_published(demo_quantized: dict[str, Path]) -> None:
    fp8 = json.loads((demo_quantized["fp8"] / "config.json").read_text())["quantization_config"]
    assert {k: fp8[k] for k in ("quant_method", "fmt", "weight_block_size", "activation_scheme")} == {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
    }  # fmt: skip
    assert "lm_head" in fp8["modules_to_not_convert"] and "model.layers.0.mlp.gate" in fp8["modules_to_not_convert"]
    assert all(is_excluded(m) for m in fp8["modules_to_not_convert"])
    hf = json.loads((demo_quantized["nvfp4"] / "hf_quant_config.json").read_text())
    assert set(hf) == {"producer", "quantization"}
    assert hf["quantization"]["quant_algo"] == "NVFP4" and hf["quantization"]["group_size"] == 16
    assert hf["quantization"]["exclude_modules"] == fp8["modules_to_not_convert"]
    nv = json.loads((demo_quantized["nvfp4"] / "config.json").read_text())["quantization_config"]
    assert nv["quant_method"] == "modelopt"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (demo_quantized["fp8"] / name).read_bytes() == (DEMO_DIR / name).read_bytes()


def independent_dequantize(checkpoint: Checkpoint, name: str, method: str) -> np.ndarray:
    """ml_dtypes decode of the stored parts (independent of atlas.quant)."""
    base = name[: -len("weight")]
    if method == "fp8":
        w = checkpoint.get_raw(name).astype(np.float32)
        scale = checkpoint.get(base + "weight_scale_inv")
        rows, cols = np.indices(w.shape)
        return w * scale[rows // 128, cols // 128]
    packed = checkpoint.get_raw(name)
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)  # [N, K]
    elements = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scale = checkpoint.get_raw(base + "weight_scale").astype(np.float32)
    return (elements * np.repeat(scale, 16, axis=1)) * checkpoint.get(base + "weight_scale_2")


@pytest.mark.parametrize("method", ["fp8", "nvfp4"])
def test_round_trip(demo_quantized: dict[str, Path], method: str) -> None:
    source, out = Checkpoint.open(DEMO_DIR), Checkpoint.open(demo_quantized[method])
    view = QuantizedTensors.of(out)
    names = [n for n in source.names() if view.holds(n)]
    assert names
    tolerance = {"fp8": 0.07, "nvfp4": 0.2}[method]  # of the tensor's largest magnitude
    for name in names:
        original = source.get(name)
        ours = view.weight(name).dequantize()
        assert np.array_equal(ours, independent_dequantize(out, name, method)), name
        assert np.abs(ours - original).max() <= tolerance * np.abs(original).max(), name
        assert np.linalg.norm(ours - original) < {"fp8": 0.05, "nvfp4": 0.15}[method] * np.linalg.norm(original)


def test_fused_nested_source_is_written_per_expert(tmp_path: Path) -> None:
    tiny = TinyModel(nested=True, layout="fused", dtype="bfloat16", num_experts=4)
    write_checkpoint(tmp_path / "src", tiny, int.from_bytes(os.urandom(4), "little"))
    assert main(["--model", str(tmp_path / "src"), "--to", "fp8", "--out", str(tmp_path / "fp8"), "--shard-mb", "1"]) == 0
    source, out = Checkpoint.open(tmp_path / "src"), Checkpoint.open(tmp_path / "fp8")
    view = QuantizedTensors.of(out)
    base = "model.language_model.layers.1.mlp.experts."
    gate_up, down = source.get(base + "gate_up_proj"), source.get(base + "down_proj")
    half = gate_up.shape[1] // 2
    for e in range(tiny.num_experts):
        pairs = [("gate_proj", gate_up[e, :half]), ("up_proj", gate_up[e, half:]), ("down_proj", down[e])]
        for proj, original in pairs:
            ours = view.weight(f"{base}{e}.{proj}.weight").dequantize()
            assert np.abs(ours - original).max() <= np.abs(original).max() / 14
    assert not any(n.endswith("gate_up_proj") for n in out.names())
    assert any(n.startswith("model.visual.") for n in out.names())  # kept, unquantized
    assert all(out.dtype(n) != "F8_E4M3" for n in out.names() if n.startswith("model.visual."))


def test_bad_input_is_one_line(tmp_path: Path, demo_quantized: dict[str, Path]) -> None:
    (tmp_path / "exists").mkdir()
    cases = [
        (["--to", "fp8", "--out", str(tmp_path / "exists")], "already exists"),
        (["--to", "fp8", "--out", str(tmp_path / "no" / "such")], "does not exist"),
        (["--model", str(demo_quantized["fp8"]), "--to", "nvfp4", "--out", str(tmp_path / "x")], "already quantized (fp8)"),
        (["--model", str(tmp_path / "exists"), "--to", "fp8", "--out", str(tmp_path / "y")], "config.json"),
        (["--to", "int4", "--out", str(tmp_path / "z")], "--to"),
        (["--to", "fp8", "--out", "~no-such-user-atlas/out"], "names no home directory"),
        (["--to", "fp8", "--out", str(tmp_path / ("x" * 300))], "File name too long"),
        (["--to", "fp8", "--out", str(tmp_path / "exists" / "file.txt" / "out")], "is a file, not a directory"),
        (["--model", str(tmp_path / ("m" * 300)), "--to", "fp8", "--out", str(tmp_path / "w")], "File name too long"),
    ]
    (tmp_path / "exists" / "file.txt").write_text("")
    for args, needle in cases:
        done = quantize_cli(*args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and needle in lines[0], (args, done.stderr)
        assert "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]
    assert [p.name for p in (tmp_path / "exists").iterdir()] == ["file.txt"]


def test_a_source_atlas_run_would_refuse_is_refused_before_writing(tmp_path: Path) -> None:
    """A checkpoint whose tensors do not match its config: one line, exit 2, nothing written (the
    check loading makes, before any weight is converted); an --out that is a dangling link too."""
    from _demo_copy import demo_copy

    shapes = demo_copy(tmp_path / "shapes")
    config = json.loads((shapes / "config.json").read_text())
    text = config.get("text_config", config)
    text["vocab_size"] += 8
    (shapes / "config.json").write_text(json.dumps(config))
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    cases = [(["--model", str(shapes), "--out", str(tmp_path / "a")], "expected ["),
             (["--out", str(tmp_path / "dangling")], "a link to a missing path")]
    for args, needle in cases:
        done = quantize_cli("--to", "fp8", *args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and needle in lines[0], (args, done.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "shapes"]


@pytest.mark.parametrize("failure", [KeyboardInterrupt, MemoryError])
def test_a_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: type[BaseException]) -> None:
    import atlas.quant.convert as convert

    calls = []
    real = convert.quantized_parts

    def failing(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) > 5:
            raise failure()
        return real(*args, **kwargs)

    monkeypatch.setattr(convert, "quantized_parts", failing)
    out = tmp_path / "out"
    if failure is KeyboardInterrupt:
        assert main(["--to", "nvfp4", "--out", str(out), "--shard-mb", "1"]) == 130
    else:
        with pytest.raises(MemoryError):
            main(["--to", "nvfp4", "--out", str(out), "--shard-mb", "1"])
    assert len(calls) > 5 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGHUP])
def test_a_termination_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, number: int) -> None:
    """kill / timeout / docker stop (SIGTERM) or a closed terminal (SIGHUP) mid-write had left the
    staging directory and its shards behind: their default ends the process before any cleanup."""
    import atlas.quant.convert as convert

    calls = []
    real = convert.quantized_parts

    def signalled(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 6:
            os.kill(os.getpid(), number)  # the handler runs at the next bytecode: inside the write
        return real(*args, **kwargs)

    monkeypatch.setattr(convert, "quantized_parts", signalled)
    inherited = signal.signal(number, signal.SIG_DFL)  # under nohup SIGHUP is ignored, and so kept ignored
    try:
        with pytest.raises(SystemExit) as ended:
            main(["--to", "nvfp4", "--out", str(tmp_path / "out"), "--shard-mb", "1"])
        assert signal.getsignal(number) is signal.SIG_DFL  # put back after the write
    finally:
        signal.signal(number, inherited)
    assert ended.value.code == 128 + number and list(tmp_path.iterdir()) == []


def test_a_full_disk_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    import atlas.quant.writer as writer

    def full_disk(path: Path, tensors: dict[str, object]) -> None:
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(writer, "write_safetensors", full_disk)
    assert main(["--to", "fp8", "--out", str(tmp_path / "out"), "--shard-mb", "1"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("atlas.quantize: error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0] and "--out" in errors[0], err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("method", ["fp8", "nvfp4"])
def test_computed_weight_memory_matches_the_files(demo_quantized: dict[str, Path], method: str) -> None:
    from atlas.config import load_spec
    from atlas.quant.memory import qwen3_6_spec, weight_bytes

    spec = load_spec(DEMO_DIR)
    for directory, fmt in ((DEMO_DIR, "bf16"), (demo_quantized[method], method)):
        checkpoint = Checkpoint.open(directory)
        assert weight_bytes(spec, fmt) == sum(checkpoint.info(n).nbytes for n in checkpoint.names())
    full = qwen3_6_spec()
    assert weight_bytes(full, method) < weight_bytes(full, "bf16") / {"fp8": 1.9, "nvfp4": 3.2}[method]


def test_memory_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from atlas.quant.memory import main as memory_main

    assert memory_main(["--model", str(DEMO_DIR)]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert rows[0] == "| model | bf16 | fp8 | nvfp4 |" and len(rows) == 3 and rows[2].startswith(f"| {DEMO_DIR} |")
    for argv, needle in [(["--model", str(tmp_path / "none")], "no such directory"), (["--bogus"], "--bogus")]:
        assert memory_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("atlas.quant.memory: error:") and needle in err[0], err


@pytest.mark.parametrize(("method", "suffix", "value"), [
    ("fp8", "weight_scale_inv", np.nan), ("fp8", "weight_scale_inv", np.inf), ("fp8", "weight_scale_inv", -0.5),
    ("nvfp4", "weight_scale", np.nan), ("nvfp4", "weight_scale_2", -np.inf), ("nvfp4", "weight_scale", -2.0),
    ("nvfp4", "weight_scale_2", -1e-3),
])
def test_a_non_finite_or_negative_scale_is_one_line(tmp_path: Path, demo_quantized: dict[str, Path],
                                                    rng: np.random.Generator, method: str, suffix: str,
                                                    value: float) -> None:
    """A NaN / inf scale makes its block garbage and a negative one flips its signs, without a
    word: loading names it instead."""
    import shutil

    from atlas import LLM
    from atlas.errors import AtlasError

    copy = tmp_path / method
    shutil.copytree(demo_quantized[method], copy)
    checkpoint = Checkpoint.open(copy)
    part = str(rng.choice(sorted(n for n in checkpoint.names() if n.endswith("." + suffix))))
    info = checkpoint.info(part)
    checkpoint.close()
    stored = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F8_E4M3": ml_dtypes.float8_e4m3fn}[info.dtype]
    data = np.array([value], dtype=stored).tobytes()
    with open(info.path, "r+b") as handle:  # the tensor's first element
        handle.seek(info.start)
        handle.write(data)
    problem = "a negative scale" if value < 0 and np.isfinite(value) else "a NaN or infinite scale"
    with pytest.raises(AtlasError, match=f"'{part}' in .* holds {problem}"):
        LLM(str(copy), device="cpu")
