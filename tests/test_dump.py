"""ATLAS_DUMP=layers|experts|all: the files exist, hold the right names and shapes, and their values
equal an independent capture of the engine's intermediates (norms = np.linalg.norm of the tensors)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _checkpoints import TinyModel, random_checkpoint_dir
from atlas.backends.base import SamplingParams
from atlas.backends.numpy_backend import NumpyBackend
from atlas.config import load_spec
from atlas.dump import ROUTER_TOP
from atlas.engine import Engine
from atlas.errors import AtlasError
from atlas.safetensors import Checkpoint

TINY = TinyModel(num_experts=16, num_experts_per_tok=3)  # more experts than the router top-10
NEW_TOKENS = 3
HIDDEN_SUFFIXES = ("input_norm", "attn_out", "post_norm", "mlp_out", "out")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_checkpoint_dir(tmp_path_factory, "tiny", TINY)


def new_engine(model_dir: Path) -> Engine:
    return Engine(load_spec(model_dir), Checkpoint.open(model_dir), NumpyBackend(), max_seq_len=64)


def reference_prefill(model_dir: Path, prompt: list[int]) -> dict[str, np.ndarray]:
    """Every intermediate of the prefill, captured by a plain hook on an engine without ATLAS_DUMP."""
    engine = new_engine(model_dir)
    captured: dict[str, np.ndarray] = {}
    engine.dump = lambda name, tensor: captured.__setitem__(name, np.array(tensor))
    engine.prefill(prompt)
    return captured


def dumped_run(model_dir: Path, mode: str, dump_root: Path, prompt: list[int], monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[int]]:
    monkeypatch.setenv("ATLAS_DUMP", mode)
    monkeypatch.setenv("ATLAS_DUMP_DIR", str(dump_root))
    engine = new_engine(model_dir)
    tokens = engine.generate(prompt, NEW_TOKENS, SamplingParams(), None, set()).token_ids
    [run_dir] = list(dump_root.iterdir())
    return run_dir, tokens


def read_steps(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    index = json.loads((run_dir / "index.json").read_text())
    return index, [json.loads((run_dir / entry["file"]).read_text()) for entry in index["steps"]]


def random_prompt(rng: np.random.Generator) -> list[int]:
    return rng.integers(0, TINY.vocab_size, int(rng.integers(5, 20))).tolist()


def check_index(index: dict[str, Any], steps: list[dict[str, Any]], prompt: list[int], mode: str) -> None:
    assert index["mode"] == mode and index["backend"] == "numpy"
    assert index["num_hidden_layers"] == TINY.num_hidden_layers
    assert len(steps) == NEW_TOKENS  # the prefill, then one decode per new token but the last
    assert steps[0]["positions"] == list(range(len(prompt)))
    for offset, step in enumerate(steps[1:]):
        assert step["positions"] == [len(prompt) + offset]
    assert [e["tokens"] for e in index["steps"]] == [len(prompt)] + [1] * (NEW_TOKENS - 1)


def check_norms(step: dict[str, Any], reference: dict[str, np.ndarray]) -> None:
    names = ["embed", "final_norm"] + [
        f"layer.{i}.{suffix}" for i in range(TINY.num_hidden_layers) for suffix in HIDDEN_SUFFIXES
    ]
    assert sorted(step["norms"]) == sorted(names)
    for name in names:
        np.testing.assert_allclose(step["norms"][name], np.linalg.norm(reference[name], axis=-1), rtol=1e-5)


def check_experts(step: dict[str, Any], reference: dict[str, np.ndarray], tokens: int) -> None:
    assert sorted(step["experts"]) == sorted(f"layer.{i}" for i in range(TINY.num_hidden_layers))
    for layer, record in step["experts"].items():
        logits = reference[f"{layer}.mlp.router_logits"]  # [T, E]
        assert logits.shape == (tokens, TINY.num_experts)
        top_ids = np.array(record["router_top_ids"])
        assert top_ids.shape == (tokens, ROUTER_TOP)
        np.testing.assert_allclose(record["router_top_logits"], np.sort(logits, axis=-1)[:, ::-1][:, :ROUTER_TOP], rtol=1e-6)
        np.testing.assert_allclose(np.take_along_axis(logits, top_ids, -1), record["router_top_logits"], rtol=1e-6)
        chosen = np.array(record["expert_ids"])
        assert chosen.shape == (tokens, TINY.num_experts_per_tok)
        assert (chosen == reference[f"{layer}.mlp.router_ids"]).all()
        assert (chosen == top_ids[:, : TINY.num_experts_per_tok]).all()  # the router picks the top logits
        np.testing.assert_allclose(record["expert_weights"], reference[f"{layer}.mlp.router_weights"], rtol=1e-6)
        for kind in ("routed", "shared"):
            expected = np.linalg.norm(reference[f"{layer}.mlp.{kind}"], axis=-1)
            np.testing.assert_allclose(record[f"{kind}_norms"], expected, rtol=1e-5)


def test_layers_mode_writes_hidden_norms(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    prompt = random_prompt(rng)
    run_dir, _ = dumped_run(model_dir, "layers", tmp_path / "dumps", prompt, monkeypatch)
    index, steps = read_steps(run_dir)
    check_index(index, steps, prompt, "layers")
    check_norms(steps[0], reference_prefill(model_dir, prompt))
    for step in steps:
        assert step["experts"] == {} and step["tensors"] == {}
        assert all(len(values) == len(step["positions"]) for values in step["norms"].values())
    assert not list(run_dir.rglob("*.npy"))


def test_experts_mode_writes_router_and_expert_data(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    prompt = random_prompt(rng)
    run_dir, _ = dumped_run(model_dir, "experts", tmp_path / "dumps", prompt, monkeypatch)
    index, steps = read_steps(run_dir)
    check_index(index, steps, prompt, "experts")
    check_experts(steps[0], reference_prefill(model_dir, prompt), len(prompt))
    for step in steps[1:]:
        assert step["norms"] == {} and len(step["experts"]["layer.0"]["expert_ids"]) == 1
    assert not list(run_dir.rglob("*.npy"))


def test_all_mode_writes_full_tensors(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    prompt = random_prompt(rng)
    plain = new_engine(model_dir).generate(prompt, NEW_TOKENS, SamplingParams(), None, set()).token_ids
    run_dir, tokens = dumped_run(model_dir, "all", tmp_path / "dumps", prompt, monkeypatch)
    assert tokens == plain  # dumping (and eager decode) does not change the output
    index, steps = read_steps(run_dir)
    check_index(index, steps, prompt, "all")
    reference = reference_prefill(model_dir, prompt)
    check_norms(steps[0], reference)
    check_experts(steps[0], reference, len(prompt))
    assert set(index["names"]) == set(reference) - {"positions"}
    for step in steps:
        assert set(step["tensors"]) == set(reference) - {"positions"}
        for name, entry in step["tensors"].items():
            array = np.load(run_dir / entry["file"])
            assert list(array.shape) == entry["shape"] and str(array.dtype) == entry["dtype"]
            rows = 1 if name == "logits" else len(step["positions"])  # logits: the last token only
            assert array.shape[0] == rows
            if step["step"] == 0:
                np.testing.assert_array_equal(array, reference[name])
            if name in step["norms"]:
                np.testing.assert_allclose(step["norms"][name], np.linalg.norm(array, axis=-1), rtol=1e-5)
    assert not [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")]


def test_each_engine_gets_its_own_run(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATLAS_DUMP", "layers")
    monkeypatch.setenv("ATLAS_DUMP_DIR", str(tmp_path))
    new_engine(model_dir)  # never runs: writes nothing
    assert not list(tmp_path.iterdir())
    for _ in range(2):
        new_engine(model_dir).prefill([1, 2, 3])
    runs = sorted(p.name for p in tmp_path.iterdir())
    assert len(runs) == 2 and all(re.match(r"run-\d{8}-\d{6}-", name) for name in runs)


@pytest.mark.parametrize("value", ["", "  "])
def test_unset_or_empty_dumps_nothing(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("ATLAS_DUMP", value)
    monkeypatch.setenv("ATLAS_DUMP_DIR", str(tmp_path / "dumps"))
    engine = new_engine(model_dir)
    engine.prefill([1, 2, 3])
    assert engine.dump is None and not (tmp_path / "dumps").exists()


@pytest.mark.parametrize("value", ["layer", "ALL", "norms", "1"])
def test_bad_mode_is_one_line(model_dir: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("ATLAS_DUMP", value)
    with pytest.raises(AtlasError) as caught:
        new_engine(model_dir)
    message = str(caught.value)
    assert "\n" not in message and f"ATLAS_DUMP={value!r}" in message
    assert "layers, experts, all" in message


def test_bad_mode_from_the_cli_exits_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from atlas.run import main

    monkeypatch.setenv("ATLAS_DUMP", "everything")
    code = main(["--device", "cpu", "--max-tokens", "2"])
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 2 and len(err) == 1 and "ATLAS_DUMP='everything'" in err[0] and "layers, experts, all" in err[0]


def test_unwritable_dump_dir_is_one_line(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ATLAS_DUMP", "all")
    monkeypatch.setenv("ATLAS_DUMP_DIR", str(blocker / "dumps"))
    with pytest.raises(AtlasError) as caught:
        new_engine(model_dir)
    assert "\n" not in str(caught.value) and "ATLAS_DUMP_DIR" in str(caught.value)


def test_cli_run_dumps_the_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from atlas.run import main

    monkeypatch.setenv("ATLAS_DUMP", "experts")
    monkeypatch.setenv("ATLAS_DUMP_DIR", str(tmp_path))
    assert main(["--device", "cpu", "--max-tokens", "4"]) == 0
    [run_dir] = list(tmp_path.iterdir())
    index, steps = read_steps(run_dir)
    assert len(steps) == 4 and index["model_type"] == "qwen3_5_moe_text"
    assert all(len(step["experts"]) == 4 for step in steps)


@pytest.mark.gpu
def test_cuda_dump_matches_numpy_on_the_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same dump from the CUDA backend: hidden norms within 2 % of the numpy backend's."""
    from atlas.llm import load_model

    prompt = "Beautiful is better than ugly."
    norms = {}
    for device in ("cpu", "cuda"):
        monkeypatch.setenv("ATLAS_DUMP", "layers")
        monkeypatch.setenv("ATLAS_DUMP_DIR", str(tmp_path / device))
        try:
            loaded = load_model(None, device)
        except (AtlasError, ImportError) as err:
            if os.environ.get("ATLAS_REQUIRE_GPU") == "1":
                raise
            pytest.skip(f"no CUDA backend here: {err}")
        loaded.engine.prefill(loaded.tokenizer.encode(prompt))
        [run_dir] = list((tmp_path / device).iterdir())
        norms[device] = read_steps(run_dir)[1][0]["norms"]
    assert set(norms["cuda"]) == set(norms["cpu"])
    for name, values in norms["cpu"].items():
        np.testing.assert_allclose(norms["cuda"][name], values, rtol=0.02, err_msg=name)


def test_a_full_disk_mid_run_keeps_whole_steps_only(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    rng: np.random.Generator) -> None:
    """A dump that ran out of room had left the failing step's directory half written."""
    import errno

    import atlas.dump as dump

    real_save, saved = np.save, []

    def save(handle: Any, array: np.ndarray) -> None:
        if "step-0001" in handle.name:
            saved.append(handle.name)
            if len(saved) == 3:
                raise OSError(errno.ENOSPC, "No space left on device")
        real_save(handle, array)

    monkeypatch.setattr(dump.np, "save", save)
    monkeypatch.setenv("ATLAS_DUMP", "all")
    monkeypatch.setenv("ATLAS_DUMP_DIR", str(tmp_path / "dumps"))
    with pytest.raises(AtlasError, match="No space left on device.*ATLAS_DUMP_DIR"):
        new_engine(model_dir).generate(random_prompt(rng), NEW_TOKENS, SamplingParams(), None, set())
    [run_dir] = list((tmp_path / "dumps").iterdir())
    index, steps = read_steps(run_dir)
    assert [s["step"] for s in steps] == [0] and len(saved) == 3
    assert sorted(p.name for p in run_dir.iterdir()) == ["index.json", "step-0000", "step-0000.json"]
    assert all((run_dir / entry["file"]).is_file() for entry in steps[0]["tensors"].values())
    assert not [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")]
