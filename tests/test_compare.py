"""atlas.compare: passes the demo and unperturbed random tiny checkpoints, flags exactly the layer
whose weights were perturbed in atlas' copy, and answers bad input with one line and exit 2."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from _checkpoints import TinyModel, write_checkpoint
from _gpu import require_demo_cuda
from atlas.compare import BAND, compare_layers, first_failure, main
from atlas.oracle_trace import LayerTrace
from runtime_checkpoint import train_tokenizer

pytestmark = pytest.mark.oracle

PROMPT = "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex."
ROW = re.compile(r"^\s+(\d+)\s+(\w+)\s+([\d.]+)\s+([\d.-]+)\s+([\d.-]+)\s+([\d.-]+)(\s+<- outside)?$")


def tiny_checkpoint(model_dir: Path, tiny: TinyModel) -> Path:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"checkpoint seed: {seed}")
    write_checkpoint(model_dir, tiny, seed)
    train_tokenizer(model_dir, vocab_size=tiny.vocab_size)
    return model_dir


def layer_rows(out: str) -> list[tuple[int, float, float, bool]]:
    """(layer, norm ratio, cosine, flagged) of each table row."""
    return [
        (int(m[1]), float(m[3]), float(m[4]), m[7] is not None)
        for line in out.splitlines()
        if (m := ROW.match(line))
    ]


def assert_all_pass(out: str, layers: int) -> None:
    rows = layer_rows(out)
    assert [r[0] for r in rows] == list(range(layers))
    for _, ratio, cosine, flagged in rows:
        assert abs(ratio - 1) < 1e-4 and cosine > 1 - 1e-6 and not flagged
    assert "PASS" in out and "FLAGGED" not in out


def test_demo_passes(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert_all_pass(out, 4)


def test_unperturbed_nested_checkpoint_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny = TinyModel(vocab_size=320, nested=True, layout="fused", num_experts=12, num_experts_per_tok=3)
    model_dir = tiny_checkpoint(tmp_path / "nested", tiny)
    code = main(["--model", str(model_dir), "--prompt", PROMPT, "--device", "cpu", "--top-k", "5"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert_all_pass(out, tiny.num_hidden_layers)
    assert "top5_overlap" in out
    code = main(["--model", str(model_dir), "--prompt", PROMPT, "--device", "cpu", "--layers", "3"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert_all_pass(out, 3)


def perturb_layer(model_dir: Path, layer: int) -> str:
    """Shift one layer's zero-centred post-attention norm weight by 1 (its MLP input doubles)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    [key] = [k for k in tensors if k.endswith(f"layers.{layer}.post_attention_layernorm.weight")]
    tensors[key] = tensors[key] + 1.0
    save_file(tensors, path, metadata={"format": "pt"})
    return key


def test_perturbed_layer_is_flagged(tmp_path: Path, capsys: pytest.CaptureFixture[str], rng: np.random.Generator) -> None:
    tiny = TinyModel(vocab_size=320)
    original = tiny_checkpoint(tmp_path / "original", tiny)
    perturbed = tmp_path / "perturbed"
    shutil.copytree(original, perturbed)
    layer = int(rng.integers(0, tiny.num_hidden_layers))
    perturb_layer(perturbed, layer)
    argv = ["--model", str(perturbed), "--reference", str(original), "--prompt", PROMPT, "--device", "cpu"]
    if rng.random() < 0.5:  # a cut model flags the same layer
        argv += ["--layers", str(int(rng.integers(layer + 1, tiny.num_hidden_layers + 1)))]
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 1, out
    assert re.search(rf"^FIRST FLAGGED LAYER: {layer} \(", out, re.MULTILINE), out
    rows = layer_rows(out)
    assert len(rows) == (int(argv[-1]) if "--layers" in argv else tiny.num_hidden_layers)
    for index, ratio, cosine, flagged in rows[:layer]:
        assert abs(ratio - 1) < 1e-4 and cosine > 1 - 1e-6 and not flagged
    assert rows[layer][3]


def trace(outputs: list[np.ndarray]) -> LayerTrace:
    return LayerTrace(outputs, [None] * len(outputs), [None] * len(outputs), np.zeros((1, 1)))


def test_band_checks_norm_ratio_and_cosine(rng: np.random.Generator) -> None:
    """Layer 1 is scaled just outside the band; layer 2 is turned off-axis at an equal norm."""
    base = [rng.standard_normal((7, 16)) for _ in range(3)]
    low, high = BAND
    inside = base[0] * (low + high) / 2
    scaled = base[1] * (high + 0.002)
    noise = rng.standard_normal(base[2].shape)
    noise -= (noise * base[2]).sum() / (base[2] ** 2).sum() * base[2]  # orthogonal to base[2]
    turned = base[2] + 0.25 * noise * np.linalg.norm(base[2]) / np.linalg.norm(noise)
    turned *= np.linalg.norm(base[2]) / np.linalg.norm(turned)
    kinds = ("linear_attention",) * 3
    reports = compare_layers(trace([inside, scaled, turned]), trace(base), kinds, 10)
    assert [r.passes for r in reports] == [True, False, False]
    assert reports[2].norm_ratio == pytest.approx(1.0) and reports[2].cosine < low
    assert first_failure(reports) is reports[1]
    assert first_failure(reports[2:]) is reports[2]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--device", "tpu"], "--device"),
        (["--top-k", "0"], "--top-k"),
        (["--top-k", "many"], "--top-k"),
        (["--model", "/nonexistent/model-dir"], "/nonexistent/model-dir"),
        (["--layers", "0"], "--layers"),
        (["--layers", "5"], "--layers"),
    ],
)
def test_bad_input_is_one_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("atlas.compare: error:") and needle in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


def test_oracle_on_a_missing_gpu_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here")
    code = main(["--device", "cpu", "--oracle-device", "cuda"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--oracle-device cpu" in err[0]


def test_reference_of_another_architecture_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tiny_checkpoint(tmp_path / "other", TinyModel(vocab_size=320, num_hidden_layers=2))
    capsys.readouterr()  # the checkpoint writer's progress bar
    code = main(["--reference", str(other), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "num_hidden_layers" in err[0] and str(other) in err[0]


def test_prompt_is_required_beyond_the_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = tiny_checkpoint(tmp_path / "tiny", TinyModel(vocab_size=320, num_hidden_layers=2))
    capsys.readouterr()  # the checkpoint writer's progress bar
    code = main(["--model", str(model_dir), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--prompt" in err[0]


@pytest.mark.gpu
def test_demo_passes_on_the_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """The CUDA backend against transformers fp32 (on the GPU when torch sees one)."""
    require_demo_cuda()
    code = main(["--device", "cuda"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "on cuda" in out
    assert len(layer_rows(out)) == 4
