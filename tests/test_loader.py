"""Loader: checkpoint names -> layer weights, conventions, and one-line errors for bad checkpoints."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from _checkpoints import TinyModel, fuse_experts, write_checkpoint
from atlas.backends.numpy_backend import NumpyBackend
from atlas.config import load_spec
from atlas.errors import AtlasError
from atlas.layers.attention import Attention
from atlas.layers.decoder import CausalLM
from atlas.layers.linear_attention import GatedDeltaNet
from atlas.layers.split_linear import SplitLinear
from atlas.models import load_model
from atlas.safetensors import Checkpoint


class RecordingBackend(NumpyBackend):
    """The numpy backend, remembering the storage hint of every upload."""

    def __init__(self) -> None:
        self.uploads: list[tuple[tuple[int, ...], str]] = []

    def upload(self, array: np.ndarray, dtype: str) -> np.ndarray:  # type: ignore[override]
        self.uploads.append((tuple(array.shape), dtype))
        return super().upload(array, dtype)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"checkpoint seed: {seed}")
    model_dir = tmp_path_factory.mktemp("base")
    return model_dir, write_checkpoint(model_dir, TinyModel(), seed)


@pytest.fixture
def model_dir(base: tuple[Path, torch.nn.Module], tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(base[0], copy)
    return copy


def load(model_dir: Path, backend: NumpyBackend | None = None) -> CausalLM:
    return load_model(load_spec(model_dir), Checkpoint.open(model_dir), backend or NumpyBackend())


def rewrite(model_dir: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def edit_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def one_line_error(model_dir: Path, *fragments: str) -> str:
    with pytest.raises(AtlasError) as info:
        load(model_dir)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def assert_fused(fused: SplitLinear, parts: list[np.ndarray]) -> None:
    """A float checkpoint's input projections are one weight: the parts stacked in order."""
    assert len(fused.groups) == 1 and fused.widths == tuple(len(p) for p in parts)
    np.testing.assert_array_equal(fused.groups[0].weight, np.concatenate(parts))


def test_conventions_match_transformers_parameters(base: tuple[Path, torch.nn.Module]) -> None:
    model_dir, reference = base
    model = load(model_dir)
    ref_layers = reference.model.layers
    for layer, ref in zip(model.layers, ref_layers):
        np.testing.assert_array_equal(layer.input_norm.weight, 1.0 + ref.input_layernorm.weight.detach().numpy())
        np.testing.assert_array_equal(layer.ffn.gate_up, ref.mlp.experts.gate_up_proj.detach().numpy())
        np.testing.assert_array_equal(layer.ffn.down, ref.mlp.experts.down_proj.detach().numpy())
        if isinstance(layer.mixer, Attention):
            dims = layer.mixer.dims
            q_proj = ref.self_attn.q_proj.weight.detach().numpy().reshape(dims.num_heads, 2 * dims.head_dim, -1)
            query, gate = (q_proj[:, half].reshape(dims.num_heads * dims.head_dim, -1)
                           for half in (slice(None, dims.head_dim), slice(dims.head_dim, None)))
            k, v = (getattr(ref.self_attn, n).weight.detach().numpy() for n in ("k_proj", "v_proj"))
            assert_fused(layer.mixer.weights.qgkv, [query, gate, k, v])
        else:
            assert isinstance(layer.mixer, GatedDeltaNet)
            attn = ref.linear_attn
            parts = [getattr(attn, f"in_proj_{n}").weight.detach().numpy() for n in ("qkv", "z", "b", "a")]
            assert_fused(layer.mixer.weights.in_proj, parts)
            np.testing.assert_array_equal(layer.mixer.weights.norm.weight, ref.linear_attn.norm.weight.detach().numpy())
            np.testing.assert_array_equal(layer.mixer.weights.conv, ref.linear_attn.conv1d.weight.detach().numpy()[:, 0])
    np.testing.assert_array_equal(model.lm_head.weight, reference.lm_head.weight.detach().numpy())


def test_fused_and_per_expert_layouts_load_the_same(model_dir: Path, tmp_path: Path) -> None:
    fused_dir = tmp_path / "fused"
    shutil.copytree(model_dir, fused_dir)
    fuse_experts(fused_dir)
    assert "model.layers.0.mlp.experts.gate_up_proj" in Checkpoint.open(fused_dir)
    per_expert, fused = load(model_dir), load(fused_dir)
    for a, b in zip(per_expert.layers, fused.layers):
        np.testing.assert_array_equal(a.ffn.gate_up, b.ffn.gate_up)
        np.testing.assert_array_equal(a.ffn.down, b.ffn.down)


def test_upload_hints_matrices_bf16_vectors_f32(model_dir: Path) -> None:
    backend = RecordingBackend()
    load(model_dir, backend)
    assert backend.uploads
    for shape, dtype in backend.uploads:
        assert dtype == ("bf16" if len(shape) >= 2 else "f32"), (shape, dtype)


def test_mtp_and_vision_tensors_are_skipped(model_dir: Path) -> None:
    def add_extras(tensors: dict[str, torch.Tensor]) -> None:
        tensors["mtp.fc.weight"] = torch.randn(3, 5)
        tensors["model.visual.patch_embed.proj.weight"] = torch.randn(2, 7)

    rewrite(model_dir, add_extras)
    assert len(load(model_dir).layers) == TinyModel().num_hidden_layers


def test_missing_tensor(model_dir: Path) -> None:
    rewrite(model_dir, lambda t: t.pop("model.layers.1.mlp.shared_expert_gate.weight"))
    one_line_error(model_dir, "'model.layers.1.mlp.shared_expert_gate.weight'", "missing", "model.safetensors", "[1, 64]")


def test_missing_expert(model_dir: Path) -> None:
    rewrite(model_dir, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    one_line_error(model_dir, "'model.layers.2.mlp.experts.5.up_proj.weight'", "missing")


def test_shape_mismatch_names_tensor_shapes_and_file(model_dir: Path) -> None:
    rewrite(model_dir, lambda t: t.__setitem__("model.layers.0.linear_attn.A_log", torch.zeros(5)))
    one_line_error(model_dir, "'model.layers.0.linear_attn.A_log'", "[5]", "[4]", str(model_dir / "model.safetensors"))


def test_config_that_does_not_match_the_weights(model_dir: Path) -> None:
    edit_config(model_dir, moe_intermediate_size=16)
    one_line_error(model_dir, "mlp.experts.0", "[32, 64]", "[16, 64]")


def test_untied_config_needs_lm_head(model_dir: Path) -> None:
    rewrite(model_dir, lambda t: t.pop("lm_head.weight"))
    one_line_error(model_dir, "'lm_head.weight'", "missing")
    edit_config(model_dir, tie_word_embeddings=True)
    model = load(model_dir)
    assert model.lm_head.weight is model.embed.table


def test_unknown_prefix(model_dir: Path) -> None:
    def rename(tensors: dict[str, torch.Tensor]) -> None:
        for name in list(tensors):
            tensors["transformer." + name.removeprefix("model.")] = tensors.pop(name)

    rewrite(model_dir, rename)
    one_line_error(model_dir, "'model.language_model.embed_tokens.weight'", "'model.embed_tokens.weight'")


def test_quantized_dtype_is_refused(model_dir: Path) -> None:
    name = "model.layers.3.self_attn.k_proj.weight"
    rewrite(model_dir, lambda t: t.__setitem__(name, t[name].to(torch.float8_e4m3fn)))
    one_line_error(model_dir, repr(name), "F8_E4M3")


def test_attention_bias_is_refused(model_dir: Path) -> None:
    edit_config(model_dir, attention_bias=True)
    one_line_error(model_dir, "attention_bias")


def test_unknown_model_type_has_no_loader(model_dir: Path) -> None:
    spec = dataclasses.replace(load_spec(model_dir), model_type="llama")
    with pytest.raises(AtlasError, match="'llama' has no loader"):
        load_model(spec, Checkpoint.open(model_dir), NumpyBackend())
