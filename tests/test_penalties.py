"""min_p, logit_bias and the presence / frequency / repetition penalties (Backend.penalize and
sample): the penalty formula against a direct one, logit_bias against the teacher-forced logits plus the bias, each greedy pick the argmax of the teacher-forced logits penalized by
the tokens before it, sampled picks inside the min_p set, the same tokens from generate() and
stream(), penalized requests on a speculative engine as on a plain one."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from atlas import LLM
from atlas.backends.base import SamplingParams
from atlas.backends.numpy_backend import NumpyBackend
from atlas.engine import GenerationRequest
from atlas.errors import AtlasError
from atlas.sampling import Penalties, softmax_probs
from test_speculative import NO_EOS, plain_engine, spec_engine
from test_speculative import demo_mtp as demo_mtp  # noqa: F401  (the module-scoped fixture)

VOCAB = 512  # the demo's
MAX_DRAWS = 10
TIE = 1e-4  # relative logit gap under which float32 rounding may decide a pick


def penalized(row: np.ndarray, prompt: list[int], before: list[int], p: SamplingParams) -> np.ndarray:
    """The penalties written out token by token."""
    z = row.astype(np.float64).copy()
    for t in set(prompt) | set(before):
        z[t] = z[t] / p.repetition_penalty if z[t] > 0 else z[t] * p.repetition_penalty
    for t in set(before):
        z[t] -= p.frequency_penalty * before.count(t) + p.presence_penalty
    return z


def random_params(rng: np.random.Generator, temperature: float = 0.0) -> SamplingParams:
    """Strong penalties: the demo's logits are confident, and a test must see picks they move."""
    return SamplingParams(
        temperature=temperature, presence_penalty=float(rng.choice([-1, 1]) * rng.uniform(1, 2)),
        frequency_penalty=float(rng.uniform(-2, 2)), repetition_penalty=float(rng.uniform(2.0, 6.0)),
        min_p=float(rng.uniform(0.05, 0.3)) if temperature else 0.0,
    )


def test_penalty_formula(rng: np.random.Generator) -> None:
    """Penalties.apply (the backend's penalize) against the penalties written out token by token,
    with logit_bias and the ending ids held off before min_tokens; picks counted both before the
    operands exist and after (count_token on the backend's counts)."""
    prompt = rng.integers(0, 50, 20).tolist()
    generated = rng.integers(0, 50, 30).tolist()
    ends = {int(rng.integers(0, 64)), 63}
    bias = {int(t): float(rng.uniform(-5, 5)) for t in rng.choice(64, 6, replace=False)}
    params = replace(random_params(rng), logit_bias=tuple(sorted(bias.items())), min_tokens=len(generated) + 1)
    backend, state = NumpyBackend(), Penalties(prompt, ends)
    row = rng.standard_normal(64).astype(np.float32) * 3  # [V]
    for t in generated[:10]:
        state.add(t)
    state.apply(backend, row[None], params)
    for t in generated[10:]:
        state.add(t, np.array([t], dtype=np.int32))
    biased = row.astype(np.float64)
    biased[list(bias)] += list(bias.values())
    want = penalized(biased, prompt, generated, params)
    got = state.apply(backend, row[None], params)[0]
    assert np.all(got[sorted(ends)] == -np.inf)
    live = np.setdiff1d(np.arange(64), sorted(ends))
    np.testing.assert_allclose(got[live], want[live], rtol=1e-5, atol=1e-5)
    state.add(int(live[0]))  # min_tokens reached: the ending ids come back
    assert np.all(np.isfinite(state.apply(backend, row[None], params)[0]))


def test_only_structured_output_picks_on_the_host() -> None:
    assert SamplingParams(min_p=0.1, presence_penalty=1.0, logit_bias=((3, 1.0),)).on_host is False
    assert SamplingParams(structured=True).on_host
    assert SamplingParams(logit_bias=((3, 1.0),)).adjusts_logits and SamplingParams(min_tokens=2).adjusts_logits
    assert not SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.1).adjusts_logits
    assert SamplingParams(min_p=0.1).raw_greedy and not SamplingParams(repetition_penalty=1.1).raw_greedy


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_picks_follow_the_penalized_logits(rng: np.random.Generator, temperature: float) -> None:
    """Checked at every step; at least one step's pick must be one the unpenalized logits would
    not allow (else the draw could not tell penalties from none: drawn again)."""
    llm = LLM(device="cpu", prompt_cache=0)
    for _ in range(MAX_DRAWS):
        prompt = rng.integers(0, VOCAB, int(rng.integers(3, 30))).tolist()
        params = random_params(rng, temperature)
        kwargs = {k: getattr(params, k) for k in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")}
        result = llm.generate(prompt, max_tokens=16, temperature=temperature, seed=7, **kwargs)
        streamed = "".join(llm.stream(prompt, max_tokens=16, temperature=temperature, seed=7, **kwargs))
        assert streamed == result.text
        forced = np.asarray(llm.parts.engine.logits(prompt + result.token_ids))[len(prompt) - 1 :]  # [N+1, V]
        moved = 0
        for i, token in enumerate(result.token_ids):
            z = penalized(forced[i], prompt, result.token_ids[:i], params)
            if temperature == 0:
                assert z[token] >= z.max() - TIE * np.abs(z).max(), f"step {i}: not the penalized argmax"
                moved += forced[i, token] < forced[i].max() - TIE * np.abs(forced[i]).max()
            else:
                probs = softmax_probs(z.astype(np.float32), temperature)
                assert probs[token] >= params.min_p * probs.max() * (1 - 1e-3), f"step {i}: outside the min_p set"
                raw = softmax_probs(forced[i].astype(np.float32), temperature)
                moved += raw[token] < params.min_p * raw.max() * (1 - 1e-3)
        if moved:
            return
    pytest.fail(f"penalties moved no pick in {MAX_DRAWS} draws")


def test_repetition_penalty_stops_a_loop() -> None:
    """The demo recites its text; a strong repetition penalty drives it off the words it has used."""
    llm = LLM(device="cpu", prompt_cache=0)
    plain = llm.generate("Beautiful is better than", max_tokens=40)
    penalized_run = llm.generate("Beautiful is better than", max_tokens=40, repetition_penalty=5.0)
    assert len(set(penalized_run.token_ids)) > len(set(plain.token_ids))


def test_speculative_engine_penalizes_as_the_plain_one(demo_mtp: Path, rng: np.random.Generator) -> None:  # noqa: F811
    """The verify pass picks its rows in order with the history of the emitted tokens only."""
    prompt = rng.integers(0, VOCAB, 20).tolist()
    params = random_params(rng)
    request = GenerationRequest(prompt, 12, params, int(rng.integers(1 << 30)), NO_EOS)
    got = spec_engine(demo_mtp, 2).run(request)
    assert got.token_ids == plain_engine(demo_mtp).run(request).token_ids
    assert getattr(got, "drafted", 0) > 0


@pytest.mark.parametrize(("name", "value"), [
    ("min_p", 1.5), ("min_p", -0.1), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", 1e-40), ("repetition_penalty", 11.0), ("presence_penalty", "1"),
])
def test_bad_values_are_one_line(name: str, value: object) -> None:
    with pytest.raises(AtlasError, match=name):
        LLM(device="cpu").generate("Flat is", max_tokens=2, **{name: value})  # type: ignore[arg-type]


def test_min_tokens_holds_off_the_end() -> None:
    """The demo ends its text with eos a few tokens after this prompt; min_tokens keeps it going
    (no ending id among the first min_tokens), greedy or sampled, through generate and stream."""
    llm = LLM(device="cpu", prompt_cache=0)
    prompt = "Namespaces are one honking great"
    plain = llm.generate(prompt, max_tokens=60)
    eos = llm.eos_ids()
    assert plain.token_ids[-1] in eos and len(plain.token_ids) < 30
    for temperature in (0.0, 0.7):
        held = llm.generate(prompt, max_tokens=60, min_tokens=30, temperature=temperature, seed=2)
        assert len(held.token_ids) >= 30 and not eos & set(held.token_ids[:30])
        assert "".join(llm.stream(prompt, max_tokens=60, min_tokens=30, temperature=temperature, seed=2)) == held.text
    with pytest.raises(AtlasError, match="min_tokens"):
        llm.generate(prompt, max_tokens=4, min_tokens=-1)
    with pytest.raises(AtlasError, match=r"min_tokens \(5\) must be <= max_tokens \(4\)"):  # as vLLM
        llm.generate(prompt, max_tokens=4, min_tokens=5)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logit_bias_moves_picks(rng: np.random.Generator, temperature: float) -> None:
    """-100 on each step's top token and a random nudge elsewhere: every greedy pick is the argmax
    of the teacher-forced logits plus the bias (never a banned token); sampled picks avoid the
    banned ones; generate() and stream() agree."""
    llm = LLM(device="cpu", prompt_cache=0)
    prompt = rng.integers(0, VOCAB, int(rng.integers(3, 30))).tolist()
    plain = llm.generate(prompt, max_tokens=12)
    banned = sorted(set(plain.token_ids))
    nudged = rng.choice(np.setdiff1d(np.arange(VOCAB), banned), 8, replace=False).tolist()
    bias = {**{t: -100.0 for t in banned}, **{t: float(rng.uniform(-5, 5)) for t in nudged}}
    result = llm.generate(prompt, max_tokens=12, temperature=temperature, seed=5, logit_bias=bias)
    assert not set(result.token_ids) & set(banned)
    assert "".join(llm.stream(prompt, max_tokens=12, temperature=temperature, seed=5, logit_bias=bias)) == result.text
    if temperature:
        return
    forced = np.asarray(llm.parts.engine.logits(prompt + result.token_ids))[len(prompt) - 1 :]  # [N+1, V]
    for i, token in enumerate(result.token_ids):
        z = forced[i].astype(np.float64)
        z[list(bias)] += list(bias.values())
        assert z[token] >= z.max() - TIE * np.abs(z).max(), f"step {i}: not the biased argmax"


def test_logit_bias_forces_a_token(rng: np.random.Generator) -> None:
    """+100 on one token (given as JSON's string key) makes it every pick."""
    token = int(rng.integers(0, VOCAB))
    result = LLM(device="cpu").generate("Flat is", max_tokens=5, logit_bias={str(token): 100})
    assert result.token_ids == [token] * 5


@pytest.mark.parametrize(("bias", "message"), [
    ({5: 101}, r"logit_bias of token 5 must be a number in \[-100, 100\]"),
    ({5: float("nan")}, "logit_bias of token 5"),
    ({5: "1"}, "logit_bias of token 5"),
    ({"x": 1}, "logit_bias keys must be token ids"),
    ({-3: 1}, "logit_bias keys must be token ids"),
    ({VOCAB: 1}, rf"logit_bias token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"),
    ([5, 1], "logit_bias must be a mapping"),
    ({5: 1.0, "5": "x"}, "logit_bias of token 5"),  # the same id twice: the later value is checked
])
def test_bad_logit_bias_is_one_line(bias: object, message: str) -> None:
    with pytest.raises(AtlasError, match=message):
        LLM(device="cpu").generate("Flat is", max_tokens=2, logit_bias=bias)  # type: ignore[arg-type]
