"""Random Qwen3.6-35B-A3B weights without a checkpoint, identical for atlas and transformers.

Every tensor is a function of its name: small ones are seeded normal draws made on the host;
large ones (experts, embeddings, big projections) are a seeded 1 Mi-element tile repeated, which
each side writes straight into device memory, so nothing of the ~70 GB passes through the host.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

LAZY_MIN_BYTES = 32 << 20  # float32 size from which a tensor is a repeated tile
HOST_ALWAYS = ("self_attn.q_proj.weight",)  # the loader splits it on the host: keep it real
TILE_ELEMENTS = 1 << 20
SEED = 20261129


def qwen_config(num_layers: int = 40) -> dict[str, Any]:
    """config.json of a qwen3_5_moe_text model with the Qwen3.6-35B-A3B dimensions."""
    from transformers import Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        num_hidden_layers=num_layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        eos_token_id=[], dtype="bfloat16",
    )
    return config.to_dict()


def write_config(model_dir: Path, num_layers: int = 40) -> dict[str, Any]:
    model_dir.mkdir(parents=True, exist_ok=True)
    config = qwen_config(num_layers)
    (model_dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return config


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(SEED + zlib.crc32(name.encode()))


def _scale(name: str, shape: tuple[int, ...]) -> float:
    return 1.0 / math.sqrt(shape[-1]) if len(shape) >= 2 else 0.1


def host_tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The small tensor `name` (float32)."""
    rng = _rng(name)
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, size=shape)).astype(np.float32)
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(_scale(name, shape))).astype(np.float32)


def tile(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The repeated tile of the large tensor `name` (float32, TILE_ELEMENTS or fewer)."""
    rng = _rng(name)
    count = min(TILE_ELEMENTS, math.prod(shape))
    return (rng.standard_normal(count, dtype=np.float32) * np.float32(_scale(name, shape))).astype(np.float32)


def is_lazy(name: str, shape: tuple[int, ...]) -> bool:
    return math.prod(shape) * 4 >= LAZY_MIN_BYTES and not name.endswith(HOST_ALWAYS)


@dataclass(frozen=True)
class _Info:
    shape: tuple[int, ...]
    dtype: str
    path: str
    nbytes: int


@dataclass
class SyntheticCheckpoint:
    """The Checkpoint interface the loader reads. Large tensors come back as untouched np.empty
    arrays registered in `lazy` (id -> name); the bench backend fills them on the device."""

    plan: dict[str, tuple[int, ...]]
    source: str = "synthetic"
    lazy: dict[int, tuple[str, np.ndarray]] = field(default_factory=dict)

    def names(self) -> list[str]:
        return list(self.plan)

    def __contains__(self, name: object) -> bool:
        return name in self.plan

    def info(self, name: str) -> _Info:
        shape = self.plan[name]
        return _Info(shape, "BF16", self.source, math.prod(shape) * 2)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.plan[name]

    def dtype(self, name: str) -> str:
        return "BF16"

    def get(self, name: str) -> np.ndarray:
        shape = self.plan[name]
        if not is_lazy(name, shape):
            return host_tensor(name, shape)
        array = np.empty(shape, dtype=np.float32)  # never touched: no host memory is used
        self.lazy[id(array)] = (name, array)
        return array

    def close(self) -> None:
        self.lazy.clear()


def text_plan(spec: Any) -> dict[str, tuple[int, ...]]:
    from atlas.models.qwen3_5_moe import Layout, model_plan

    return model_plan(Layout("model.", True, spec))


def fill_torch_model(model: Any) -> None:
    """Write the same synthetic values into a transformers model's parameters (on its device)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            if is_lazy(name, shape):
                pattern = torch.from_numpy(tile(name, shape)).to(param.device).to(param.dtype)
                flat = param.view(-1)
                repeats = -(-flat.numel() // pattern.numel())
                flat.copy_(pattern.repeat(repeats)[: flat.numel()])
            else:
                param.copy_(torch.from_numpy(host_tensor(name, shape)).to(param.dtype))
