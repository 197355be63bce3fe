"""Engine behaviour: sampling, seeds, stopping, limits, state reset, dump hook, decode-step hook."""

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
from atlas.safetensors import Checkpoint
from atlas.sampling import choose_token, draw_uniform

TINY = TinyModel(vocab_size=96, num_experts=4)
GREEDY = SamplingParams()


class CountingBackend(NumpyBackend):
    """Counts decode-step wraps and calls, as a CUDA-graph backend would capture and replay."""

    def __init__(self) -> None:
        self.wraps = 0
        self.replays = 0

    def make_decode_step(self, step: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
        self.wraps += 1

        def replay(ids: Tensor, positions: Tensor) -> Tensor:
            self.replays += 1
            assert ids.dtype == np.int32 and positions.dtype == np.int32 and ids.shape == (1,)
            return step(ids, positions)

        return replay


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_checkpoint_dir(tmp_path_factory, "tiny", TINY)


@pytest.fixture
def engine(model_dir: Path) -> Engine:
    return Engine(load_spec(model_dir), Checkpoint.open(model_dir), CountingBackend(), max_seq_len=64)


@pytest.fixture
def prompt(rng: np.random.Generator) -> list[int]:
    return rng.integers(0, TINY.vocab_size, 20).tolist()


def test_seed_makes_sampling_reproducible(engine: Engine, prompt: list[int]) -> None:
    hot = SamplingParams(temperature=1.5)
    first = engine.generate(prompt, 24, hot, 7, set()).token_ids
    assert engine.generate(prompt, 24, hot, 7, set()).token_ids == first
    assert engine.generate(prompt, 24, hot, 8, set()).token_ids != first


def test_first_sampled_token_uses_the_seeded_uniform(engine: Engine, prompt: list[int]) -> None:
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9)
    logits = engine.backend.to_numpy(engine.prefill(prompt))[0]
    for seed in range(5):
        expected = choose_token(logits, params, draw_uniform(np.random.default_rng(seed)))
        assert engine.generate(prompt, 1, params, seed, set()).token_ids == [expected]


def test_top_k_one_equals_greedy(engine: Engine, prompt: list[int]) -> None:
    greedy = engine.generate(prompt, 16, GREEDY, None, set()).token_ids
    assert engine.generate(prompt, 16, SamplingParams(temperature=2.0, top_k=1), 3, set()).token_ids == greedy


def test_stops_at_eos_and_max_tokens(engine: Engine, prompt: list[int]) -> None:
    greedy = engine.generate(prompt, 20, GREEDY, None, set()).token_ids
    assert len(greedy) == 20
    eos = greedy[7]
    stopped = engine.generate(prompt, 20, GREEDY, None, {eos}).token_ids
    assert stopped == greedy[: greedy.index(eos) + 1]
    assert engine.generate(prompt, 5, GREEDY, None, set()).token_ids == greedy[:5]
    assert engine.generate(prompt, 0, GREEDY, None, set()).token_ids == []


def test_stats_and_decode_step_hook(engine: Engine, prompt: list[int]) -> None:
    backend = engine.backend
    assert isinstance(backend, CountingBackend)
    stats = engine.generate(prompt, 10, GREEDY, None, set())
    assert stats.prompt_tokens == len(prompt)
    assert stats.prefill_seconds > 0 and stats.decode_seconds > 0
    assert backend.wraps == 1 and backend.replays == 9  # the first token comes from the prefill


def test_prompt_in_passes_equals_one_pass(engine: Engine, rng: np.random.Generator) -> None:
    """The prompt prefilled `prefill_chunk` tokens a pass carries the caches and states from one
    pass to the next: the last token's logits, and a decode step after them, equal one pass's."""
    prompt = rng.integers(0, TINY.vocab_size, int(rng.integers(20, 60))).tolist()
    token = int(rng.integers(0, TINY.vocab_size))
    results = []
    for chunk in (len(prompt), int(rng.integers(1, len(prompt) // 2))):
        engine.prefill_chunk = chunk
        prefilled = np.array(engine.prefill(prompt))
        results.append((prefilled, np.array(engine.decode(token, len(prompt)))))
    (whole, whole_next), (passes, passes_next) = results
    for got, want in ((passes, whole), (passes_next, whole_next)):  # float32 rounding: ~1e-5 seen
        assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want), np.abs(got - want).max()


def test_generation_is_independent_of_earlier_calls(engine: Engine, prompt: list[int], rng: np.random.Generator) -> None:
    first = engine.generate(prompt, 12, GREEDY, None, set()).token_ids
    engine.generate(rng.integers(0, TINY.vocab_size, 30).tolist(), 12, GREEDY, None, set())
    assert engine.generate(prompt, 12, GREEDY, None, set()).token_ids == first


def test_dump_hook_names_every_intermediate(engine: Engine, prompt: list[int]) -> None:
    dumped: dict[str, np.ndarray] = {}
    engine.dump = lambda name, tensor: dumped.__setitem__(name, np.array(tensor))
    logits = engine.logits(prompt)
    layers = TINY.num_hidden_layers
    for i in range(layers):
        for part in ("input_norm", "attn_out", "post_norm", "mlp_out", "out", "mlp.routed", "mlp.shared"):
            assert f"layer.{i}.{part}" in dumped
    assert "layer.1.attn.q" in dumped and "layer.0.attn.core" in dumped
    np.testing.assert_array_equal(dumped["logits"], logits)
    assert dumped["embed"].shape == (len(prompt), TINY.hidden_size)


@pytest.mark.parametrize(
    "ids,max_tokens,params,fragment",
    [
        ([], 4, GREEDY, "empty"),
        ([1, TINY.vocab_size], 4, GREEDY, "outside the vocabulary"),
        ([1] * 60, 10, GREEDY, "max_seq_len"),
        ([1, 2], 4, SamplingParams(temperature=-1.0), "temperature"),
        ([1, 2], 4, SamplingParams(temperature=1.0, top_p=0.0), "top_p"),
        ([1, 2], 4, SamplingParams(temperature=1.0, top_k=-2), "top_k"),
        ([1, 2], -1, GREEDY, "max_tokens"),
        ([1, 2], 2.5, GREEDY, "max_tokens"),
    ],
)
def test_bad_requests_are_one_line_errors(engine: Engine, ids: list[int], max_tokens: int, params: SamplingParams, fragment: str) -> None:
    with pytest.raises(AtlasError, match=fragment):
        engine.generate(ids, max_tokens, params, None, set())


@pytest.mark.parametrize("seed", [-1, -(2**40), 1.5, "7", True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_bad_seed_is_one_line(engine: Engine, prompt: list[int], seed: object, temperature: float) -> None:
    with pytest.raises(AtlasError, match="seed must be a non-negative integer"):
        engine.generate(prompt, 4, SamplingParams(temperature=temperature), seed, set())  # type: ignore[arg-type]
    assert engine.generate(prompt, 2, SamplingParams(temperature=temperature), np.int64(3), set()).token_ids
