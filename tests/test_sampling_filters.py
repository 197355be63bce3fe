"""llama.cpp's typical-p, top-n-sigma and XTC (atlas.sampling_filters): typical-p against
transformers' TypicalLogitsWarper (the oracle), top-n-sigma against its formula in torch, XTC's
cut on rows drawn for it; the reference sampler picks exactly from the kept tokens; and whole
generations on the demo model, where a setting that leaves one token per step makes every pick
checkable against the teacher-forced logits."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TypicalLogitsWarper

from atlas import LLM
from atlas.backends.base import SamplingParams
from atlas.errors import AtlasError
from atlas.sampling import choose_token, softmax_probs, top_k_mask
from atlas.sampling_filters import (MIROSTAT_M, Mirostat, breaker_heads, dry_penalties, top_n_sigma_mask, typical_mask,
                                   xtc_mask)

V = 96
SWEEP = 4096  # uniforms per sweep of the reference sampler: a token of p > 2 / SWEEP is met


def random_row(rng: np.random.Generator) -> np.ndarray:
    return (rng.standard_normal(V) * rng.uniform(0.5, 6)).astype(np.float32)  # [V]


def hf_kept(row: np.ndarray, temperature: float, top_k: int, mass: float) -> np.ndarray:
    """transformers' temperature, top-k and typical warpers in their order -> the kept ids [V] bool."""
    scores = torch.from_numpy(row.astype(np.float32))[None]  # [1, V]
    ids = torch.zeros((1, 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    return torch.isfinite(TypicalLogitsWarper(mass)(ids, scores))[0].numpy()


def away_from_a_cut(probs: np.ndarray, keep: np.ndarray, rng: np.random.Generator, most: float = 0.98) -> float:
    """A typical mass not within 1e-4 of a cumulative mass of the typical order (where float32 and
    float64 sums may round to different sides)."""
    p = np.where(keep, probs, 0).astype(np.float64) / np.where(keep, probs, 0).sum()  # [V]
    live = p > 0
    entropy = -np.sum(p[live] * np.log(p[live]))
    distance = np.where(live, np.abs(-np.log(np.where(live, p, 1)) - entropy), np.inf)  # [V]
    cumulative = np.cumsum(p[np.argsort(distance)])  # [V]
    while True:
        mass = float(rng.uniform(0.05, most))
        if np.abs(cumulative - mass).min() > 1e-4:
            return mass


def test_typical_keeps_what_transformers_keeps(rng: np.random.Generator) -> None:
    for _ in range(200):
        row, temperature = random_row(rng), float(rng.uniform(0.3, 2.0))
        top_k = int(rng.choice([0, int(rng.integers(2, V))]))
        probs = softmax_probs(row, temperature)  # [V]
        keep = top_k_mask(probs, top_k)
        mass = away_from_a_cut(probs, keep, rng)
        ours = typical_mask(probs, keep, mass)
        assert np.array_equal(ours, hf_kept(row, temperature, top_k, mass)), (temperature, top_k, mass)


def test_top_n_sigma_keeps_the_logits_near_the_largest(rng: np.random.Generator) -> None:
    for _ in range(200):
        row, n = random_row(rng), float(rng.uniform(0.05, 3.0))
        banned = rng.random(V) < 0.2
        row[banned] = -np.inf  # masked tokens are not part of the spread
        z = torch.from_numpy(row[~banned].astype(np.float64))
        cut = float(z.max() - n * z.std(unbiased=False))
        want = ~banned & (row.astype(np.float64) >= cut)
        if np.abs(row[~banned].astype(np.float64) - cut).min() < 1e-4 * (abs(cut) + 1):
            continue  # on the cut, where float32's rounding (of row / t too) picks the side
        assert np.array_equal(top_n_sigma_mask(row, n), want)
        t = float(rng.uniform(0.2, 3.0))  # the cut is the same at any temperature
        assert np.array_equal(top_n_sigma_mask((row / np.float32(t)).astype(np.float32), n), want)
    # NaN and -inf never; +inf always (it takes all the mass); the finite ones as ever (here 1.0 alone: its spread 0)
    assert top_n_sigma_mask(np.array([np.nan, -np.inf, np.inf, 1.0], dtype=np.float32), 1.0).tolist() == [False, False, True, True]


def test_xtc_cuts_the_likely_tokens_but_the_least_of_them(rng: np.random.Generator) -> None:
    probs = np.array([0.1, 0.4, 0.05, 0.3, 0.15], dtype=np.float32)
    keep = np.ones(5, dtype=bool)
    assert xtc_mask(probs, keep, 0.12).tolist() == [True, False, True, False, True]  # 0.4, 0.3 cut; 0.15 stays
    assert xtc_mask(probs, keep, 0.35).tolist() == [True] * 5  # one token above: nothing to cut
    assert xtc_mask(probs, keep, 0.0).tolist() == [False, False, True, False, False]
    for _ in range(200):
        row = random_row(rng)
        probs, keep = softmax_probs(row, 1.0), rng.random(V) < 0.7
        keep[int(rng.integers(V))] = True
        threshold = float(np.float32(rng.uniform(0, 0.5)))  # float32's, as XTC compares
        p = np.where(keep, probs, 0).astype(np.float64) / np.where(keep, probs, 0).astype(np.float64).sum()  # [V]
        above = keep & (p >= threshold)
        kept = xtc_mask(probs, keep, threshold)
        if above.sum() < 2:
            assert np.array_equal(kept, keep)
        else:
            assert np.array_equal(kept, keep & ~(above & (p > p[above].min())))
            assert kept.sum() == keep.sum() - above.sum() + 1


def swept(row: np.ndarray, params: SamplingParams, xtc_chance: float | None = None) -> set[int]:
    return {choose_token(row, params, (i + 0.5) / SWEEP, xtc_chance) for i in range(SWEEP)}


def reachable(row: np.ndarray, params: SamplingParams, keep: np.ndarray) -> tuple[set[int], set[int]]:
    """The ids the sampler may pick (the kept ones) and those it must meet in a sweep."""
    p = np.where(keep, softmax_probs(row, params.temperature), 0).astype(np.float64)  # [V]
    p /= p.sum()
    return set(np.flatnonzero(keep & (p > 0)).tolist()), set(np.flatnonzero(keep & (p > 2 / SWEEP)).tolist())


def cutting(probs: np.ndarray, keep: np.ndarray, rng: np.random.Generator) -> float:
    """An XTC threshold that 2 to 4 of the kept tokens reach (when as many are live)."""
    p = np.sort(np.where(keep, probs, 0).astype(np.float64) / np.where(keep, probs, 0).sum())[::-1]  # [V]
    k = int(rng.integers(2, 5))
    return float(np.float32(min((p[k] + p[k - 1]) / 2, 0.5)))


@pytest.mark.parametrize("form", ["typical", "top_n_sigma", "xtc", "all"])
def test_the_sampler_picks_from_the_kept_tokens_alone(form: str, rng: np.random.Generator) -> None:
    for _ in range(8):
        row, temperature = random_row(rng), float(rng.uniform(0.5, 1.5))
        probs = softmax_probs(row, temperature)
        params = SamplingParams(temperature=temperature)
        keep = np.ones(V, dtype=bool)
        if form in ("top_n_sigma", "all"):
            params = replace(params, top_n_sigma=float(rng.uniform(0.5, 2.5)))
            keep &= top_n_sigma_mask(row, params.top_n_sigma)
        if form in ("typical", "all"):
            params = replace(params, typical_p=away_from_a_cut(probs, keep, rng, most=0.8))
            keep = typical_mask(probs, keep, params.typical_p)
        chance = None
        if form in ("xtc", "all"):
            params, chance = replace(params, xtc_probability=0.5, xtc_threshold=cutting(probs, keep, rng)), 0.25
            keep = xtc_mask(probs, keep, params.xtc_threshold)
        allowed, met = reachable(row, params, keep)
        picked = swept(row, params, chance)
        assert met <= picked <= allowed, (form, sorted(picked - allowed), sorted(met - picked))
        assert keep.sum() < V  # something was cut
    if form == "xtc":  # a chance above xtc_probability cuts nothing
        assert swept(row, params, 0.75) == swept(row, replace(params, xtc_probability=0.0))


@pytest.mark.parametrize("bad, named", [
    ({"typical_p": 0.0}, "typical_p"), ({"typical_p": 1.2}, "typical_p"), ({"xtc_probability": -0.1}, "xtc_probability"),
    ({"xtc_threshold": 1.5}, "xtc_threshold"), ({"top_n_sigma": float("inf")}, "top_n_sigma"),
])  # fmt: skip
def test_out_of_range_settings_are_one_line(demo: LLM, bad: dict[str, float], named: str) -> None:
    with pytest.raises(AtlasError, match=named) as err:
        demo.generate("Beautiful is", max_tokens=2, temperature=1.0, **bad)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM(device="cpu")


PREFILL_DRIFT = 1e-4  # the numpy backend's decode and prefill logits differ by up to ~1e-5 (summation order)
ONE_TOKEN_LEFT = {  # a setting under which one token per step survives, so each pick is known
    "typical": {"typical_p": 1e-9},  # the token whose surprise is nearest the entropy
    "top_n_sigma": {"top_n_sigma": 1e-9},  # the most likely
    "xtc": {"xtc_probability": 1.0, "xtc_threshold": 0.0},  # the least likely
}


@pytest.mark.parametrize("form", sorted(ONE_TOKEN_LEFT))
def test_each_pick_of_a_generation_is_the_filters(form: str, demo: LLM, rng: np.random.Generator) -> None:
    engine, temperature = demo.parts.engine, float(rng.uniform(0.5, 1.5))
    prompt = rng.integers(0, demo.parts.spec.vocab_size, size=int(rng.integers(4, 20))).tolist()
    params = SamplingParams(temperature=temperature, **ONE_TOKEN_LEFT[form])
    assert params.on_host
    tokens = engine.generate(prompt, 8, params, int(rng.integers(1 << 30)), set()).token_ids
    rows = engine.logits(prompt + tokens[:-1])[len(prompt) - 1:].astype(np.float64)  # [8, V]
    for row, token in zip(rows, tokens, strict=True):
        z = row / temperature  # [V]
        logp = z - z.max() - np.log(np.exp(z - z.max()).sum())  # [V]
        if form == "typical":
            distance = np.abs(-logp - float(-np.sum(np.exp(logp) * logp)))  # [V]
            assert distance[token] <= distance.min() + 10 * PREFILL_DRIFT
        elif form == "top_n_sigma":
            assert row[token] >= row.max() - PREFILL_DRIFT
        else:
            assert row[token] <= row.min() + PREFILL_DRIFT


def dry_by_definition(history: list[int], params: SamplingParams, vocab: int) -> np.ndarray:
    """DRY's penalties [V] spelled out: every earlier place j, how far the tokens up to j match the
    context's last ones (capped at the last breaker), and the token after j charged for it."""
    out = np.zeros(vocab)
    if params.dry_penalty_last_n == 0:
        return out
    context = history if params.dry_penalty_last_n < 0 else history[-params.dry_penalty_last_n:]
    n, allowed = len(context), params.dry_allowed_length
    if n <= allowed:
        return out
    limit = n
    for at in range(n - 1, -1, -1):
        tails = [len(tail) for head, tail in params.dry_breakers
                 if head == context[at] and at + 1 + len(tail) <= n and tuple(context[at + 1:at + 1 + len(tail)]) == tail]
        if tails:
            limit = n - 1 - at - max(tails)
            break
    if limit < allowed:
        return out
    longest: dict[int, int] = {}
    for j in range(n - 1):
        length = 0
        while length <= j and context[j - length] == context[n - 1 - length]:
            length += 1
        length = min(length, limit)
        if length >= allowed:
            longest[context[j + 1]] = max(longest.get(context[j + 1], 0), length)
    alone = {head for head, tail in params.dry_breakers if not tail}
    for token, length in longest.items():
        if token not in alone:
            out[token] = params.dry_multiplier * params.dry_base ** (length - allowed)
    return out


def test_dry_charges_the_token_that_extends_a_repeat() -> None:
    a, b, c, d, e = range(5)
    params = SamplingParams(dry_multiplier=0.8, dry_base=2.0, dry_allowed_length=2)
    penalties = dry_penalties([a, b, c, d, e, a, b, c], params, 8)  # "a b c" again: d would make it 4
    assert penalties.tolist() == pytest.approx([0, 0, 0, 0.8 * 2.0, 0, 0, 0, 0])
    assert dry_penalties([a, b, c, d, e, a, b, c], replace(params, dry_allowed_length=4), 8).tolist() == [0.0] * 8
    broken = replace(params, dry_breakers=((e, ()),))  # e breaks: the repeat reaches back to it only
    assert dry_penalties([a, b, c, d, e, a, b, c], broken, 8)[d] == pytest.approx(0.8 * 2.0)
    assert dry_penalties([a, b, c, d, a, b, c], params, 8)[d] == pytest.approx(0.8 * 2.0)
    steep = replace(params, dry_base=10.0, dry_allowed_length=0)  # 10^46 would overflow: capped at 10^38
    assert dry_penalties([*range(1, 47), 0, *range(1, 47)], steep, 48)[0] == pytest.approx(0.8e38, rel=1e-5)
    assert dry_penalties([a, b, c, d, a, b, c], replace(params, dry_breakers=((b, ()),)), 8).sum() == 0  # b c < 2 after b


def test_dry_penalties_match_their_definition(rng: np.random.Generator) -> None:
    for _ in range(300):
        vocab = int(rng.integers(2, 6))  # few tokens: long repeats
        history = rng.integers(0, vocab, size=int(rng.integers(0, 60))).tolist()
        heads = rng.choice(vocab, size=int(rng.integers(0, 3)), replace=False).tolist()
        breakers = tuple((int(h), tuple(rng.integers(0, vocab, size=int(rng.integers(0, 3))).tolist())) for h in heads)
        params = SamplingParams(dry_multiplier=float(rng.uniform(0.1, 3)), dry_base=float(rng.uniform(1, 3)),
                                dry_allowed_length=int(rng.integers(0, 5)), dry_penalty_last_n=int(rng.integers(-1, 50)),
                                dry_breakers=breakers)
        want = dry_by_definition(history, params, vocab)
        assert dry_penalties(history, params, vocab) == pytest.approx(want, rel=1e-5), (history, params)


def test_breaker_heads_as_llama_cpp_makes_them() -> None:
    texts = [b"ab", b"\n", b"x:", b"y", b"hi\nthere", None, b":y", b"a:y:", b"zz"]
    encode = {"y": [3], "\n": [1], "y:": [3, 0]}.__getitem__  # the rest of a breaker, encoded
    heads = set(breaker_heads(texts, ["\n", ":y"], encode))
    assert heads == {(1, ()), (4, ()), (6, ()), (7, ()), (2, (3,))}  # "a:y:" holds ":y"; "x:" starts it
    assert set(breaker_heads([b"zz:"], [":y:"], encode)) == {(0, (3, 0))}


ZEN_TWICE = "Beautiful is better than ugly.\nExplicit is better than implicit.\n" * 2 + "Beautiful is"


def dry_check(engine: object, prompt: list[int], tokens: list[int], params: SamplingParams, margin: float) -> None:
    """Each greedy pick is the argmax of the teacher-forced logits less DRY's penalties then."""
    rows = engine.logits(prompt + tokens[:-1])[len(prompt) - 1:].astype(np.float64)  # type: ignore[attr-defined]  # [N, V]
    for step, (row, token) in enumerate(zip(rows, tokens, strict=True)):
        charged = row - dry_by_definition(prompt + tokens[:step], params, row.size)  # [V]
        assert charged[token] >= charged.max() - margin, step


def test_dry_steers_a_greedy_generation_off_repeats(demo: LLM, rng: np.random.Generator) -> None:
    """The demo model recites its text: after it twice, greedy repeats it; DRY (no breakers, so
    the penalty follows its definition alone) charges each repeat, every pick is the best charged one."""
    prompt = demo.tokenizer.encode(ZEN_TWICE)
    params = SamplingParams(dry_multiplier=float(rng.uniform(1, 4)), dry_base=float(rng.uniform(1.2, 2)),
                            dry_allowed_length=int(rng.integers(1, 4)))
    tokens = demo.parts.engine.generate(prompt, 12, params, None, set()).token_ids
    assert tokens != demo.parts.engine.generate(prompt, 12, SamplingParams(), None, set()).token_ids
    dry_check(demo.parts.engine, prompt, tokens, params, 1e-3)
    text = demo.generate(ZEN_TWICE, max_tokens=12, dry_multiplier=params.dry_multiplier, dry_base=params.dry_base,
                         dry_allowed_length=params.dry_allowed_length, dry_sequence_breakers=[], ignore_eos=True)
    assert text.token_ids == tokens  # generate()'s options reach the same picks
    broken = demo.generate(ZEN_TWICE, max_tokens=12, dry_multiplier=params.dry_multiplier, dry_base=params.dry_base,
                           dry_allowed_length=params.dry_allowed_length, ignore_eos=True)
    assert broken.token_ids != tokens  # the default breakers ("\n", ...) stop repeats at the line's start


def mirostat_kept(probs: np.ndarray, mode: int, mu: float) -> np.ndarray:
    """Mirostat's cut spelled out: the ids [V] it keeps under mu, most likely first."""
    order = np.argsort(-probs, kind="stable")
    live = order[probs[order] > 0]
    if mode == 2:
        return live[: max(int(np.sum(-np.log2(probs[live]) <= mu)), 1)]
    top = probs[order[:MIROSTAT_M]]  # Zipf's exponent from the 100 most likely: ln(p_i / p_i+1) ~ s ln((i+2) / (i+1))
    steps, ratios = np.log(np.arange(2, top.size + 1) / np.arange(1, top.size)), np.log(top[:-1] / top[1:])
    s = float(steps @ ratios / (steps @ steps))
    k = ((s - 1) * 2.0**mu / (1 - probs.size ** (1 - s))) ** (1 / s)
    return live[: min(max(int(k), 1), live.size)]


@pytest.mark.parametrize("mode", [1, 2])
def test_mirostat_keeps_what_its_mu_allows_and_moves_mu(mode: int, rng: np.random.Generator) -> None:
    for _ in range(8):
        row, temperature = (rng.standard_normal(300) * rng.uniform(1, 4)).astype(np.float32), float(rng.uniform(0.5, 1.5))
        row[rng.random(300) < 0.3] = -np.inf  # masked (structured output): mirostat 1 still counts the whole vocabulary
        params = SamplingParams(temperature=temperature, mirostat=mode, mirostat_tau=float(rng.uniform(1, 6)),
                                mirostat_eta=float(rng.uniform(0.05, 0.5)))
        mu = float(rng.uniform(0.5, 12))
        probs = softmax_probs(row, temperature).astype(np.float64)  # [V]
        kept = mirostat_kept(probs, mode, mu)
        if mode == 2 and np.abs(-np.log2(probs[probs > 0]) - mu).min() < 1e-6:
            continue  # on the cut
        p = probs[kept] / probs[kept].sum()  # [K]
        picked = {Mirostat(mu).pick(row, params, (i + 0.5) / SWEEP) for i in range(SWEEP)}
        assert set(kept[p > 2 / SWEEP].tolist()) <= picked <= set(kept.tolist())
        state = Mirostat(mu)
        token = state.pick(row, params, float(rng.random()))
        surprise = -np.log2(p[kept.tolist().index(token)])
        assert state.mu == pytest.approx(mu - params.mirostat_eta * (surprise - params.mirostat_tau), rel=1e-9, abs=1e-9)


def test_a_mirostat_generation_follows_its_mu(demo: LLM, rng: np.random.Generator) -> None:
    """Mirostat 2 over a whole generation: each pick is among the tokens the replayed mu allows."""
    engine, temperature = demo.parts.engine, float(rng.uniform(0.8, 1.5))
    prompt = rng.integers(0, demo.parts.spec.vocab_size, size=int(rng.integers(4, 20))).tolist()
    params = SamplingParams(temperature=temperature, mirostat=2, mirostat_tau=float(rng.uniform(2, 5)), mirostat_eta=0.3)
    tokens = engine.generate(prompt, 12, params, int(rng.integers(1 << 30)), set()).token_ids
    rows = engine.logits(prompt + tokens[:-1])[len(prompt) - 1:]  # [12, V]
    mu = 2 * params.mirostat_tau
    for row, token in zip(rows, tokens, strict=True):
        probs = softmax_probs(row, temperature).astype(np.float64)  # [V]
        kept = mirostat_kept(probs, 2, mu)
        near = np.abs(-np.log2(probs[probs > 0]) - mu).min() < 10 * PREFILL_DRIFT  # the cut may fall either side
        assert token in kept or (near and token in mirostat_kept(probs, 2, mu + 20 * PREFILL_DRIFT))
        mu -= params.mirostat_eta * (-np.log2(probs[token] / probs[kept].sum()) - params.mirostat_tau)


def test_dynatemp_draws_at_the_temperature_the_entropy_sets(rng: np.random.Generator) -> None:
    """The kept tokens are drawn at T' = T - r + 2r (H / ln K)^e (K kept, H their entropy at
    temperature 1, T' >= 0): over a fine sweep of uniforms each token is picked its share of times."""
    for _ in range(12):
        row = (rng.standard_normal(V) * rng.uniform(0.5, 4)).astype(np.float32)
        params = SamplingParams(temperature=float(rng.uniform(0.3, 1.5)), top_k=int(rng.integers(2, V)),
                                dynatemp_range=float(rng.uniform(0.1, 1.0)), dynatemp_exponent=float(rng.uniform(0.5, 2)))
        kept = np.argsort(-row.astype(np.float64), kind="stable")[: params.top_k]  # distinct logits: top_k's ties none
        z = row[kept].astype(np.float64)
        p1 = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        low, high = max(0.0, params.temperature - params.dynatemp_range), params.temperature + params.dynatemp_range
        t = low + (high - low) * (-np.sum(p1 * np.log(p1)) / np.log(kept.size)) ** params.dynatemp_exponent
        want = np.exp((z - z.max()) / t) / np.exp((z - z.max()) / t).sum()  # [K]
        counts = np.bincount([choose_token(row, params, (i + 0.5) / SWEEP) for i in range(SWEEP)], minlength=V)
        assert counts.sum() == counts[kept].sum()
        assert np.abs(counts[kept] - want * SWEEP).max() <= 1.5, (t, params)
