"""Logprobs of generated tokens (LLM.generate(logprobs=N), the server's logprobs fields): each
token's log-probability under the model's raw logits, checked against a log-softmax of the
teacher-forced logits of the whole sequence; the N most likely tokens in order; speculative
engines answer such requests on the plain path with the same tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from atlas import LLM
from atlas.backends.base import SamplingParams
from atlas.engine import GenerationRequest
from atlas.errors import AtlasError
from atlas.sampling import token_logprob, top_order
from atlas.speculative import SpecStats
from test_speculative import GREEDY, NO_EOS, plain_engine, spec_engine
from test_speculative import demo_mtp as demo_mtp  # noqa: F401  (the module-scoped fixture)

VOCAB = 512  # the demo's


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    return z - (z.max(-1, keepdims=True) + np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_are_the_teacher_forced_log_softmax(rng: np.random.Generator, temperature: float) -> None:
    llm = LLM(device="cpu")
    prompt = rng.integers(0, VOCAB, int(rng.integers(3, 40))).tolist()
    top = int(rng.integers(0, 21))
    result = llm.generate(prompt, max_tokens=10, temperature=temperature, seed=3, logprobs=top)
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    forced = log_softmax(np.asarray(llm.parts.engine.logits(prompt + result.token_ids)))[len(prompt) - 1 :]  # [N+1, V]
    for i, (token, scored) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
        assert scored.token == token
        assert scored.logprob == pytest.approx(forced[i, token], abs=1e-4)
        assert scored.rank is not None  # the tokens at or above it (itself included), near ties either way
        assert 1 + (forced[i] > forced[i, token] + 1e-4).sum() <= scored.rank <= (forced[i] >= forced[i, token] - 1e-4).sum()
        listed = [t for t, _ in scored.top]
        assert len(set(listed)) == len(listed) == top
        assert [lp for _, lp in scored.top] == pytest.approx(np.sort(forced[i])[::-1][:top].tolist(), abs=1e-4)
        assert [lp for _, lp in scored.top] == pytest.approx(forced[i, listed].tolist(), abs=1e-4)
        if temperature == 0 and top:
            assert scored.top[0][0] == token
    plain = llm.generate(prompt, max_tokens=10, temperature=temperature, seed=3)
    assert plain.token_ids == result.token_ids and plain.logprobs is None


def test_token_logprob_edges() -> None:
    logits = np.array([1.0, np.nan, 3.0, 3.0, -np.inf], dtype=np.float32)
    scored = token_logprob(logits, 0, 5)
    assert [t for t, _ in scored.top] == [2, 3, 0, 1, 4]  # ties: lower id first; NaN reads as -inf
    assert scored.rank == 3  # the two 3.0s above it
    assert [token_logprob(logits, t, 0).rank for t in (2, 3, 1, 4)] == [2, 2, 5, 5]  # ties count against each other
    assert np.exp([lp for _, lp in scored.top]).sum() == pytest.approx(1.0)
    assert scored.logprob == pytest.approx(1.0 - np.log(np.exp(1.0) + 2 * np.exp(3.0)))
    flat = token_logprob(np.full(4, -np.inf, dtype=np.float32), 1, 2)
    assert flat.logprob == pytest.approx(-np.log(4)) and len(flat.top) == 2
    assert token_logprob(logits, 2, 0).top == ()


@pytest.mark.parametrize("bad", [-1, 21, 1.0, "2", True])
def test_bad_logprobs_is_one_line(bad: object) -> None:
    with pytest.raises(AtlasError, match="logprobs must be None"):
        LLM(device="cpu").generate("Flat is", max_tokens=2, logprobs=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("sampled", [False, True])
def test_speculative_engine_scores_the_verified_rows(demo_mtp: Path, rng: np.random.Generator, sampled: bool) -> None:
    """Logprobs with speculation: each emitted token scored on its verify-pass row, as the plain
    engine scores it on its decode step (the same tokens, log-probabilities and alternatives)."""
    model_dir = demo_mtp
    prompt = rng.integers(0, VOCAB, 20).tolist()
    sampling = SamplingParams(temperature=0.9, top_k=20) if sampled else GREEDY
    request = GenerationRequest(prompt, 12, sampling, int(rng.integers(1 << 30)), NO_EOS, logprobs=2)
    stats = spec_engine(model_dir, 2).run(request)
    assert isinstance(stats, SpecStats) and stats.drafted > 0 and len(stats.logprobs) == 12
    want = plain_engine(model_dir).run(request)
    assert stats.token_ids == want.token_ids
    assert [s.token for s in stats.logprobs] == stats.token_ids
    assert [s.logprob for s in stats.logprobs] == pytest.approx([s.logprob for s in want.logprobs], abs=1e-5)
    for got, expected in zip(stats.logprobs, want.logprobs, strict=True):
        assert [i for i, _ in got.top] == [i for i, _ in expected.top]


def test_speculative_engine_scores_the_prompt_on_the_plain_path(demo_mtp: Path, rng: np.random.Generator) -> None:
    prompt = rng.integers(0, VOCAB, 20).tolist()
    request = GenerationRequest(prompt, 6, GREEDY, None, NO_EOS, prompt_logprobs=1)
    stats = spec_engine(demo_mtp, 2).run(request)
    assert not isinstance(stats, SpecStats) and len(stats.prompt_logprobs) == 20
    assert stats.token_ids == plain_engine(demo_mtp).run(request).token_ids


@pytest.mark.parametrize("chunk", [4096, 37])
def test_prompt_logprobs_are_the_teacher_forced_log_softmax(rng: np.random.Generator, chunk: int) -> None:
    """Every prompt token after the first, under the logits of the one before it (passes of
    `chunk` tokens, rows scored in blocks), after a cached run of the same prompt (scoring runs the
    whole prompt again)."""
    llm = LLM(device="cpu")
    llm.parts.engine.prefill_chunk = chunk
    prompt = rng.integers(0, VOCAB, int(rng.integers(70, 160))).tolist()
    top = int(rng.integers(0, 4))
    llm.generate(prompt, max_tokens=3)
    result = llm.generate(prompt, max_tokens=int(rng.integers(0, 3)), prompt_logprobs=top)
    assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == len(prompt)
    assert result.prompt_logprobs[0] is None and result.cached_tokens == 0
    forced = log_softmax(np.asarray(llm.parts.engine.logits(prompt)))  # [T, V]
    for p, scored in enumerate(result.prompt_logprobs[1:], start=1):
        assert scored is not None and scored.token == prompt[p]
        assert scored.logprob == pytest.approx(forced[p - 1, prompt[p]], abs=1e-4)
        assert [lp for _, lp in scored.top] == pytest.approx(np.sort(forced[p - 1])[::-1][:top].tolist(), abs=1e-4)


def test_max_tokens_zero_needs_prompt_logprobs() -> None:
    with pytest.raises(AtlasError, match="max_tokens must be an integer >= 1"):
        LLM(device="cpu").generate("Flat is", max_tokens=0)
    assert LLM(device="cpu").generate("Flat is", max_tokens=0, prompt_logprobs=0).token_ids == []


def test_top_order_is_the_full_sorts_head(rng: np.random.Generator) -> None:
    """The alternatives come from the values at or above the top-th largest, not a sort of the
    row; the order is still the full sort's (largest first, ties the lower id first)."""
    for _ in range(300):
        values = rng.integers(-5, 5, int(rng.integers(1, 300))).astype(np.float64)  # many ties
        if rng.random() < 0.3:
            values[rng.integers(0, values.size, 3)] = -np.inf
        top = int(rng.integers(0, values.size + 3))
        np.testing.assert_array_equal(top_order(values, top), np.lexsort((np.arange(values.size), -values))[:top])
