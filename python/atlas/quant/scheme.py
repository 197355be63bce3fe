"""The quantization scheme of a checkpoint directory, read from its published config files.

fp8:   config.json quantization_config {quant_method: "fp8", fmt: "e4m3", weight_block_size:
       [128, 128], activation_scheme: "dynamic", modules_to_not_convert: [...]}
nvfp4: hf_quant_config.json {producer, quantization: {quant_algo: "NVFP4", group_size: 16,
       exclude_modules: [...]}} and/or quantization_config {quant_method: "modelopt", ...}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..config import read_json_object
from ..errors import AtlasError
from .nvfp4 import GROUP_SIZE

Method = Literal["bf16", "fp8", "nvfp4"]
FP8_BLOCK = (128, 128)


@dataclass(frozen=True)
class QuantScheme:
    method: Method
    block: tuple[int, int] = FP8_BLOCK  # fp8 weight_block_size [rows, cols]
    group_size: int = GROUP_SIZE  # nvfp4 elements per e4m3 scale
    excluded: tuple[str, ...] = field(default=())  # modules left unquantized, as the files name them


def quantization_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    config = read_json_object(path) if path.is_file() else {}
    section = config.get("quantization_config")
    if section is None and isinstance(config.get("text_config"), dict):
        section = config["text_config"].get("quantization_config")
    return section if isinstance(section, dict) else {}


def string_list(value: object, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AtlasError(f"{where} must be a list of module names; fix the checkpoint's config")
    return tuple(value)


def fp8_scheme(model_dir: Path) -> QuantScheme:
    qc = quantization_config(model_dir)
    where = f"{model_dir / 'config.json'} quantization_config"
    if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
        raise AtlasError(f"{where}.fmt is {qc.get('fmt')!r}; atlas reads e4m3 block-FP8 checkpoints")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise AtlasError(
            f"{where}.weight_block_size is {block!r}; atlas reads block-FP8 checkpoints "
            "(weight_block_size [rows, cols], e.g. [128, 128])"
        )
    activation = qc.get("activation_scheme", "dynamic")
    if activation != "dynamic":
        raise AtlasError(f"{where}.activation_scheme is {activation!r}; atlas reads 'dynamic' FP8 checkpoints")
    excluded = string_list(qc.get("modules_to_not_convert"), f"{where}.modules_to_not_convert")
    return QuantScheme("fp8", block=(block[0], block[1]), excluded=excluded)


def nvfp4_section(model_dir: Path) -> tuple[dict[str, Any], str]:
    """The quantization settings and where they were found (hf_quant_config.json first)."""
    hf_path = model_dir / "hf_quant_config.json"
    if hf_path.is_file():
        data = read_json_object(hf_path)
        section = data.get("quantization", data)
        if not isinstance(section, dict):
            raise AtlasError(
                f"{hf_path} quantization is {json.dumps(section)[:60]}, not an object; ModelOpt writes "
                '{"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": [...]} there'
            )
        return section, f"{hf_path} quantization"
    return quantization_config(model_dir), f"{model_dir / 'config.json'} quantization_config"


def nvfp4_scheme(model_dir: Path) -> QuantScheme:
    section, where = nvfp4_section(model_dir)
    algo = section.get("quant_algo", "NVFP4")
    if not isinstance(algo, str) or algo.upper() != "NVFP4":
        raise AtlasError(f"{where}.quant_algo is {algo!r}; atlas reads ModelOpt NVFP4 checkpoints")
    group = section.get("group_size", GROUP_SIZE)
    if group != GROUP_SIZE:
        raise AtlasError(f"{where}.group_size is {group!r}; NVFP4 uses groups of {GROUP_SIZE}")
    excluded = string_list(section.get("exclude_modules", section.get("ignore")), f"{where}.exclude_modules")
    return QuantScheme("nvfp4", excluded=excluded)


def read_scheme(model_dir: Path | str) -> QuantScheme:
    """The scheme of a checkpoint directory; AtlasError for a quantization atlas does not read."""
    from ..targets import recognise_quant

    model_dir = Path(model_dir)
    method = recognise_quant(model_dir)
    if method == "fp8":
        return fp8_scheme(model_dir)
    if method == "nvfp4":
        return nvfp4_scheme(model_dir)
    return QuantScheme("bf16")
