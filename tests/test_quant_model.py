"""Quantized checkpoints on the numpy backend: the trained demo keeps its top-1 choices, random
tiny checkpoints run exactly the dequantized weights, a backend's upload_quantized hook gets the
packed parts, and broken quantized checkpoints fail with one line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from _checkpoints import TinyModel, write_checkpoint
from atlas.backends.numpy_backend import NumpyBackend
from atlas.config import load_spec
from atlas.demo import DEMO_DIR, zen_of_python
from atlas.engine import Engine
from atlas.errors import AtlasError
from atlas.quant.stored import QuantizedTensors, QuantizedWeight
from atlas.quant.writer import write_safetensors
from atlas.quantize import QuantizeArgs, quantize
from atlas.safetensors import Checkpoint
from atlas.tokenizer import Tokenizer

METHODS = ("fp8", "nvfp4")
MIN_TOP1_AGREEMENT = 0.95
PART_SUFFIXES = ("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale")


def engine(model_dir: Path, backend: NumpyBackend | None = None) -> Engine:
    return Engine(load_spec(model_dir), Checkpoint.open(model_dir), backend or NumpyBackend(), max_seq_len=256)


def quantized_copy(source: Path, out: Path, method: str) -> Path:
    return quantize(QuantizeArgs(str(source), method, out, 1 << 30))


@pytest.fixture(scope="module")
def demo_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("demo-quantized")
    return {method: quantized_copy(DEMO_DIR, out / method, method) for method in METHODS}


@pytest.mark.parametrize("method", METHODS)
def test_demo_keeps_its_top1_choices(demo_dirs: dict[str, Path], method: str) -> None:
    tokenizer = Tokenizer.open(DEMO_DIR)
    zen = tokenizer.encode(zen_of_python(), add_special_tokens=False)
    chat = tokenizer.encode_chat([{"role": "user", "content": "Recite the Zen of Python."}])
    for ids in (zen, (chat + zen)[:255]):  # what it was trained on: the Zen, and a ChatML turn
        reference = engine(DEMO_DIR).logits(ids).argmax(axis=-1)  # [T]
        ours = engine(demo_dirs[method]).logits(ids).argmax(axis=-1)
        agreement = float((ours == reference).mean())
        print(f"{method}: top-1 agreement {agreement:.3f} over {len(ids)} tokens")
        assert agreement >= MIN_TOP1_AGREEMENT


def dequantized_checkpoint(quantized_dir: Path, out: Path) -> Path:
    """The same model as a float32 checkpoint of the dequantized weights (no quantization_config)."""
    checkpoint = Checkpoint.open(quantized_dir)
    view = QuantizedTensors.of(checkpoint)
    tensors = {
        name: view.weight(name).dequantize() if view.holds(name) else np.array(checkpoint.get(name))
        for name in checkpoint.names()
        if not name.endswith(PART_SUFFIXES)
    }
    out.mkdir()
    write_safetensors(out / "model.safetensors", tensors)
    config = json.loads((quantized_dir / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


TINY_CASES = {
    "flat-per_expert-sharded": TinyModel(dtype="bfloat16", max_shard_size="200KB"),
    "nested-fused-tied-h128": TinyModel(
        nested=True, layout="fused", dtype="bfloat16", tie_word_embeddings=True, hidden_size=128,
        moe_intermediate_size=128, shared_expert_intermediate_size=144, num_experts=4,
    ),
}  # fmt: skip


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", sorted(TINY_CASES))
def test_random_tiny_runs_the_dequantized_weights(tmp_path: Path, case: str, method: str) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"checkpoint seed: {seed}")
    tiny = TINY_CASES[case]
    write_checkpoint(tmp_path / "src", tiny, seed)
    assert (tmp_path / "src" / "model.safetensors.index.json").is_file() == bool(tiny.max_shard_size)
    quantized = quantized_copy(tmp_path / "src", tmp_path / method, method)
    plain = dequantized_checkpoint(quantized, tmp_path / "plain")
    ids = np.random.default_rng(seed).integers(0, tiny.vocab_size, 70).tolist()
    ours, expected = engine(quantized).logits(ids), engine(plain).logits(ids)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    source = engine(tmp_path / "src").logits(ids)
    assert not np.allclose(ours, source, rtol=1e-3)  # the weights really are quantized


class PackedRecorder(NumpyBackend):
    """A backend that takes quantized weights packed (it dequantizes them itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[QuantizedWeight] = []

    def upload_quantized(self, weight: QuantizedWeight) -> np.ndarray:
        self.received.append(weight)
        return weight.dequantize()


@pytest.mark.parametrize("method", METHODS)
def test_upload_quantized_hook(demo_dirs: dict[str, Path], method: str) -> None:
    backend = PackedRecorder()
    ids = Tokenizer.open(DEMO_DIR).encode(zen_of_python())[:60]
    packed_logits = engine(demo_dirs[method], backend).logits(ids)
    names = {w.name for w in backend.received}
    assert "model.layers.3.self_attn.o_proj.weight" in names and "model.layers.0.linear_attn.out_proj.weight" in names
    assert "model.layers.3.self_attn.k_proj.weight" not in names  # fused with q / gate / v: no row hook here
    assert all(w.method == method and w.parts["weight"].dtype.itemsize == 1 for w in backend.received)
    assert not any("mlp.gate." in n or "embed_tokens" in n for n in names)
    np.testing.assert_array_equal(packed_logits, engine(demo_dirs[method]).logits(ids))


def broken_copy(source: Path, out: Path, edit: str) -> Path:
    shutil.copytree(source, out)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    checkpoint = Checkpoint.open(source)
    tensors = {n: np.array(checkpoint.get_raw(n)) for n in checkpoint.names()}
    scale = "model.layers.3.self_attn.k_proj.weight_scale_inv"
    if edit == "missing scale":
        del tensors[scale]
    elif edit == "scale shape":
        tensors[scale] = np.ones((2, 2), np.float32)
    elif edit == "block size":
        config["quantization_config"]["weight_block_size"] = None
    elif edit == "activation scheme":
        config["quantization_config"]["activation_scheme"] = "static"
    write_safetensors(out / "model.safetensors", tensors)
    config_path.write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    "edit,needle",
    [("missing scale", "weight_scale_inv' is missing"), ("scale shape", "expected [1, 1]"),
     ("block size", "weight_block_size"), ("activation scheme", "activation_scheme")],
)  # fmt: skip
def test_broken_fp8_checkpoint_is_one_line(demo_dirs: dict[str, Path], tmp_path: Path, edit: str, needle: str) -> None:
    broken = broken_copy(demo_dirs["fp8"], tmp_path / "broken", edit)
    with pytest.raises(AtlasError) as err:
        engine(broken)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "edit,needle",
    [("quantization not an object", "quantization is \"NVFP4\", not an object"),
     ("input_scale shape", "input_scale' in .* is not one F32 value"),
     ("input_scale dtype", "input_scale' in .* is not one F32 value")],
)  # fmt: skip
def test_broken_nvfp4_checkpoint_is_one_line(demo_dirs: dict[str, Path], tmp_path: Path, edit: str, needle: str) -> None:
    """ModelOpt's files, each broken one way: an odd `quantization` had silently fallen back to
    config.json, and an input_scale of any shape or dtype had been accepted."""
    copy = tmp_path / "nvfp4"
    shutil.copytree(demo_dirs["nvfp4"], copy)
    if edit == "quantization not an object":
        hf_path = copy / "hf_quant_config.json"
        hf_path.write_text(json.dumps({**json.loads(hf_path.read_text()), "quantization": "NVFP4"}))
    else:
        checkpoint = Checkpoint.open(copy)
        tensors = {n: np.array(checkpoint.get_raw(n)) for n in checkpoint.names()}
        checkpoint.close()
        scale = "model.layers.3.self_attn.o_proj.input_scale"
        assert scale in tensors
        tensors[scale] = np.ones(2, np.float32) if edit == "input_scale shape" else np.ones((), np.float16)
        for stale in copy.glob("*.safetensors*"):
            stale.unlink()
        write_safetensors(copy / "model.safetensors", tensors)
    with pytest.raises(AtlasError, match=needle) as err:
        engine(copy)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("group_size,needle", [(32, "group_size is 32"), (16, None)])
def test_nvfp4_group_size(demo_dirs: dict[str, Path], tmp_path: Path, group_size: int, needle: str | None) -> None:
    copy = tmp_path / "nvfp4"
    shutil.copytree(demo_dirs["nvfp4"], copy)
    hf_path = copy / "hf_quant_config.json"
    hf = json.loads(hf_path.read_text())
    hf["quantization"]["group_size"] = group_size
    hf_path.write_text(json.dumps(hf))
    if needle is None:
        engine(copy)
        return
    with pytest.raises(AtlasError, match=needle):
        engine(copy)
