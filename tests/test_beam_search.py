"""vLLM's beam search (atlas.beam_search): the kept beams are the best by vLLM's score, each one's
cumulative logprob is what the model gives its tokens teacher-forced, width 1 is greedy decoding,
and an eos completes a beam."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from atlas import LLM, SamplingParams
from atlas.beam_search import BeamSearchOutput, beam_search_score
from atlas.errors import AtlasError
from atlas.sampling_params import BeamSearchParams
from runtime_checkpoint import fresh_tiny_checkpoint

WORDS = ["Beautiful", "is", "better", "than", "ugly", "Flat", "dense.", "Sparse", "nested"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    """Random weights: the next-token distributions are flat enough for beams to differ."""
    return LLM(str(fresh_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))), device="cpu", max_seq_len=96)


def prompt_of(rng: np.random.Generator) -> str:
    return " ".join(rng.choice(WORDS, size=int(rng.integers(2, 6))))


def teacher_forced(llm: LLM, tokens: list[int], start: int) -> float:
    """The summed logprobs of tokens[start:], each given the tokens before it, from one prompt pass."""
    scored = llm.generate(tokens, max_tokens=0, prompt_logprobs=0).prompt_logprobs
    return float(sum(s.logprob for s in scored[start:]))  # type: ignore[union-attr]


def test_width_one_is_greedy(tiny: LLM, rng: np.random.Generator) -> None:
    prompt, n = prompt_of(rng), int(rng.integers(2, 10))
    (output,) = tiny.beam_search(prompt, BeamSearchParams(beam_width=1, max_tokens=n, ignore_eos=True))
    greedy = tiny.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True)
    (beam,) = output.sequences
    assert beam.tokens == tiny.tokenizer.encode(prompt) + greedy.token_ids
    assert (beam.text, beam.finish_reason) == (greedy.text, "length")


def test_the_kept_beams_are_the_best_and_scored_as_the_model_scores_them(tiny: LLM, rng: np.random.Generator) -> None:
    """Ordered by vLLM's score, distinct, each cum_logprob the teacher-forced sum of its tokens, and
    each step's logprobs listing the token taken; one step keeps exactly the width most likely tokens."""
    prompt, width = prompt_of(rng), int(rng.integers(2, 5))
    penalty, n = float(rng.choice([0.0, 1.0, 2.0])), int(rng.integers(2, 7))
    (output,) = tiny.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=n, ignore_eos=True,
                                                            length_penalty=penalty))
    start = len(tiny.tokenizer.encode(prompt))
    assert len(output.sequences) == width and len({tuple(b.tokens) for b in output.sequences}) == width
    scores = [beam_search_score(b.tokens, b.cum_logprob, set(), penalty) for b in output.sequences]
    assert scores == sorted(scores, reverse=True)
    for beam in output.sequences:
        assert len(beam.tokens) == start + n and len(beam.logprobs) == n
        assert beam.cum_logprob == pytest.approx(teacher_forced(tiny, beam.tokens, start), abs=1e-4)
        assert all(token in step for token, step in zip(beam.tokens[start:], beam.logprobs, strict=True))
    (one,) = tiny.beam_search(prompt, BeamSearchParams(beam_width=width, max_tokens=1, ignore_eos=True))
    top = tiny.generate(prompt, max_tokens=1, logprobs=width).logprobs[0].top  # type: ignore[index]
    assert [b.tokens[-1] for b in one.sequences] == [token for token, _ in top[:width]]


def test_an_eos_completes_a_beam() -> None:
    """The demo ends this line with its eos: the best beam stops there, its text without the eos."""
    demo = LLM(device="cpu", prompt_cache=0)
    prompt = "Namespaces are one honking great"
    (output,) = demo.beam_search({"prompt": prompt}, BeamSearchParams(beam_width=2, max_tokens=40))
    best = output.sequences[0]
    assert best.finish_reason == "stop" and best.tokens[-1] in demo.eos_ids()
    start = len(demo.tokenizer.encode(prompt))
    assert best.text == demo.tokenizer.decode(best.tokens[start:-1]) == demo.generate(prompt, max_tokens=40).text
    assert all(b.finish_reason in ("stop", "length") for b in output.sequences)


def test_a_batch_is_each_prompt_alone(tiny: LLM, rng: np.random.Generator) -> None:
    prompts = [prompt_of(rng), {"prompt_token_ids": tiny.tokenizer.encode(prompt_of(rng))}]
    params = BeamSearchParams(beam_width=2, max_tokens=int(rng.integers(1, 5)), ignore_eos=True)
    both = tiny.beam_search(prompts, params)
    assert all(isinstance(o, BeamSearchOutput) for o in both)
    assert [o.sequences for o in both] == [tiny.beam_search(p, params)[0].sequences for p in prompts]


@pytest.mark.parametrize("params, needle", [
    (BeamSearchParams(beam_width=0, max_tokens=4), "beam_width must be an integer in 1..10"),
    (BeamSearchParams(beam_width=11, max_tokens=4), "beam_width"),
    (BeamSearchParams(beam_width=2, max_tokens=0), "max_tokens must be an integer >= 1"),
    (BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos="yes"), "ignore_eos must be True or False"),  # type: ignore[arg-type]
    (BeamSearchParams(beam_width=2, max_tokens=500), "shorten the prompt"),
    (SamplingParams(), "must be an atlas.BeamSearchParams"),
])  # fmt: skip
def test_bad_params_are_one_line(tiny: LLM, params: object, needle: str) -> None:
    with pytest.raises(AtlasError, match=needle) as err:
        tiny.beam_search("Flat is", params)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_vllms_import_path(tmp_path: Path) -> None:
    import atlas.sampling_params as sampling_params

    assert sampling_params.BeamSearchParams is BeamSearchParams
