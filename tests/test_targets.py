"""targets.toml: validation, hardware lookup, model and quant recognition."""

from __future__ import annotations

import json
import random
import re
import tomllib
from pathlib import Path

import pytest

from atlas.errors import AtlasError
from atlas.targets import (
    hardware_candidates,
    hardware_for_compute_capability,
    load_registry,
    parse_registry,
    recognise_model,
    recognise_quant,
)

REPO = Path(__file__).resolve().parent.parent
TOML = REPO / "targets.toml"


def _data() -> dict:
    return tomllib.loads(TOML.read_text())


def test_registry_contents() -> None:
    reg = load_registry(TOML)
    assert set(reg.hardware) == {"h200", "gb10", "sm80"}
    assert reg.resolve_hardware("h100").name == "h200"
    assert reg.hardware["h200"].gencode == ("-gencode=arch=compute_90a,code=sm_90a",)
    assert reg.hardware["gb10"].gencode == ("-gencode=arch=compute_121a,code=sm_121a",)
    assert reg.hardware["sm80"].gencode == ("-gencode=arch=compute_80,code=compute_80",)
    assert not reg.hardware["sm80"].has_cubin and reg.hardware["h200"].has_cubin
    assert set(reg.quants) == {"bf16", "fp8", "nvfp4"}
    qwen = reg.models["qwen3.6-35b-a3b"].constants
    assert (qwen["hidden_size"], qwen["num_experts"], qwen["vocab_size"], qwen["rotary_dim"]) == (2048, 256, 248320, 64)
    assert reg.models["atlas-demo"].constants["hidden_size"] == 128


@pytest.mark.parametrize(
    ("mutate", "key", "expected"),
    [
        (lambda d: d["hardware"]["h200"].update(sm="ninety"), "hardware.h200.sm", "an integer"),
        (lambda d: d["hardware"]["gb10"].update(gencode=["-arch=sm_121"]), "hardware.gb10.gencode", "-gencode"),
        (lambda d: d["hardware"]["gb10"].update(arch="sm_90a"), "hardware.gb10.arch", "code= of its gencode"),
        (lambda d: d["hardware"]["sm80"].update(serves_min="eight"), "hardware.sm80.serves", "compute capabilities"),
        (lambda d: d["hardware"]["h200"].pop("serves"), "hardware.h200.serves", "missing"),
        (lambda d: d["hardware"]["h200"].update(colour="red"), "hardware.h200.colour", "known keys"),
        (lambda d: d["hardware"]["gb10"].update(aliases=["h100"]), "hardware", "unique"),
        (lambda d: d["models"]["atlas-demo"]["constants"].update(hidden_size=-1), "constants.hidden_size", "positive integer"),
        (lambda d: d["models"]["atlas-demo"].update(recognise=["hidden_size", "nope"]), "recognise", "unknown"),
        (lambda d: d["quants"]["fp8"]["rules"][0].pop("key"), "quants.fp8.rules[0].key", "missing"),
        (lambda d: d.update(schema=7), "schema", "1"),
    ],
)
def test_validation_names_file_key_and_expectation(mutate, key: str, expected: str, tmp_path: Path) -> None:
    data = _data()
    mutate(data)
    with pytest.raises(AtlasError) as err:
        parse_registry(tmp_path / "targets.toml", data)
    message = str(err.value)
    assert str(tmp_path / "targets.toml") in message and key in message and expected in message
    assert "\n" not in message


def test_invalid_toml_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "targets.toml"
    path.write_text("[hardware\n")
    with pytest.raises(AtlasError, match=re.escape(str(path))):
        load_registry(path)


def test_hardware_for_compute_capability() -> None:
    assert hardware_for_compute_capability("9.0").name == "h200"
    assert hardware_for_compute_capability((12, 1)).name == "gb10"
    for cc in ("8.0", "8.6", "8.9", "10.0", "12.0"):
        assert hardware_for_compute_capability(cc).name == "sm80"
    assert hardware_for_compute_capability("7.5") is None
    assert [h.name for h in hardware_candidates((9, 0))] == ["h200", "sm80"]
    assert hardware_for_compute_capability("9.0", available=["sm80", "gb10"]).name == "sm80"
    assert hardware_for_compute_capability("9.0", available=["gb10"]) is None


def _qwen_config(nested: bool, layers: int) -> dict:
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig

    config = Qwen3_5MoeConfig().to_dict()
    config["text_config"]["num_hidden_layers"] = layers
    if nested:
        return config
    return config["text_config"]


@pytest.mark.parametrize("nested", [True, False])
def test_recognise_real_config_any_layer_count(nested: bool) -> None:
    config = _qwen_config(nested, random.randint(1, 40))
    assert recognise_model(config) == "qwen3.6-35b-a3b"


def test_recognise_rejects_other_dimensions() -> None:
    reg = load_registry()
    text = dict(reg.models["atlas-demo"].constants)
    text.update(model_type="qwen3_5_moe_text", partial_rotary_factor=text["rotary_dim"] / text["head_dim"])
    del text["rotary_dim"]
    assert recognise_model(text) == "atlas-demo"
    key = random.choice(reg.models["atlas-demo"].recognise)
    changed = {**text, key: text.get(key, 16) * 2}
    if key == "rotary_dim":
        changed["partial_rotary_factor"] = 1.0
    assert recognise_model(changed) is None
    assert recognise_model({**text, "model_type": "llama"}) is None


def _write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


def test_recognise_quant(tmp_path: Path) -> None:
    cases = {
        "bf16": ({"model_type": "qwen3_5_moe"}, None),
        "fp8": ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, None),
        "nvfp4": ({}, {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}}),
    }
    for expected, (config, hf_quant) in cases.items():
        d = tmp_path / expected
        d.mkdir()
        _write(d / "config.json", config)
        if hf_quant:
            _write(d / "hf_quant_config.json", hf_quant)
        assert recognise_quant(d) == expected
    modelopt = tmp_path / "modelopt"
    modelopt.mkdir()
    _write(modelopt / "config.json", {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}})
    assert recognise_quant(modelopt) == "nvfp4"
    gptq = tmp_path / "gptq"
    gptq.mkdir()
    _write(gptq / "config.json", {"quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(AtlasError, match="unsupported quantization"):
        recognise_quant(gptq)
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "config.json").write_text(json.dumps([random.randint(0, 9)]))
    with pytest.raises(AtlasError, match="must hold a JSON object"):  # not mistaken for an unquantized checkpoint
        recognise_quant(listed)


def test_a_loaded_spec_is_recognised_as_its_config(tmp_path: Path) -> None:
    """The CUDA backend recognises the spec as loaded (--hf-overrides applied): dimensions an
    override changes pick another kernel set, or none."""
    from dataclasses import asdict

    from atlas.config import load_spec
    from atlas.demo import DEMO_DIR

    assert recognise_model(asdict(load_spec(DEMO_DIR))) == "atlas-demo"
    yarn = {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048}}
    assert recognise_model(asdict(load_spec(DEMO_DIR, yarn))) == "atlas-demo"  # rope scaling: the same kernels
    wider = {"rope_parameters": {"partial_rotary_factor": 0.5}}
    assert recognise_model(asdict(load_spec(DEMO_DIR, wider))) is None
