"""load_spec: config.json (flat or nested) -> ModelSpec, checked against transformers' own parsing,
and the one-line errors for bad configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlas.config import load_spec
from atlas.layers.rotary import rope_frequencies
from atlas.errors import AtlasError


def random_text_config(rng: np.random.Generator) -> dict[str, Any]:
    kv_heads = int(rng.choice([1, 2, 4]))
    key_heads = int(rng.choice([1, 2]))
    experts = int(rng.integers(2, 9))
    layers = int(rng.integers(1, 9))
    head_dim = int(rng.choice([16, 32, 64]))
    config: dict[str, Any] = {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": int(rng.integers(64, 4096)),
        "hidden_size": int(rng.choice([32, 64, 128])),
        "num_hidden_layers": layers,
        "num_attention_heads": kv_heads * int(rng.integers(1, 4)),
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": key_heads * int(rng.integers(1, 4)),
        "linear_key_head_dim": int(rng.choice([16, 32])),
        "linear_value_head_dim": int(rng.choice([16, 32])),
        "num_experts": experts,
        "num_experts_per_tok": int(rng.integers(1, experts + 1)),
        "moe_intermediate_size": int(rng.choice([16, 32])),
        "shared_expert_intermediate_size": int(rng.choice([16, 48])),
        "rms_norm_eps": float(rng.choice([1e-6, 1e-5])),
        "eos_token_id": [int(rng.integers(0, 50)), int(rng.integers(50, 64))],
    }
    if rng.random() < 0.5:
        config["layer_types"] = [
            str(rng.choice(["linear_attention", "full_attention"])) for _ in range(layers)
        ]
    else:
        config["full_attention_interval"] = int(rng.integers(1, 5))
    theta = float(rng.choice([10000.0, 1e6, 1e7]))
    factor = float(rng.choice([0.25, 0.5, 1.0]))
    if rng.random() < 0.5:
        config["rope_parameters"] = {
            "rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True,
        }  # fmt: skip
    else:  # legacy top-level keys
        config["rope_theta"] = theta
        config["partial_rotary_factor"] = factor
    return config


def write_config(model_dir: Path, config: dict[str, Any], generation: dict[str, Any] | None = None) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
    if generation is not None:
        (model_dir / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
    return model_dir


def nest(text: dict[str, Any], tie: bool) -> dict[str, Any]:
    return {"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": tie}


@pytest.mark.oracle
@pytest.mark.parametrize("nested", [False, True])
def test_spec_matches_transformers(tmp_path: Path, rng: np.random.Generator, nested: bool) -> None:
    from transformers import AutoConfig

    for i in range(6):
        text = random_text_config(rng)
        tie = bool(rng.random() < 0.5)
        if nested:
            raw = nest(text, tie)
        else:
            raw = {**text, "tie_word_embeddings": tie}
        model_dir = write_config(tmp_path / f"m{i}", raw)
        spec = load_spec(model_dir)
        top = AutoConfig.from_pretrained(model_dir)
        hf = top.text_config if nested else top
        rope = hf.rope_parameters
        assert spec.nested == nested
        assert spec.layer_types == tuple(hf.layer_types)
        assert spec.rotary_dim == int(hf.head_dim * rope["partial_rotary_factor"])
        assert spec.rope_theta == rope["rope_theta"]
        assert spec.tie_word_embeddings == top.tie_word_embeddings
        assert spec.eos_token_ids == tuple(hf.eos_token_id)
        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size", "rms_norm_eps", "attention_bias", "hidden_act",
            "max_position_embeddings",
        ):  # fmt: skip
            assert getattr(spec, name) == getattr(hf, name), name


def test_defaults_are_transformers_defaults(tmp_path: Path) -> None:
    from transformers import Qwen3_5MoeTextConfig

    spec = load_spec(write_config(tmp_path, {"model_type": "qwen3_5_moe_text"}))
    hf = Qwen3_5MoeTextConfig()
    assert spec.layer_types == tuple(hf.layer_types)
    assert spec.rotary_dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"])
    assert spec.rope_theta == hf.rope_parameters["rope_theta"]
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_experts", "head_dim",
                 "linear_num_value_heads", "moe_intermediate_size", "tie_word_embeddings"):
        assert getattr(spec, name) == getattr(hf, name), name


def test_generation_config_eos_wins(tmp_path: Path, rng: np.random.Generator) -> None:
    text = random_text_config(rng)
    eos = sorted({int(x) for x in rng.integers(0, 64, size=3)})
    spec = load_spec(write_config(tmp_path, text, {"eos_token_id": eos}))
    assert spec.eos_token_ids == tuple(eos)
    single = load_spec(write_config(tmp_path / "b", text, {"eos_token_id": eos[0]}))
    assert single.eos_token_ids == (eos[0],)
    fallback = load_spec(write_config(tmp_path / "c", text, {"do_sample": False}))
    assert fallback.eos_token_ids == tuple(text["eos_token_id"])


def test_generation_config_sampling_defaults(tmp_path: Path, rng: np.random.Generator) -> None:
    """Qwen's recommended sampling (generation_config.json) is read and range-checked; other keys
    (do_sample, eos) are not sampling defaults."""
    text = random_text_config(rng)
    recommended = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0, "eos_token_id": 1}
    spec = load_spec(write_config(tmp_path / "a", text, recommended))
    assert dict(spec.sampling_defaults) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0}
    assert dict(load_spec(write_config(tmp_path / "b", text, {"top_k": -1})).sampling_defaults) == {"top_k": 0}
    assert load_spec(write_config(tmp_path / "c", text)).sampling_defaults == ()
    for i, (key, value) in enumerate([("top_p", 0), ("temperature", -1), ("top_k", 1.5), ("repetition_penalty", 11),
                                      ("min_p", "low"), ("temperature", float("nan"))]):
        write_config(tmp_path / f"bad{i}", text, {key: value})
        expect_error(tmp_path / f"bad{i}", "generation_config.json", f"'{key}'")


def test_dtype_from_either_key(tmp_path: Path, rng: np.random.Generator) -> None:
    text = random_text_config(rng)
    assert load_spec(write_config(tmp_path / "a", {**text, "dtype": "float32"})).torch_dtype == "float32"
    nested = {**nest(text, False), "torch_dtype": "bfloat16"}
    assert load_spec(write_config(tmp_path / "b", nested)).torch_dtype == "bfloat16"


def expect_error(model_dir: Path, *needles: str) -> None:
    with pytest.raises(AtlasError) as caught:
        load_spec(model_dir)
    message = str(caught.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("hidden_size", "2048", "must be an integer"),
        ("hidden_size", 64.5, "must be an integer"),
        ("num_experts", True, "must be an integer"),
        ("num_hidden_layers", 0, "at least 1"),
        ("rms_norm_eps", "tiny", "must be a finite number"),
        ("rms_norm_eps", float("nan"), "must be a finite number"),  # json reads NaN
        ("rms_norm_eps", -1e-6, "must be > 0"),
        ("rope_parameters", {"rope_type": "default", "rope_theta": 0}, "rope_theta' must be > 0"),
        ("tie_word_embeddings", 1, "true or false"),
        ("layer_types", ["linear_attention", "sliding"], "must be a list"),
        ("eos_token_id", "eos", "integer or a list"),
        ("hidden_act", "gelu", "silu"),
    ],
)
def test_wrong_typed_field(tmp_path: Path, rng: np.random.Generator, field: str, value: Any, needle: str) -> None:
    text = random_text_config(rng)
    text[field] = value
    config_path = str(tmp_path / "config.json")
    expect_error(write_config(tmp_path, text), f"'{field}", needle, config_path)  # or 'field.key'


def test_nested_error_names_the_nested_field(tmp_path: Path, rng: np.random.Generator) -> None:
    text = random_text_config(rng)
    text["num_attention_heads"] = "many"
    expect_error(write_config(tmp_path, nest(text, False)), "'text_config.num_attention_heads'")


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", None])
def test_unsupported_model_type(tmp_path: Path, rng: np.random.Generator, model_type: str | None) -> None:
    text = random_text_config(rng)
    text["model_type"] = model_type
    expect_error(write_config(tmp_path, text), "'model_type'", "qwen3_5_moe")


def test_nested_without_text_config(tmp_path: Path) -> None:
    expect_error(write_config(tmp_path, {"model_type": "qwen3_5_moe"}), "'text_config'", "missing")


def test_inconsistent_shapes(tmp_path: Path, rng: np.random.Generator) -> None:
    text = random_text_config(rng)
    bad_layers = {**text, "layer_types": ["full_attention"] * (text["num_hidden_layers"] + 1)}
    expect_error(write_config(tmp_path / "a", bad_layers), "'layer_types'", "num_hidden_layers")
    bad_gqa = {**text, "num_attention_heads": 3, "num_key_value_heads": 2}
    expect_error(write_config(tmp_path / "b", bad_gqa), "'num_key_value_heads'")
    bad_topk = {**text, "num_experts": 2, "num_experts_per_tok": 3}
    expect_error(write_config(tmp_path / "c", bad_topk), "'num_experts_per_tok'")
    bad_rope = {**text, "rope_parameters": {"rope_type": "longrope", "factor": 4.0}}
    expect_error(write_config(tmp_path / "d", bad_rope), "'rope_parameters.rope_type'", "longrope", "yarn")
    odd_rotary = {**text, "head_dim": 16, "rope_parameters": {"partial_rotary_factor": 0.1}}
    expect_error(write_config(tmp_path / "e", odd_rotary), "partial_rotary_factor")


def test_missing_or_broken_files(tmp_path: Path, rng: np.random.Generator) -> None:
    expect_error(tmp_path, "config.json", "not found")
    (tmp_path / "config.json").write_text("{not json", encoding="utf-8")
    expect_error(tmp_path, "not valid JSON")
    (tmp_path / "config.json").write_text("[1, 2]", encoding="utf-8")
    expect_error(tmp_path, "JSON object")
    write_config(tmp_path, random_text_config(rng), {"eos_token_id": [1.5]})
    expect_error(tmp_path, "generation_config.json", "'eos_token_id'")


# Qwen's model card setting for 1M tokens, then the knobs transformers reads, each on its own.
YARN_SETTINGS: list[dict[str, Any]] = [
    {"factor": 4.0, "original_max_position_embeddings": 262_144, "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
    {"factor": 2.5, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"factor": 8.0, "original_max_position_embeddings": 2048, "mscale": 0.707, "mscale_all_dim": 1.0},
    {"factor": 3.0, "original_max_position_embeddings": 1024, "attention_factor": 1.3},
    {"factor": None, "original_max_position_embeddings": 2048},  # max_position_embeddings / original
    {"factor": 1.0, "original_max_position_embeddings": 8192, "beta_fast": 0},  # no stretch; 0: the default
    {"factor": 2.0, "original_max_position_embeddings": 4096, "truncate": None, "beta_slow": None},  # null: false / 1
]


@pytest.mark.oracle
@pytest.mark.parametrize("settings", YARN_SETTINGS)
@pytest.mark.parametrize("nested", [False, True])
def test_yarn_matches_transformers(tmp_path: Path, rng: np.random.Generator, settings: dict[str, Any], nested: bool) -> None:
    """The YaRN frequency table and cos/sin scale equal transformers' to the bit; the context is
    original_max_position_embeddings x factor when longer than max_position_embeddings (vLLM's)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    text = random_text_config(rng)
    for legacy in ("rope_theta", "partial_rotary_factor", "rope_parameters"):
        text.pop(legacy, None)
    text["max_position_embeddings"] = 8192
    text["rope_parameters"] = {"rope_type": "yarn", "rope_theta": float(rng.choice([1e4, 1e6, 1e7])),
                               "partial_rotary_factor": float(rng.choice([0.25, 0.5, 1.0])), **settings}
    model_dir = write_config(tmp_path, nest(text, False) if nested else text)
    spec = load_spec(model_dir)
    top = AutoConfig.from_pretrained(model_dir)
    hf = top.text_config if nested else top
    want_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf)
    inv_freq, scaling = rope_frequencies(spec)
    # torch's vectorised float32 pow (transformers' theta powers) is not always correctly rounded:
    # an ulp on some CPUs; atlas' (and its kernels') powers are
    np.testing.assert_array_max_ulp(inv_freq, want_freq.numpy(), maxulp=1)
    assert scaling == want_scale
    factor = settings["factor"] or 8192 / settings["original_max_position_embeddings"]
    assert spec.context_length == int(settings["original_max_position_embeddings"] * factor)


def test_yarn_legacy_rope_scaling_and_bad_fields(tmp_path: Path, rng: np.random.Generator) -> None:
    text = random_text_config(rng)
    text.pop("rope_parameters", None)
    legacy = {**text, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
              "max_position_embeddings": 512}
    spec = load_spec(write_config(tmp_path / "legacy", legacy))
    assert spec.rope_yarn is not None and spec.rope_yarn.factor == 4.0 and spec.context_length == 2048
    plain = load_spec(write_config(tmp_path / "plain", {**text, "max_position_embeddings": 512}))
    assert plain.rope_yarn is None and plain.context_length == 512
    no_factor = {"rope_type": "yarn", "original_max_position_embeddings": 256}
    expect_error(write_config(tmp_path / "nofactor", {**text, "rope_parameters": no_factor}), "'rope_parameters.factor' is missing")
    for i, (key, value, needle) in enumerate([
        ("factor", 0, "must be > 0"), ("factor", "4", "finite number"), ("attention_factor", -1.0, "must be > 0"),
        ("original_max_position_embeddings", 0, "at least 1"), ("truncate", "yes", "true or false"),
        ("beta_fast", float("nan"), "finite number"), ("beta_slow", -1, "must be > 0"), ("rope_theta", 1, "is 1"),
    ]):
        rope = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256, key: value}
        expect_error(write_config(tmp_path / f"bad{i}", {**text, "rope_parameters": rope}), f"'rope_parameters.{key}'", needle)


def test_hf_overrides_merge_into_the_config(tmp_path: Path, rng: np.random.Generator) -> None:
    """vLLM's --hf-overrides: objects merge key by key (text_config keeps its other fields), other
    values replace; errors in an overridden field name the overrides."""
    text = random_text_config(rng)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}
    model_dir = write_config(tmp_path, nest(text, False))
    plain = load_spec(model_dir)
    rope = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096}
    spec = load_spec(model_dir, {"text_config": {"rope_parameters": rope, "max_position_embeddings": 4096}})
    assert spec.rope_yarn is not None and spec.context_length == 8192
    assert (spec.rope_theta, spec.rotary_dim) == (plain.rope_theta, plain.rotary_dim)  # merged, not replaced
    assert spec.num_experts == plain.num_experts and spec.layer_types == plain.layer_types
    assert load_spec(model_dir, {"text_config": {"num_experts": text["num_experts"] + 1}}).num_experts == text["num_experts"] + 1
    with pytest.raises(AtlasError, match=r"config\.json \(with --hf-overrides\): field 'text_config\.hidden_size'"):
        load_spec(model_dir, {"text_config": {"hidden_size": "big"}})
