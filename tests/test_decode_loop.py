"""The decode loop running ahead (atlas.decode_loop): on a backend that queues its work, the step
that feeds token N and token N+1's pick are issued before token N is read back. The tokens equal
the loop that reads each token first (greedy, sampled, penalties, min_tokens; generate and
stream); a stop leaves one step computed ahead, whose token the prompt cache records; logprobs and
host picks keep the loop in turn; a failed read makes the prompt cache forget."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from _checkpoints import random_checkpoint_dir
from atlas.backends.base import NO_TOKEN, SamplingParams, Tensor
from atlas.backends.numpy_backend import NumpyBackend
from atlas.config import load_spec
from atlas.engine import Engine
from atlas.errors import AtlasError
from atlas.llm import GenerateOptions, SamplingExtras, iter_tokens
from atlas.safetensors import Checkpoint
from test_engine_device_chain import IDS, SETTINGS, TINY, stream_options


@dataclass
class LoggedRead:
    backend: AheadBackend
    t: Tensor
    pick: int  # which pick it reads (1 = the prefill's)

    def result(self) -> np.ndarray:
        self.backend.log.append(("read", self.pick))
        return NumpyBackend.to_numpy(self.backend, self.t)


class AheadBackend(NumpyBackend):
    """The numpy backend asking for the loop to run ahead, logging picks, decode steps and reads
    (at once or through read_later) in the order the engine issues them."""

    runs_ahead = True

    def __init__(self, poisoned_pick: int = 0) -> None:
        self.log: list[tuple[str, int]] = []
        self.picks: list[Tensor] = []
        self.poisoned_pick = poisoned_pick  # this pick gives NO_TOKEN (a state gone NaN)

    def _picked(self, token: Tensor) -> Tensor:
        self.log.append(("pick", self.count("pick") + 1))
        if self.count("pick") == self.poisoned_pick:
            token = np.array([NO_TOKEN], dtype=np.int32)
        self.picks.append(token)
        return token

    def count(self, what: str) -> int:
        return sum(1 for kind, _ in self.log if kind == what)

    def argmax(self, logits: Tensor) -> Tensor:
        return self._picked(super().argmax(logits))

    def sample(self, logits: Tensor, params: SamplingParams, uniform: float) -> Tensor:
        return self._picked(super().sample(logits, params, uniform))

    def read_later(self, t: Tensor) -> LoggedRead:
        return LoggedRead(self, t, self.count("pick"))

    def to_numpy(self, t: Tensor) -> np.ndarray:
        if any(t is pick for pick in self.picks):  # read at once
            self.log.append(("read", len(self.picks)))
        return super().to_numpy(t)

    def make_decode_step(self, step: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
        def logged(ids: Tensor, positions: Tensor) -> Tensor:
            self.log.append(("decode", self.count("decode") + 1))
            return step(ids, positions)

        return logged

    def decodes_before_each_read(self) -> list[int]:
        out, decodes = [], 0
        for kind, _ in self.log:
            decodes += kind == "decode"
            if kind == "read":
                out.append(decodes)
        return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_checkpoint_dir(tmp_path_factory, "tiny_ahead", TINY)


def _engine(model_dir: Path, backend: NumpyBackend, prompt_cache: int = 0) -> Engine:
    return Engine(load_spec(model_dir), Checkpoint.open(model_dir), backend, max_seq_len=64, prompt_cache=prompt_cache)


@pytest.mark.parametrize("sampling", SETTINGS, ids=IDS)
def test_generate_runs_ahead_with_the_tokens_in_turn(model_dir: Path, rng: np.random.Generator,
                                                     sampling: SamplingParams) -> None:
    prompt = rng.integers(0, TINY.vocab_size, 12).tolist()
    seed = int(rng.integers(0, 2**31))
    ahead = AheadBackend()
    got = _engine(model_dir, ahead).generate(prompt, 16, sampling, seed, set()).token_ids
    assert got == _engine(model_dir, NumpyBackend()).generate(prompt, 16, sampling, seed, set()).token_ids
    # The first token is read at once (it streams before the first step is captured); from the
    # second on, token N is read once the step feeding it is issued (N+1's pick too); the last
    # feeds nothing.
    assert ahead.decodes_before_each_read() == [0, *range(2, 16), 15]
    assert ahead.count("pick") == 16


@pytest.mark.parametrize("sampling", SETTINGS, ids=IDS)
def test_stream_runs_ahead_with_the_tokens_in_turn(model_dir: Path, rng: np.random.Generator,
                                                   sampling: SamplingParams) -> None:
    prompt = rng.integers(0, TINY.vocab_size, 9).tolist()
    opts = stream_options(sampling, 10, int(rng.integers(0, 2**31)))
    ahead = AheadBackend()
    streamed = list(iter_tokens(_engine(model_dir, ahead), prompt, opts, set()))
    assert streamed == list(iter_tokens(_engine(model_dir, NumpyBackend()), prompt, opts, set()))
    assert ahead.decodes_before_each_read() == [0, *range(2, 10), 9]


def test_a_stop_leaves_one_step_ahead_that_the_prompt_cache_records(model_dir: Path, rng: np.random.Generator) -> None:
    prompt = rng.integers(0, TINY.vocab_size, 10).tolist()
    free = _engine(model_dir, NumpyBackend()).generate(prompt, 12, SamplingParams(), None, set()).token_ids
    stop = next(i for i, token in enumerate(free) if i >= 2 and token not in free[:i])  # its first occurrence
    ahead = AheadBackend()
    engine = _engine(model_dir, ahead, prompt_cache=2)
    got = engine.generate(prompt, 12, SamplingParams(), None, {free[stop]}).token_ids
    assert got == free[: stop + 1]
    assert ahead.count("decode") == stop + 1  # one more than the loop in turn runs: it fed the stop token
    assert engine.prompt_cache.history == prompt + got
    follow = prompt + got + rng.integers(0, TINY.vocab_size, 3).tolist()
    again = engine.generate(follow, 6, SamplingParams(), None, set())
    assert again.cached_tokens == len(prompt) + len(got)
    assert again.token_ids == _engine(model_dir, NumpyBackend()).generate(follow, 6, SamplingParams(), None, set()).token_ids


def test_logprobs_and_host_picks_keep_the_loop_in_turn(model_dir: Path, rng: np.random.Generator) -> None:
    prompt = rng.integers(0, TINY.vocab_size, 8).tolist()
    scored = GenerateOptions(max_tokens=6, logprobs=2)
    on_host = GenerateOptions(max_tokens=6, temperature=0.8, seed=3, extras=SamplingExtras(typical_p=0.9))
    for opts in (scored, on_host):
        in_turn = AheadBackend()
        in_turn.runs_ahead = False
        want = list(iter_tokens(_engine(model_dir, in_turn), prompt, opts, set()))
        asked = AheadBackend()
        assert list(iter_tokens(_engine(model_dir, asked), prompt, opts, set())) == want
        assert asked.log == in_turn.log
    assert asked.count("pick") == 0 and asked.count("decode") == 5  # typical-p picks on the host
    scored_run = AheadBackend()
    list(iter_tokens(_engine(model_dir, scored_run), prompt, scored, set()))
    assert scored_run.decodes_before_each_read() == list(range(6))  # each pick read before its step


def test_a_failed_read_while_ahead_forgets_the_state(model_dir: Path, rng: np.random.Generator) -> None:
    prompt = rng.integers(0, TINY.vocab_size, 10).tolist()
    engine = _engine(model_dir, AheadBackend(poisoned_pick=4), prompt_cache=2)
    with pytest.raises(AtlasError, match="NaN"):
        engine.generate(prompt, 10, SamplingParams(), None, set())
    assert engine.prompt_cache.history is None
