"""vLLM's --generation-config auto | vllm | FOLDER and --override-generation-config: the sampling
defaults requests get, and each bad value one line before the model loads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from atlas.errors import AtlasError
from atlas.generation_defaults import GenerationDefaults

MODEL = (("temperature", 0.6), ("top_p", 0.95), ("top_k", 20.0))


def test_sources_and_the_override(tmp_path: Path, rng: np.random.Generator) -> None:
    temperature = float(rng.uniform(0.1, 1.5))
    override = json.dumps({"temperature": temperature, "min_p": 0.05})
    assert GenerationDefaults("auto").resolve(MODEL) == dict(MODEL)
    assert GenerationDefaults("auto", override).resolve(MODEL) == {**dict(MODEL), "temperature": temperature,
                                                                    "min_p": 0.05}
    assert GenerationDefaults("vllm").resolve(MODEL) == {}
    assert GenerationDefaults("vllm", override).resolve(MODEL) == {"temperature": temperature, "min_p": 0.05}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": -1, "repetition_penalty": 1.1, "do_sample": True}))
    assert GenerationDefaults(str(tmp_path)).resolve(MODEL) == {"top_k": 0.0, "repetition_penalty": 1.1}
    assert GenerationDefaults(str(tmp_path), '{"top_k": 5}').resolve(MODEL) == {"top_k": 5.0, "repetition_penalty": 1.1}
    assert "--override-generation-config" in GenerationDefaults("auto", override).describe()


@pytest.mark.parametrize(("source", "override", "words"), [
    ("auto", "{temperature", "is not JSON"),
    ("auto", "[0.5]", "must be a JSON object"),
    ("auto", '{"max_tokens": 5}', "'max_tokens' is not a sampling default here"),
    ("auto", '{"top_p": 0}', "top_p must be a number in (0, 1]"),
    ("auto", '{"temperature": -1}', "temperature must be a number in [0, inf]"),
    ("auto", '{"top_k": 1.5}', "top_k must be an integer"),
    ("auto", '{"temperature": "hot"}', "temperature must be a number"),
    ("auto", '{"temperature": true}', "temperature must be a number"),
    ("auto", '{"repetition_penalty": 1e999}', "repetition_penalty must be a number"),
    ("/no/such/folder", None, "neither auto, vllm nor a folder"),
    ("EMPTY", None, "generation_config.json not found"),
])  # fmt: skip
def test_bad_values_are_one_line(tmp_path: Path, source: str, override: str | None, words: str) -> None:
    defaults = GenerationDefaults(str(tmp_path) if source == "EMPTY" else source, override)
    with pytest.raises(AtlasError) as err:
        defaults.check()
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_commands_refuse_before_loading(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from atlas.batch import main as batch_main
    from atlas.serve import main as serve_main

    (tmp_path / "in.jsonl").write_text("{}\n")
    for main, flags in ((serve_main, []), (batch_main, ["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out")])):
        assert main([*flags, "--override-generation-config", '{"top_p": 2}']) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "top_p must be a number in (0, 1]" in err and "loading" not in err
