"""llama.cpp's typical-p, top-n-sigma and XTC samplers as masks over one row, for the reference
sampler (atlas.sampling.choose_token) on the host. Each sees the tokens the filters before it kept,
their probabilities renormalised over those (llama.cpp's candidates), at the request's temperature
(atlas applies it first, as vLLM and transformers do; top-n-sigma's cut does not depend on it).
No kernel has them: a pick that uses one reads its row back (SamplingParams.host_filters)."""

from __future__ import annotations

import numpy as np

from .backends.base import SamplingParams
from .errors import AtlasError

NAMES = ("typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold")  # SamplingParams' fields for them
RANGES = {  # name -> (lowest, highest, what turns it off)
    "typical_p": (0.0, 1.0, "1 = off"),
    "xtc_probability": (0.0, 1.0, "0 = off"),
    "xtc_threshold": (0.0, 1.0, "above 0.5 = off"),
}
LOWEST_OPEN = {"typical_p"}  # typical_p 0 would keep nothing


def filter_problem(params: object) -> tuple[str, str] | None:
    """The first filter setting of `params` (SamplingParams or anything with its NAMES) out of
    range: its name and one line naming the fix; None when all are in range."""
    for name, (low, high, off) in RANGES.items():
        value = getattr(params, name)
        above_low = value > low if name in LOWEST_OPEN else value >= low
        if not (np.isfinite(value) and above_low and value <= high):
            bracket = "(" if name in LOWEST_OPEN else "["
            return name, f"{name} must be in {bracket}{low:g}, {high:g}] ({off}), got {value}"
    if not np.isfinite(params.top_n_sigma):  # type: ignore[attr-defined]
        return "top_n_sigma", f"top_n_sigma must be a finite number (<= 0 = off), got {params.top_n_sigma}"  # type: ignore[attr-defined]
    return None


def check_filters(params: SamplingParams) -> None:
    if problem := filter_problem(params):
        raise AtlasError(problem[1])


def top_n_sigma_mask(logits: np.ndarray, n: float) -> np.ndarray:
    """logits [V] -> keep [V]: the logits >= the largest finite one - n x the standard deviation
    of the finite ones (Tang et al., "Top-nσ"; llama.cpp's top_n_sigma); +inf logits are kept, so
    they keep their share of the mass, -inf and NaN are not."""
    z = logits.astype(np.float64)  # [V]
    finite = np.isfinite(z)
    if not finite.any():
        return z == np.inf
    values = z[finite]  # [F]
    return (z == np.inf) | (finite & (z >= values.max() - n * values.std()))


def renormalised(probs: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """probs [V] over the kept tokens, summing to 1 there (0 elsewhere), in float64."""
    kept = np.where(keep, probs, 0.0).astype(np.float64)  # [V]
    return kept / kept.sum()


def typical_mask(probs: np.ndarray, keep: np.ndarray, mass: float) -> np.ndarray:
    """Locally typical sampling (Meister et al.; transformers' TypicalLogitsWarper, llama.cpp's
    typical_p): of the kept tokens, those whose surprise -log p is nearest the entropy, fewest
    first, until their mass reaches `mass`; tokens as near as the last one taken are kept too."""
    p = renormalised(probs, keep)  # [V]
    live = p > 0  # kept and not underflowed: a p of 0 adds nothing to the entropy and is never typical
    surprise = -np.log(p, where=live, out=np.full(p.shape, np.inf))  # [V]
    entropy = float(np.sum(p[live] * surprise[live]))
    distance = np.where(live, np.abs(surprise - entropy), np.inf)  # [V]
    order = np.argsort(distance, kind="stable")[: int(live.sum())]  # [L] nearest first
    reached = int(np.searchsorted(np.cumsum(p[order]), mass, side="left"))
    cut = distance[order[min(reached, order.size - 1)]]
    return live & (distance <= cut)


def xtc_mask(probs: np.ndarray, keep: np.ndarray, threshold: float) -> np.ndarray:
    """Exclude Top Choices (llama.cpp's XTC, when its draw says so): when two or more kept tokens
    have p >= threshold, all of them but the least likely (its ties too) are cut, so the pick
    falls on a less obvious token that is still a likely one."""
    p = renormalised(probs, keep)  # [V]
    above = (p > 0) & (p >= np.float32(threshold))  # a p of 0 is no choice: threshold 0 keeps the least likely of the rest
    if above.sum() < 2:
        return keep
    return keep & ~(above & (p > p[above].min()))
