"""config.json -> ModelSpec (the typed view of a checkpoint's text model)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .errors import AtlasError
from . import json_text

LayerType = Literal["linear_attention", "full_attention"]

TEXT_MODEL_TYPE = "qwen3_5_moe_text"
NESTED_MODEL_TYPE = "qwen3_5_moe"
SUPPORTED_ROPE_TYPES = ("default", "yarn")
INT32_MAX = 2**31 - 1  # sizes and ids: the kernels index with 32-bit integers
LAYER_TYPES: tuple[LayerType, ...] = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Yarn:
    """YaRN context extension (rope_type "yarn"), with transformers' defaults resolved."""

    factor: float  # the context is stretched this many times
    original_max_position_embeddings: int  # the context the model was trained on
    beta_fast: float  # pairs turning more often than this over that context keep their frequency
    beta_slow: float  # pairs turning less often than this are interpolated (frequency / factor)
    attention_factor: float  # cos and sin are multiplied by it
    truncate: bool  # the ramp's ends rounded to whole pairs


@dataclass(frozen=True)
class ModelSpec:
    model_type: str  # "qwen3_5_moe" or "qwen3_5_moe_text" as found in the file
    nested: bool  # True when the text config sits under "text_config"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[LayerType, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int  # head_dim * partial_rotary_factor
    rope_theta: float
    attention_bias: bool
    # linear attention (Gated DeltaNet)
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # mixture of experts
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    hidden_act: str
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = field(default=())
    torch_dtype: str = "bfloat16"  # dtype named by the checkpoint ("dtype" or "torch_dtype")
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # generation_config.json's recommended sampling: (name, value) among SAMPLING_DEFAULT_RANGES' names
    sampling_defaults: tuple[tuple[str, float], ...] = field(default=())
    rope_yarn: Yarn | None = None  # rope_type "yarn"; None: plain RoPE

    @property
    def context_length(self) -> int:
        """Positions the model serves: max_position_embeddings, or with YaRN
        original_max_position_embeddings x factor (vLLM's reading)."""
        if self.rope_yarn is None:
            return self.max_position_embeddings
        return int(self.rope_yarn.original_max_position_embeddings * self.rope_yarn.factor)


# generation_config.json sampling keys vLLM's --generation-config auto reads: key -> (low, high,
# low bound open); top_k is an integer (0 or -1: off).
SAMPLING_DEFAULT_RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, float("inf"), False),
    "top_p": (0.0, 1.0, True),
    "top_k": (-1, 2**31 - 1, False),
    "min_p": (0.0, 1.0, False),
    "repetition_penalty": (0.0, 10.0, True),
}


# Defaults of transformers 5 Qwen3_5MoeTextConfig, used where config.json omits a field.
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8,
    "num_experts": 256,
    "full_attention_interval": 4,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
}

POSITIVE_INT_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "moe_intermediate_size", "num_experts_per_tok", "num_experts", "max_position_embeddings",
)  # fmt: skip


@dataclass(frozen=True)
class FieldReader:
    """Typed access to one JSON object; every error names the field and the file."""

    values: dict[str, Any]
    source: Path
    prefix: str = ""  # "text_config." for nested configs

    def fail(self, key: str, problem: str) -> AtlasError:
        return AtlasError(f"{self.source}: field '{self.prefix}{key}' {problem}; fix the file")

    def has(self, key: str) -> bool:
        return key in self.values and self.values[key] is not None

    def raw(self, key: str, default: Any = None) -> Any:
        return self.values[key] if self.has(key) else default

    def int(self, key: str, default: int | None = None, minimum: int | None = None, maximum: int = INT32_MAX) -> int:
        value = self.raw(key, default)
        if value is None:
            raise self.fail(key, "is missing")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be at least {minimum}, got {value}")
        if value > maximum:
            raise self.fail(key, f"must be at most {maximum}, got {str(value)[:40]}")
        return value

    def float(self, key: str, default: float | None = None, positive: bool = False) -> float:
        value = self.raw(key, default)
        if value is None:
            raise self.fail(key, "is missing")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(key, f"must be a finite number, got {value!r}")  # json reads NaN / Infinity
        if positive and value <= 0:
            raise self.fail(key, f"must be > 0, got {value}")
        return float(value)

    def bool(self, key: str, default: bool | None = None) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {value!r}")
        return value

    def str(self, key: str, default: str | None = None) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str):
            raise self.fail(key, f"must be a string, got {value!r}")
        return value

    def optional_int(self, key: str) -> int | None:
        return self.int(key) if self.has(key) else None

    def int_list(self, key: str, below: int) -> tuple[int, ...]:
        """An int or a list of ints in 0..below-1 (as eos_token_id may be); absent -> ()."""
        value = self.raw(key)
        if value is None:
            return ()
        items = value if isinstance(value, list) else [value]
        if any(isinstance(v, bool) or not isinstance(v, int) for v in items):
            raise self.fail(key, f"must be an integer or a list of integers, got {json.dumps(value)[:60]}")
        outside = [v for v in items if not 0 <= v < below]
        if outside:
            raise self.fail(key, f"holds {str(outside[0])[:30]}, outside the vocabulary (0..{below - 1})")
        return tuple(items)

    def object(self, key: str) -> dict[str, Any] | None:
        value = self.raw(key)
        if value is not None and not isinstance(value, dict):
            raise self.fail(key, f"must be a JSON object, got {value!r}")
        return value


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object; any problem is one AtlasError line."""
    if not path.is_file():
        raise AtlasError(f"{path} not found; the model directory needs it")
    try:
        data = json_text.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AtlasError(f"{path} is not valid JSON ({err}); re-download or fix the file") from None
    if not isinstance(data, dict):
        raise AtlasError(f"{path} must hold a JSON object; re-download or fix the file")
    return data


def load_spec(model_dir: Path, overrides: dict[str, Any] | None = None) -> ModelSpec:
    """Read model_dir/config.json (and generation_config.json for eos ids) into a ModelSpec;
    `overrides` (vLLM's --hf-overrides) is merged into config.json first, objects key by key."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    raw = read_json_object(config_path)
    if overrides:
        raw = merge_overrides(raw, overrides)
        config_path = model_dir / "config.json (with --hf-overrides)"  # errors name both
    generation_path = model_dir / "generation_config.json"
    generation = read_json_object(generation_path) if generation_path.is_file() else None
    return spec_from_config(raw, config_path, generation, generation_path)


def merge_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """config with overrides' values in place: an object merges into an object key by key,
    anything else replaces. (vLLM merges into a nested text_config the same way but replaces a
    top-level object whole: given in full, as Qwen's card writes rope_parameters, both agree.)"""
    merged = dict(config)
    for key, value in overrides.items():
        inner = merged.get(key)
        merged[key] = merge_overrides(inner, value) if isinstance(value, dict) and isinstance(inner, dict) else value
    return merged


def spec_from_config(
    raw: dict[str, Any],
    source: Path,
    generation: dict[str, Any] | None = None,
    generation_source: Path | None = None,
) -> ModelSpec:
    """The ModelSpec of a parsed config.json; `source` names the file in errors."""
    top = FieldReader(raw, source)
    model_type = top.raw("model_type")
    if model_type not in (TEXT_MODEL_TYPE, NESTED_MODEL_TYPE):
        raise top.fail(
            "model_type",
            f"is {model_type!r}, but atlas runs '{NESTED_MODEL_TYPE}' and '{TEXT_MODEL_TYPE}' "
            "(Qwen3.5/3.6 MoE) checkpoints only",
        )
    nested = model_type == NESTED_MODEL_TYPE
    text = top
    if nested:
        section = top.object("text_config")
        if section is None:
            raise top.fail("text_config", "is missing (a 'qwen3_5_moe' config nests its text model there)")
        text = FieldReader(section, source, "text_config.")
    dims = read_dimensions(text)
    rope = read_rope(text, dims["head_dim"], dims["max_position_embeddings"])
    layer_types = read_layer_types(text, dims["num_hidden_layers"])
    check_head_ratios(text, dims)
    # ForConditionalGeneration ties through the top-level config, ForCausalLM through the text one.
    tie = top.bool("tie_word_embeddings", TEXT_DEFAULTS["tie_word_embeddings"])
    return ModelSpec(
        model_type=model_type,
        nested=nested,
        layer_types=layer_types,
        rms_norm_eps=text.float("rms_norm_eps", TEXT_DEFAULTS["rms_norm_eps"], positive=True),
        tie_word_embeddings=tie,
        rotary_dim=rope[0],
        rope_theta=rope[1],
        rope_yarn=rope[2],
        attention_bias=text.bool("attention_bias", TEXT_DEFAULTS["attention_bias"]),
        shared_expert_intermediate_size=text.int(
            "shared_expert_intermediate_size", TEXT_DEFAULTS["shared_expert_intermediate_size"], 1
        ),
        # transformers' Qwen3.5 MoE router renormalises its top-k weights whatever the config says
        norm_topk_prob=True,
        hidden_act=read_hidden_act(text),
        eos_token_ids=read_eos_ids(top, text, generation, generation_source, dims["vocab_size"]),
        sampling_defaults=read_sampling_defaults(generation, generation_source or source.with_name("generation_config.json")),
        torch_dtype=read_dtype(top, text),
        bos_token_id=text.optional_int("bos_token_id"),
        pad_token_id=text.optional_int("pad_token_id"),
        **dims,
    )


def read_dimensions(text: FieldReader) -> dict[str, int]:
    return {key: text.int(key, TEXT_DEFAULTS[key], 1) for key in POSITIVE_INT_FIELDS}


def read_hidden_act(text: FieldReader) -> str:
    act = text.str("hidden_act", TEXT_DEFAULTS["hidden_act"])
    if act != "silu":
        raise text.fail("hidden_act", f"is {act!r}; atlas implements 'silu' only")
    return act


def read_rope(text: FieldReader, head_dim: int, max_positions: int) -> tuple[int, float, Yarn | None]:
    """(rotary_dim, rope_theta, YaRN settings) with transformers' priority: rope_parameters (or
    legacy rope_scaling), then top-level rope_theta / partial_rotary_factor, then defaults."""
    key = "rope_parameters" if text.has("rope_parameters") else "rope_scaling"
    params = FieldReader(text.object(key) or {}, text.source, f"{text.prefix}{key}.")
    rope_type = params.raw("rope_type", params.raw("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise params.fail("rope_type", f"is {rope_type!r}; atlas supports {list(SUPPORTED_ROPE_TYPES)}")
    theta = params.float("rope_theta", text.float("rope_theta", TEXT_DEFAULTS["rope_theta"], positive=True), positive=True)
    default_factor = text.float("partial_rotary_factor", TEXT_DEFAULTS["partial_rotary_factor"])
    factor = params.float("partial_rotary_factor", default_factor)
    rotary_dim = int(head_dim * factor)
    if not 0 < factor <= 1 or rotary_dim % 2 or rotary_dim == 0:
        raise params.fail(
            "partial_rotary_factor",
            f"is {factor} and gives rotary dim {rotary_dim} for head_dim {head_dim}; it must give an "
            "even rotary dim in 2..head_dim",
        )
    yarn = read_yarn(text, params, max_positions, theta) if rope_type == "yarn" else None
    return rotary_dim, theta, yarn


def read_yarn(text: FieldReader, params: FieldReader, max_positions: int, theta: float) -> Yarn:
    """YaRN's settings as transformers' _compute_yarn_parameters reads them (a top-level
    original_max_position_embeddings wins; a factor of null is max_position_embeddings / it; a
    beta of 0 or null the paper's default; a truncate of null false)."""
    original = text.int("original_max_position_embeddings", params.int("original_max_position_embeddings", max_positions, 1), 1)
    if "factor" not in params.values:
        raise params.fail("factor", "is missing (YaRN stretches the context by it; null: max_position_embeddings / "
                                    "original_max_position_embeddings)")
    factor = params.float("factor", max_positions / original, positive=True)
    if not 1 <= original * factor <= INT32_MAX:
        raise params.fail("factor", f"{factor:g} makes the context original_max_position_embeddings ({original}) x "
                                    f"factor, {original * factor:g} positions; it must come to 1..{INT32_MAX}")
    if theta == 1:
        raise params.fail("rope_theta", "is 1, which YaRN's ramp divides by the log of")
    truncate = params.values.get("truncate", True)
    mscale, mscale_all_dim = params.float("mscale", 0.0), params.float("mscale_all_dim", 0.0)
    if params.has("attention_factor"):
        attention_factor = params.float("attention_factor", positive=True)
    elif mscale and mscale_all_dim:
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor, 1.0)
    return Yarn(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=yarn_beta(params, "beta_fast", 32.0),
        beta_slow=yarn_beta(params, "beta_slow", 1.0),
        attention_factor=attention_factor,
        truncate=params.bool("truncate", True) if truncate is not None else False,
    )


def yarn_beta(params: FieldReader, key: str, default: float) -> float:
    """beta_fast / beta_slow: rotations over the original context; 0 or null: the paper's value."""
    value = params.float(key, 0.0)
    if value < 0:
        raise params.fail(key, f"must be > 0, got {value}")
    return value or default


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def read_layer_types(text: FieldReader, num_layers: int) -> tuple[LayerType, ...]:
    if not text.has("layer_types"):
        interval = text.int("full_attention_interval", TEXT_DEFAULTS["full_attention_interval"], 1)
        return tuple(
            "linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)
        )
    value = text.raw("layer_types")
    if not isinstance(value, list) or any(v not in LAYER_TYPES for v in value):
        raise text.fail("layer_types", f"must be a list of {list(LAYER_TYPES)}, got {value!r}")
    if len(value) != num_layers:
        raise text.fail(
            "layer_types", f"has {len(value)} entries but num_hidden_layers is {num_layers}"
        )
    return tuple(value)


def check_head_ratios(text: FieldReader, dims: dict[str, int]) -> None:
    """Shapes the layers rely on: whole GQA groups, whole key/value head groups, top-k <= E."""
    if dims["num_attention_heads"] % dims["num_key_value_heads"]:
        raise text.fail(
            "num_key_value_heads",
            f"({dims['num_key_value_heads']}) must divide num_attention_heads "
            f"({dims['num_attention_heads']})",
        )
    if dims["linear_num_value_heads"] % dims["linear_num_key_heads"]:
        raise text.fail(
            "linear_num_key_heads",
            f"({dims['linear_num_key_heads']}) must divide linear_num_value_heads "
            f"({dims['linear_num_value_heads']})",
        )
    if dims["num_experts_per_tok"] > dims["num_experts"]:
        raise text.fail(
            "num_experts_per_tok",
            f"({dims['num_experts_per_tok']}) must not exceed num_experts ({dims['num_experts']})",
        )


def read_eos_ids(
    top: FieldReader,
    text: FieldReader,
    generation: dict[str, Any] | None,
    generation_source: Path | None,
    vocab_size: int,
) -> tuple[int, ...]:
    """generation_config.json wins (as in transformers' generate), then the text config, then
    the top-level config."""
    if generation is not None and generation.get("eos_token_id") is not None:
        source = generation_source or top.source.with_name("generation_config.json")
        return FieldReader(generation, source).int_list("eos_token_id", vocab_size)
    return text.int_list("eos_token_id", vocab_size) or top.int_list("eos_token_id", vocab_size)


def read_sampling_defaults(generation: dict[str, Any] | None, source: Path) -> tuple[tuple[str, float], ...]:
    """The sampling settings generation_config.json recommends (Qwen3.6's: temperature, top_p,
    top_k), each checked against its range."""
    if generation is None:
        return ()
    reader, found = FieldReader(generation, source), []
    for key, (low, high, low_open) in SAMPLING_DEFAULT_RANGES.items():
        if not reader.has(key):
            continue
        value = reader.int(key) if key == "top_k" else reader.float(key)
        if value < low or value > high or (low_open and value == low):
            raise reader.fail(key, f"must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value}")
        found.append((key, float(max(value, 0)) if key == "top_k" else value))
    return tuple(found)


def read_dtype(top: FieldReader, text: FieldReader) -> str:
    for reader in (text, top):
        for key in ("dtype", "torch_dtype"):
            if reader.has(key):
                return reader.str(key)
    return "bfloat16"
