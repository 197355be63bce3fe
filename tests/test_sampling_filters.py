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
from atlas.sampling_filters import top_n_sigma_mask, typical_mask, xtc_mask

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


def away_from_a_cut(probs: np.ndarray, keep: np.ndarray, rng: np.random.Generator) -> float:
    """A typical mass not within 1e-4 of a cumulative mass of the typical order (where float32 and
    float64 sums may round to different sides)."""
    p = np.where(keep, probs, 0).astype(np.float64) / np.where(keep, probs, 0).sum()  # [V]
    live = p > 0
    entropy = -np.sum(p[live] * np.log(p[live]))
    distance = np.where(live, np.abs(-np.log(np.where(live, p, 1)) - entropy), np.inf)  # [V]
    cumulative = np.cumsum(p[np.argsort(distance)])  # [V]
    while True:
        mass = float(rng.uniform(0.05, 0.98))
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
        threshold = float(rng.uniform(0, 0.5))
        p = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum()  # [V]
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
            params = replace(params, typical_p=away_from_a_cut(probs, keep, rng))
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
            assert distance[token] <= distance.min() + 1e-4
        elif form == "top_n_sigma":
            assert row[token] >= row.max() - 1e-6
        else:
            assert row[token] <= row.min() + 1e-6
