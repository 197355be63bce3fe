"""Random Qwen3.6-35B-A3B weights without a checkpoint, identical for atlas and transformers.

Every tensor is a function of its name: small ones are seeded normal draws made on the host;
large ones (experts, embeddings, big projections) are a seeded 1 Mi-element tile repeated, which
each side writes straight into device memory, so nothing of the ~70 GB passes through the host.
"""

from __future__ import annotations

import functools
import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

LAZY_MIN_BYTES = 32 << 20  # float32 size from which a tensor is a repeated tile
HOST_ALWAYS = ("self_attn.q_proj.weight", "mtp.fc.weight")  # the loaders split them on the host: keep them real
TILE_ELEMENTS = 1 << 20
SEED = 20261129
QWEN_LAYERS = 40  # Qwen3.6-35B-A3B's decoder layers


def qwen_config(num_layers: int = QWEN_LAYERS) -> dict[str, Any]:
    """config.json of a qwen3_5_moe_text model with the Qwen3.6-35B-A3B dimensions."""
    from transformers import Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        num_hidden_layers=num_layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        eos_token_id=[], dtype="bfloat16",
    )
    return config.to_dict()


def model_label(num_layers: int) -> str:
    """The benchmarks' "model" entry."""
    return f"qwen3.6-35b-a3b dims, {num_layers} layers, synthetic weights"


def write_config(model_dir: Path, num_layers: int = QWEN_LAYERS) -> dict[str, Any]:
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


# --- quantized weights (bench/quant.py) -------------------------------------------------------
# Every quantized matrix of a given (format, in-features) is one seeded QUANT_TILE_ROWS-row tile
# repeated down its rows. 128 rows is one fp8 scale block, so the repeat is itself a valid
# block-FP8 checkpoint, and every planned matrix (and every stack or row selection the loader
# makes of them) is a whole number of tiles: its device layout is the tile's, repeated.
QUANT_TILE_ROWS = 128
QUANT_FORMATS = ("fp8", "nvfp4")


def quant_tile_float(fmt: str, k: int) -> np.ndarray:
    """The float32 values [QUANT_TILE_ROWS, k] the tile quantizes: N(0, 1/k), as the bf16 tiles."""
    rng = _rng(f"quant-tile/{fmt}/{k}")
    return (rng.standard_normal((QUANT_TILE_ROWS, k), dtype=np.float32) * np.float32(1.0 / math.sqrt(k))).astype(np.float32)


@functools.lru_cache(maxsize=32)
def quant_tile_parts(fmt: str, k: int) -> dict[str, np.ndarray]:
    """The tile as a checkpoint stores it (atlas.quant's quantizers): fp8 {weight, weight_scale_inv},
    nvfp4 {weight, weight_scale, weight_scale_2, input_scale}. Cached: callers must not modify it."""
    from atlas.quant.fp8_block import quantize_fp8_block
    from atlas.quant.nvfp4 import quantize_nvfp4

    values = quant_tile_float(fmt, k)
    if fmt == "fp8":
        q = quantize_fp8_block(values)
        return {"weight": q.weight, "weight_scale_inv": q.scale_inv}
    if fmt == "nvfp4":
        n = quantize_nvfp4(values)
        return {"weight": n.weight, "weight_scale": n.weight_scale, "weight_scale_2": n.weight_scale_2,
                "input_scale": n.input_scale}
    raise ValueError(f"no synthetic quantized weights for {fmt!r} ({', '.join(QUANT_FORMATS)})")


def quant_checkpoint_parts(fmt: str, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """The checkpoint parts of a whole [rows, k] matrix (rows a multiple of QUANT_TILE_ROWS):
    the tile's codes and per-row-block scales repeated; scalars shared."""
    rows, k = shape
    if rows % QUANT_TILE_ROWS:
        raise ValueError(f"synthetic quantized matrices have a multiple of {QUANT_TILE_ROWS} rows, got {rows}")
    repeats = rows // QUANT_TILE_ROWS
    tile_parts = quant_tile_parts(fmt, k)
    return {name: np.tile(part, (repeats, 1)) if part.ndim == 2 else part for name, part in tile_parts.items()}


@functools.lru_cache(maxsize=32)
def quant_device_tile(fmt: str, k: int) -> Any:
    """The tile in the kernels' device layout (quant_weights.HostQuantWeight, QUANT_TILE_ROWS rows)."""
    from atlas.backends.cuda.quant_weights import from_fp8_block, from_nvfp4

    parts = quant_tile_parts(fmt, k)
    if fmt == "fp8":
        return from_fp8_block(parts["weight"], parts["weight_scale_inv"])
    return from_nvfp4(parts["weight"], parts["weight_scale"], parts["weight_scale_2"])


def quant_stored(fmt: str, name: str, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{checkpoint name: (dtype, shape)} of the parts a quantized `<m>.weight` [N, K] is stored as."""
    n, k = shape
    stem = name[: -len("weight")]
    if fmt == "fp8":
        return {name: ("F8_E4M3", (n, k)), stem + "weight_scale_inv": ("F32", (-(-n // 128), -(-k // 128)))}
    return {name: ("U8", (n, k // 2)), stem + "weight_scale": ("F8_E4M3", (n, k // 16)),
            stem + "weight_scale_2": ("F32", ()), stem + "input_scale": ("F32", ())}


@dataclass
class SyntheticQuantCheckpoint(SyntheticCheckpoint):
    """A quantized checkpoint of `plan` in `fmt` (the official exclusions, atlas.quant.exclusions)
    whose config files live in `source` (a directory). Float tensors as SyntheticCheckpoint.
    With host_parts the quantized parts are real arrays (quant_checkpoint_parts); without, they are
    zero-stride placeholders of the right shape that bench/quant.py's device upload never reads."""

    fmt: str = "fp8"
    host_parts: bool = False
    stored: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    part_of: dict[str, tuple[str, str]] = field(default_factory=dict)  # part name -> (weight name, suffix)

    def __post_init__(self) -> None:
        from atlas.quant.exclusions import converts

        for name, shape in self.plan.items():
            if not converts(name, shape, self.fmt):
                continue
            for part, entry in quant_stored(self.fmt, name, shape).items():
                self.stored[part] = entry
                self.part_of[part] = (name, part[len(name) - len("weight"):])

    def names(self) -> list[str]:
        return list(dict.fromkeys([*self.plan, *self.stored]))

    def __contains__(self, name: object) -> bool:
        return name in self.plan or name in self.stored

    def info(self, name: str) -> _Info:
        if name not in self.stored:
            return super().info(name)
        dtype, shape = self.stored[name]
        return _Info(shape, dtype, self.source, math.prod(shape) * (4 if dtype == "F32" else 1))

    def shape(self, name: str) -> tuple[int, ...]:
        return self.stored[name][1] if name in self.stored else self.plan[name]

    def dtype(self, name: str) -> str:
        return self.stored[name][0] if name in self.stored else "BF16"

    def get_raw(self, name: str) -> np.ndarray:
        if name not in self.stored:
            return self.get(name)
        dtype, shape = self.stored[name]
        if not self.host_parts:
            return np.broadcast_to(np.zeros((), np.float32 if dtype == "F32" else np.uint8), shape)
        weight, suffix = self.part_of[name]
        return quant_checkpoint_parts(self.fmt, self.plan[weight])[suffix]  # type: ignore[arg-type]


def write_quant_config(model_dir: Path, fmt: str, num_layers: int = QWEN_LAYERS) -> dict[str, Any]:
    """config.json (+ hf_quant_config.json for nvfp4) of the synthetic quantized checkpoint."""
    from atlas.quant.exclusions import EXCLUDED_MODULES
    from atlas.quantize import quant_configs

    config = write_config(model_dir, num_layers)
    quantization_config, hf_quant_config = quant_configs(fmt, list(EXCLUDED_MODULES))
    config["quantization_config"] = quantization_config
    (model_dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
    if hf_quant_config is not None:
        (model_dir / "hf_quant_config.json").write_text(json.dumps(hf_quant_config), encoding="utf-8")
    return config


def quant_plan(spec: Any) -> dict[str, tuple[int, ...]]:
    """The text plan with experts stored per expert (the layout quantized checkpoints use)."""
    from atlas.models.qwen3_5_moe import Layout, model_plan

    return model_plan(Layout("model.", False, spec))
