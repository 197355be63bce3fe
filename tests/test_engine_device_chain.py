"""The greedy chain stays on the backend: the id tensor a step picks is what the next decode step
receives (no host round trip but reading the id to stream it), with the same tokens as the
host-fed loop (Engine.decode(int)) for greedy and seeded sampling, with and without penalties and
logit_bias (applied and counted on the backend), in generate and in stream."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from _checkpoints import TinyModel, random_checkpoint_dir
from atlas.backends.base import SamplingParams, Tensor
from atlas.backends.numpy_backend import NumpyBackend
from atlas.config import load_spec
from atlas.engine import Engine
from atlas.errors import AtlasError
from atlas.llm import GenerateOptions, SamplingExtras, iter_tokens
from atlas.safetensors import Checkpoint
from atlas.sampling import PROMPT_TOKEN, penalize_row

TINY = TinyModel(vocab_size=96, num_experts=4)
SETTINGS = [
    SamplingParams(), SamplingParams(temperature=0.9, top_k=20, top_p=0.95),
    SamplingParams(repetition_penalty=3.0, presence_penalty=1.5, frequency_penalty=0.5, logit_bias=((5, -100.0), (7, 4.0))),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.95, min_p=0.05, presence_penalty=1.5, min_tokens=4),
]
IDS = ["greedy", "sampled", "penalized-greedy", "penalized-sampled"]


class ChainBackend(NumpyBackend):
    """Records the id tensors it hands out and checks that every decode step is fed one of them
    (the very object, as a device tensor would be) rather than a fresh upload, that the penalty
    counts are fed the same, and that nothing wider than an id is read back."""

    def __init__(self) -> None:
        self.picked: list[Tensor] = []
        self.fed_picked = 0
        self.counted = 0
        self.widest_read = 0

    def to_numpy(self, t: Tensor) -> np.ndarray:
        self.widest_read = max(self.widest_read, int(np.size(t)))
        return super().to_numpy(t)

    def count_token(self, counts: Tensor, token: Tensor) -> None:
        assert self.picked and token is self.picked[-1], "the counts were given something other than the last pick"
        self.counted += 1
        super().count_token(counts, token)

    def argmax(self, logits: Tensor) -> Tensor:
        self.picked.append(super().argmax(logits))
        return self.picked[-1]

    def sample(self, logits: Tensor, params: SamplingParams, uniform: float) -> Tensor:
        self.picked.append(super().sample(logits, params, uniform))
        return self.picked[-1]

    def make_decode_step(self, step: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
        def replay(ids: Tensor, positions: Tensor) -> Tensor:
            assert self.picked and ids is self.picked[-1], "decode step fed something other than the last pick"
            self.fed_picked += 1
            return step(ids, positions)

        return replay


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_checkpoint_dir(tmp_path_factory, "tiny_chain", TINY)


def _engine(model_dir: Path, backend: NumpyBackend) -> Engine:
    return Engine(load_spec(model_dir), Checkpoint.open(model_dir), backend, max_seq_len=64)


def _host_fed_tokens(engine: Engine, prompt: list[int], count: int, sampling: SamplingParams, seed: int) -> list[int]:
    """Fed token by token from the host, with the penalties written out on the host: each pick is
    the backend's argmax / sample of penalize_row over the history so far."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(TINY.vocab_size, dtype=np.int32)  # [V]
    flags = np.zeros(TINY.vocab_size, dtype=np.int32)  # [V]
    flags[prompt] = PROMPT_TOKEN
    bias = np.zeros(TINY.vocab_size, dtype=np.float32)  # [V]
    for token, value in sampling.logit_bias:
        bias[token] += np.float32(value)
    plain = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    tokens: list[int] = []
    logits = engine.prefill(prompt)
    for position in range(len(prompt), len(prompt) + count):
        row = penalize_row(logits[0], counts, flags, bias, sampling, len(tokens) < sampling.min_tokens)
        tokens.append(engine.pick(row[None], plain, rng))
        counts[tokens[-1]] += 1
        logits = engine.decode(tokens[-1], position)
    return tokens


@pytest.mark.parametrize("sampling", SETTINGS, ids=IDS)
def test_generate_feeds_the_picked_tensor_with_host_fed_tokens(model_dir: Path, rng: np.random.Generator,
                                                               sampling: SamplingParams) -> None:
    prompt = rng.integers(0, TINY.vocab_size, 12).tolist()
    seed = int(rng.integers(0, 2**31))
    chain = ChainBackend()
    got = _engine(model_dir, chain).generate(prompt, 16, sampling, seed, set()).token_ids
    assert chain.fed_picked == 15  # every decode step after the prefill's pick
    assert chain.counted == (16 if sampling.adjusts_logits else 0) and chain.widest_read == 1
    want = _host_fed_tokens(_engine(model_dir, NumpyBackend()), prompt, 16, sampling, seed)
    assert got == want


def stream_options(sampling: SamplingParams, max_tokens: int, seed: int) -> GenerateOptions:
    """The LLM options that stream with `sampling`."""
    extras = SamplingExtras(sampling.min_p, sampling.presence_penalty, sampling.frequency_penalty,
                            sampling.repetition_penalty, sampling.min_tokens, sampling.logit_bias)
    return GenerateOptions(max_tokens=max_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
                           top_p=sampling.top_p, seed=seed, extras=extras)


@pytest.mark.parametrize("sampling", SETTINGS, ids=IDS)
def test_stream_feeds_the_picked_tensor_with_generate_tokens(model_dir: Path, rng: np.random.Generator,
                                                             sampling: SamplingParams) -> None:
    prompt = rng.integers(0, TINY.vocab_size, 9).tolist()
    seed = int(rng.integers(0, 2**31))
    chain = ChainBackend()
    opts = stream_options(sampling, 10, seed)
    streamed = list(iter_tokens(_engine(model_dir, chain), prompt, opts, set()))
    assert chain.fed_picked == 9 and chain.widest_read == 1
    assert streamed == _host_fed_tokens(_engine(model_dir, NumpyBackend()), prompt, 10, sampling, seed)


def test_decode_tensor_logits_equal_decode(model_dir: Path, rng: np.random.Generator) -> None:
    prompt = rng.integers(0, TINY.vocab_size, 7).tolist()
    engine = _engine(model_dir, NumpyBackend())
    token, token_t = engine.pick_tensor(engine.prefill(prompt), SamplingParams(), rng)
    assert isinstance(token_t, np.ndarray) and token_t.shape == (1,) and int(token_t[0]) == token
    from_tensor = engine.backend.to_numpy(engine.decode_tensor(token_t, len(prompt)))
    engine.prefill(prompt)
    np.testing.assert_array_equal(engine.backend.to_numpy(engine.decode(token, len(prompt))), from_tensor)


def test_decode_tensor_refuses_bad_shapes_and_positions(model_dir: Path) -> None:
    engine = _engine(model_dir, NumpyBackend())
    engine.prefill([1, 2, 3])
    with pytest.raises(AtlasError, match="shape"):
        engine.decode_tensor(np.array([1, 2], dtype=np.int32), 3)
    with pytest.raises(AtlasError, match="max_seq_len"):
        engine.decode_tensor(np.array([1], dtype=np.int32), 64)
