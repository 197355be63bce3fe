"""Saved sequences (atlas.sequence_state) on the numpy backend: a sequence saved after a chat turn
and restored into a freshly loaded engine continues exactly as the engine that saved it does
(same tokens, same prompt tokens reused) with plain and quantized KV levels and with MTP
speculation, and saving it again gives the same bytes; a file the engine cannot take is one line
and changes nothing; a failed save leaves no file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from atlas import sequence_state
from atlas.backends.base import SamplingParams
from atlas.backends.numpy_backend import NumpyBackend
from atlas.config import load_spec
from atlas.demo import DEMO_DIR
from atlas.engine import Engine, GenerationRequest
from atlas.errors import AtlasError
from atlas.kvcache import KVCacheOptions
from atlas.quant.writer import write_safetensors
from atlas.safetensors import Checkpoint, read_metadata
from atlas.sequence_state import erase_sequence, restore_sequence, save_sequence
from atlas.speculative import SpeculativeEngine
from test_speculative import demo_mtp as demo_mtp  # noqa: F401  (the module-scoped fixture)

GREEDY = SamplingParams()
NO_EOS: set[int] = set()
VOCAB = 512  # the demo's
NEW_TOKENS = 6
FORMS = ("bf16", "turbo4", "fp8-speculative")


def engine(form: str = "bf16", model_dir: Path = DEMO_DIR, max_seq_len: int = 256, prompt_cache: int = 4) -> Engine:
    level = form.split("-")[0]
    kv = KVCacheOptions(level, high_precision_layers=0)
    if form.endswith("speculative"):
        return SpeculativeEngine(load_spec(model_dir), Checkpoint.open(model_dir), NumpyBackend(), 2,
                                 max_seq_len=max_seq_len, kv_cache=kv, prompt_cache=prompt_cache)
    return Engine(load_spec(model_dir), Checkpoint.open(model_dir), NumpyBackend(), max_seq_len, kv_cache=kv,
                  prompt_cache=prompt_cache)


def ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB, size=n).tolist()


def first_turn(e: Engine, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    prompt = ids(rng, int(rng.integers(70, 140)))
    return prompt, e.generate(prompt, NEW_TOKENS, GREEDY, None, NO_EOS).token_ids


@pytest.mark.parametrize("form", FORMS)
def test_a_restored_sequence_continues_as_the_saved_one(form: str, demo_mtp: Path, rng: np.random.Generator,
                                                        tmp_path: Path) -> None:
    model_dir = demo_mtp if form.endswith("speculative") else DEMO_DIR
    saver = engine(form, model_dir)
    prompt, generated = first_turn(saver, rng)
    saved = save_sequence(saver, tmp_path / "chat.seq")
    # the live states hold every token fed (the last one generated is not); a speculative engine
    # resumes only at checkpoints with the head's row: the prompt's end
    assert saved.tokens == (len(prompt) if form.endswith("speculative") else len(prompt) + NEW_TOKENS - 1)
    assert saved.nbytes == (tmp_path / "chat.seq").stat().st_size
    restorer = engine(form, model_dir)
    restorer.generate(ids(rng, 30), 3, GREEDY, None, NO_EOS)  # a state of its own, which the restore replaces
    assert restore_sequence(restorer, tmp_path / "chat.seq") == saved
    save_sequence(restorer, tmp_path / "again.seq")
    assert (tmp_path / "again.seq").read_bytes() == (tmp_path / "chat.seq").read_bytes()

    second = GenerationRequest(prompt + generated + ids(rng, 7), NEW_TOKENS, GREEDY, None, NO_EOS, logprobs=5)
    want, got = saver.run(second), restorer.run(second)
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs  # every score to the last bit
    assert got.cached_tokens == want.cached_tokens == saved.tokens


def test_a_prompt_equal_to_a_saved_checkpoint_needs_no_pass(rng: np.random.Generator, tmp_path: Path) -> None:
    """The file keeps a checkpoint's last row, so the prompt it ends needs no pass after a restore."""
    saver = engine()
    prompt = ids(rng, 90)
    saver.generate(prompt, 1, GREEDY, None, NO_EOS)  # one token: the live states end at the prompt's checkpoint
    assert save_sequence(saver, tmp_path / "s").tokens == len(prompt)
    assert "hidden" in Checkpoint.open_files(tmp_path / "s", [tmp_path / "s"])
    restorer = engine()
    restore_sequence(restorer, tmp_path / "s")
    want = saver.generate(prompt, NEW_TOKENS, GREEDY, None, NO_EOS)
    got = restorer.generate(prompt, NEW_TOKENS, GREEDY, None, NO_EOS)
    assert got.token_ids == want.token_ids and got.cached_tokens == len(prompt)


def test_erase_and_an_empty_sequence(rng: np.random.Generator, tmp_path: Path) -> None:
    e = engine()
    assert save_sequence(e, tmp_path / "empty").tokens == 0
    prompt, generated = first_turn(e, rng)
    assert erase_sequence(e) == len(prompt) + NEW_TOKENS - 1
    assert e.generate(prompt + generated, 2, GREEDY, None, NO_EOS).cached_tokens == 0
    first_turn(e, rng)
    assert restore_sequence(e, tmp_path / "empty").tokens == 0
    assert e.generate(prompt, 2, GREEDY, None, NO_EOS).cached_tokens == 0


def rewritten(source: Path, target: Path, change: str) -> Path:
    """source's tensors and metadata with one thing changed."""
    saved = Checkpoint.open_files(source, [source])
    tensors = {name: np.array(saved.get_raw(name)) for name in saved.names()}
    metadata = read_metadata(source)
    saved.close()
    recurrent = next(name for name in tensors if name.endswith(".recurrent"))
    if change == "shape":
        tensors[recurrent] = tensors[recurrent][:1]
    elif change == "missing tensor":
        del tensors[recurrent]
    elif change == "format":
        metadata["format"] = "something/1"
    elif change == "tokens":
        tensors["tokens"] = tensors["tokens"].astype(np.int64)
    elif change == "a token past the vocabulary":
        tensors["tokens"][-1] = VOCAB
    elif change == "layout":
        metadata["layout"] = "[1, 2"
    write_safetensors(target, tensors, metadata)
    return target


BAD_FILES = ("missing", "not safetensors", "truncated", "shape", "missing tensor", "format", "tokens",
             "a token past the vocabulary", "layout", "other kv level", "longer than the context", "speculative")


@pytest.mark.parametrize("bad", BAD_FILES)
def test_a_file_the_engine_cannot_take_is_one_line_and_changes_nothing(bad: str, demo_mtp: Path,
                                                                       rng: np.random.Generator, tmp_path: Path) -> None:
    saver = engine("bf16-speculative", demo_mtp) if bad == "speculative" else engine()
    first_turn(saver, rng)
    good = tmp_path / "good"
    save_sequence(saver, good)
    target = tmp_path / "bad"
    restorer = engine("turbo4" if bad == "other kv level" else "bf16", demo_mtp if bad == "speculative" else DEMO_DIR,
                      max_seq_len=64 if bad == "longer than the context" else 256)
    if bad == "not safetensors":
        target.write_bytes(rng.bytes(300))
    elif bad == "truncated":
        target.write_bytes(good.read_bytes()[:-100])
    elif bad in ("other kv level", "longer than the context", "speculative"):
        target = good
    elif bad != "missing":
        rewritten(good, target, bad)
    mine = ids(rng, 20)
    restorer.generate(mine, 3, GREEDY, None, NO_EOS)
    with pytest.raises(AtlasError) as err:
        restore_sequence(restorer, target)
    assert "\n" not in str(err.value) and str(target) in str(err.value)
    assert restorer.generate(mine + ids(rng, 3), 2, GREEDY, None, NO_EOS).cached_tokens == len(mine)  # state intact


def test_saving_and_restoring_need_the_prompt_cache(rng: np.random.Generator, tmp_path: Path) -> None:
    with pytest.raises(AtlasError, match="prompt cache is off"):
        save_sequence(engine(prompt_cache=0), tmp_path / "s")
    assert not list(tmp_path.iterdir())
    saver = engine()
    first_turn(saver, rng)
    save_sequence(saver, tmp_path / "s")
    with pytest.raises(AtlasError, match="prompt cache is off"):
        restore_sequence(engine(prompt_cache=0), tmp_path / "s")


def test_a_failed_save_leaves_no_file(rng: np.random.Generator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    e = engine()
    first_turn(e, rng)
    (tmp_path / "s").write_bytes(b"an older save")

    def disk_full(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
        path.write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sequence_state, "write_safetensors", disk_full)
    with pytest.raises(AtlasError, match="No space left on device"):
        save_sequence(e, tmp_path / "s")
    assert [p.name for p in tmp_path.iterdir()] == ["s"] and (tmp_path / "s").read_bytes() == b"an older save"
