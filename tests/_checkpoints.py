"""Random tiny qwen3_5_moe checkpoints written by transformers' save_pretrained (test helper).

Every parameter is drawn afresh (norm weights, A_log, dt_bias and the router included: transformers
initialises some of them to constants, which would hide bugs), scaled so activations stay O(1)
and logits are spread enough that greedy choices are not near-ties.

    tiny = TinyModel(nested=True, layout="fused", dtype="bfloat16")
    reference = write_checkpoint(tmp_dir, tiny, seed)   # float32 torch model, same weights as saved
"""

from __future__ import annotations

import copy
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import pytest
import torch

Layout = Literal["per_expert", "fused"]


@dataclass(frozen=True)
class TinyModel:
    vocab_size: int = 160
    hidden_size: int = 64
    num_hidden_layers: int = 4
    full_attention_interval: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000.0
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 48
    tie_word_embeddings: bool = False
    nested: bool = False  # Qwen3_5MoeForConditionalGeneration with a qwen3_5_moe config
    layout: Layout = "per_expert"  # what save_pretrained writes; "fused" rewrites the experts
    dtype: Literal["float32", "bfloat16"] = "float32"
    max_shard_size: str | None = None  # e.g. "300KB" for a sharded checkpoint (per_expert only)
    rope_yarn: tuple[tuple[str, float], ...] = ()  # YaRN's rope_parameters (factor, ...); (): plain RoPE

    def text_config(self) -> dict[str, object]:
        fields = asdict(self)
        for key in ("nested", "layout", "dtype", "max_shard_size", "full_attention_interval", "partial_rotary_factor", "rope_theta", "rope_yarn"):
            fields.pop(key)
        layer_types = [
            "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
            for i in range(self.num_hidden_layers)
        ]
        rope = {"rope_type": "yarn" if self.rope_yarn else "default", "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor, **dict(self.rope_yarn)}
        return {**fields, "layer_types": layer_types, "rope_parameters": rope, "max_position_embeddings": 1024}


def build_model(tiny: TinyModel) -> torch.nn.Module:
    from transformers import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5MoeTextConfig,
    )

    text = tiny.text_config()
    if not tiny.nested:
        return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text))
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": tiny.hidden_size}
    config = Qwen3_5MoeConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=tiny.tie_word_embeddings
    )
    return Qwen3_5MoeForConditionalGeneration(config)


def random_value(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """A fresh draw for one parameter, scaled by its role."""
    normal = torch.randn(shape, generator=gen)
    uniform = torch.rand(shape, generator=gen)
    if name.endswith("linear_attn.norm.weight"):
        return 0.5 + uniform  # used as stored
    if name.endswith("norm.weight"):
        return 0.3 * normal  # zero-centred: the model multiplies by 1 + w
    if name.endswith("A_log"):
        return torch.log(0.05 + 2.0 * uniform)
    if name.endswith("dt_bias"):
        return 0.5 * normal
    if name.endswith("conv1d.weight"):
        return 0.5 * normal
    if name.endswith("embed_tokens.weight"):
        return 0.5 * normal  # also the lm_head when tied: logits of a few units
    if name == "lm_head.weight":
        return 4.0 * normal / shape[-1] ** 0.5
    if name.endswith("mlp.gate.weight"):
        return 2.0 * normal / shape[-1] ** 0.5  # router: distinct expert probabilities
    return normal / shape[-1] ** 0.5


def randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(random_value(name, param.shape, gen))


def fuse_experts(model_dir: Path) -> None:
    """Rewrite per-expert tensors as the fused layout: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    prefixes = sorted({n.split("mlp.experts.")[0] for n in tensors if ".mlp.experts." in n})
    for prefix in prefixes:
        base = f"{prefix}mlp.experts."
        count = len({n for n in tensors if n.startswith(base) and n.endswith(".down_proj.weight")})
        gate_up = [torch.cat([tensors.pop(f"{base}{e}.gate_proj.weight"), tensors.pop(f"{base}{e}.up_proj.weight")]) for e in range(count)]
        down = [tensors.pop(f"{base}{e}.down_proj.weight") for e in range(count)]
        tensors[f"{base}gate_up_proj"] = torch.stack(gate_up).contiguous()
        tensors[f"{base}down_proj"] = torch.stack(down).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def write_checkpoint(model_dir: Path, tiny: TinyModel, seed: int) -> torch.nn.Module:
    """Save a random tiny checkpoint to model_dir; return the float32 reference model (eval mode)
    holding exactly the saved values (bf16 checkpoints: the bf16-rounded weights, while buffers
    such as the rotary frequencies stay float32 as a float32 load would compute them)."""
    torch.manual_seed(seed)
    model = build_model(tiny)
    randomise(model, seed)
    saved = model
    if tiny.dtype == "bfloat16":
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(torch.bfloat16).to(torch.float32))
        saved = copy.deepcopy(model).to(torch.bfloat16)
    kwargs = {"max_shard_size": tiny.max_shard_size} if tiny.max_shard_size else {}
    saved.save_pretrained(model_dir, **kwargs)
    if tiny.layout == "fused":
        if tiny.max_shard_size:
            raise ValueError("the fused rewrite handles single-file checkpoints only")
        fuse_experts(Path(model_dir))
    return model.eval()


def random_checkpoint_dir(tmp_path_factory: pytest.TempPathFactory, name: str, tiny: TinyModel) -> Path:
    """A new directory holding `tiny` at a fresh random seed (printed, to reproduce a failure)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"checkpoint seed: {seed}")
    path = tmp_path_factory.mktemp(name)
    write_checkpoint(path, tiny, seed)
    return path
