"""llama.cpp's typical-p, top-n-sigma and XTC samplers as masks over one row, for the reference
sampler (atlas.sampling.choose_token) on the host, and its dynamic temperature, DRY repeat penalty
and mirostat. Each mask sees the tokens the filters before it kept, their probabilities
renormalised over those (llama.cpp's candidates), at the request's temperature (atlas applies it
first, as vLLM and transformers do; top-n-sigma's cut does not depend on it). No kernel has them:
a pick that uses one reads its row back (SamplingParams.host_filters)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .backends.base import SamplingParams
from .errors import AtlasError

NAMES = ("typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "dry_multiplier", "dry_base", "mirostat_tau",
         "mirostat_eta", "dynatemp_range", "dynatemp_exponent")  # their real fields
DRY_COUNTS = {"dry_allowed_length": 0, "dry_penalty_last_n": -1}  # integer fields: their least value
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
    sigma = getattr(params, "top_n_sigma")
    if not np.isfinite(sigma):
        return "top_n_sigma", f"top_n_sigma must be a finite number (<= 0 = off), got {sigma}"
    for name, least, what in (("dry_multiplier", 0.0, " (0 = off)"), ("dry_base", 1.0, "")):
        if not (np.isfinite(getattr(params, name)) and getattr(params, name) >= least):
            return name, f"{name} must be a finite number >= {least:g}{what}, got {getattr(params, name)}"
    for name in ("mirostat_tau", "mirostat_eta", "dynatemp_range", "dynatemp_exponent"):
        if not (np.isfinite(getattr(params, name)) and getattr(params, name) >= 0):
            return name, f"{name} must be a finite number >= 0, got {getattr(params, name)}"
    mode = getattr(params, "mirostat")
    if isinstance(mode, bool) or mode not in (0, 1, 2):
        return "mirostat", f"mirostat must be 0 (off), 1 or 2, got {mode!r:.40}"
    for name, least in DRY_COUNTS.items():
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
            return name, f"{name} must be an integer >= {least}, got {value!r:.40}"
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


def dynamic_temperature(logits: np.ndarray, keep: np.ndarray, params: SamplingParams) -> float:
    """llama.cpp's dynatemp: the temperature moved within temperature +- dynatemp_range by the kept
    tokens' entropy at temperature 1 over its largest (uniform), raised to dynatemp_exponent: an
    unsure step is drawn hotter, a sure one colder (at 0: its most likely token)."""
    low, high = max(0.0, params.temperature - params.dynatemp_range), params.temperature + params.dynatemp_range
    z = logits[keep & np.isfinite(logits)].astype(np.float64)  # [K]
    if z.size <= 1:
        return params.temperature
    p = np.exp(z - z.max())
    p /= p.sum()  # [K]
    live = p[p > 0]
    entropy = float(-np.sum(live * np.log(live)))
    return low + (high - low) * (entropy / np.log(z.size)) ** params.dynatemp_exponent


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
    above = (p > 0) & (p >= np.float32(threshold))  # a p of 0 is no choice (threshold 0: the least likely live one stays)
    if above.sum() < 2:
        return keep
    return keep & ~(above & (p > p[above].min()))


Breakers = tuple[tuple[int, tuple[int, ...]], ...]  # DRY's sequence breakers: (head id, the tail ids after it)
DRY_BREAKERS = ("\n", ":", '"', "*")  # llama.cpp's default dry_sequence_breakers
MAX_BREAKER_BYTES = 40  # llama.cpp's: a longer breaker is cut to this
MAX_TAIL_TOKENS = 20
FLOAT_MAX_LOG = 88.7228391  # ln of float32's largest: DRY's exponent is capped so its penalty stays finite


def breaker_heads(texts: Sequence[bytes | None], breakers: Sequence[str],
                  encode: Callable[[str], list[int]]) -> Breakers:
    """llama.cpp's processed DRY breakers from each token's text `texts[id]`: a token that holds a
    breaker breaks alone (tail ()); a token that ends with the breaker's start breaks when the
    tokens after it spell the rest (its tail: the rest encoded, at most MAX_TAIL_TOKENS ids; a rest
    that is not whole UTF-8 characters cannot be encoded and is left out)."""
    found: dict[tuple[int, tuple[int, ...]], None] = {}
    for breaker in breakers:
        needle = breaker.encode()[:MAX_BREAKER_BYTES]
        if not needle:
            continue
        for token, text in enumerate(texts):
            if not text:
                continue
            if needle in text:
                found[(token, ())] = None
                continue
            start = text.find(needle[:1])
            while start >= 0:
                overlap = len(text) - start
                if needle.startswith(text[start:]):
                    try:
                        found[(token, tuple(encode(needle[overlap:].decode())[:MAX_TAIL_TOKENS]))] = None
                    except UnicodeDecodeError:
                        pass
                start = text.find(needle[:1], start + 1)
    return tuple(found)


def restart_limit(context: np.ndarray, heads: dict[int, list[tuple[int, ...]]]) -> int:
    """How far back a repeat may reach: up to the last sequence breaker in `context` [N], the
    breaker's tail included (N when there is none)."""
    n = context.size
    for at in np.flatnonzero(np.isin(context, list(heads)))[::-1]:  # the latest first
        after = n - 1 - int(at)  # tokens after the head
        matched = [len(tail) for tail in heads[int(context[at])]
                   if len(tail) <= after and tuple(context[at + 1: at + 1 + len(tail)].tolist()) == tail]
        if matched:
            return after - max(matched)
    return n


def dry_penalties(history: Sequence[int], params: SamplingParams, vocab: int) -> np.ndarray:
    """DRY ("don't repeat yourself", llama.cpp's): penalties [V] to subtract from the logits. A
    token that would continue a repeat of the context's last n >= dry_allowed_length tokens (the
    n tokens before an earlier place it followed) costs dry_multiplier x dry_base^(n -
    dry_allowed_length), its longest repeat counted; repeats reach back no further than the last
    sequence breaker, over the last dry_penalty_last_n tokens (-1: all); a token that breaks alone
    costs nothing."""
    out = np.zeros(vocab, dtype=np.float32)  # [V]
    window = len(history) if params.dry_penalty_last_n < 0 else min(len(history), params.dry_penalty_last_n)
    allowed = params.dry_allowed_length
    if window <= allowed:
        return out
    context = np.asarray(history[len(history) - window:], dtype=np.int64)  # [N]
    heads: dict[int, list[tuple[int, ...]]] = {}
    for head, tail in params.dry_breakers:
        heads.setdefault(head, []).append(tail)
    limit = restart_limit(context, heads)
    if limit < allowed:
        return out
    lengths = repeat_lengths(context, limit)  # [N - 1]
    follows = context[1:][lengths >= allowed]  # [R] the token after each long enough repeat
    longest = np.full(vocab, -1, dtype=np.int64)  # [V]
    np.maximum.at(longest, follows, lengths[lengths >= allowed])
    penalised = np.flatnonzero(longest >= 0)
    penalised = penalised[[() not in heads.get(int(t), []) for t in penalised]] if heads else penalised
    exponent = longest[penalised] - allowed
    if params.dry_base > 1.000001:
        exponent = np.minimum(exponent, int(FLOAT_MAX_LOG / np.log(params.dry_base)))
    growth = np.power(np.float32(params.dry_base), exponent.astype(np.float32))  # [P]
    out[penalised] = np.float32(params.dry_multiplier) * growth
    return out


def repeat_lengths(context: np.ndarray, limit: int) -> np.ndarray:
    """For each place j < N - 1 of context [N]: how many tokens up to and including j match the
    context's last ones (the longest common suffix of context[:j + 1] and context), at most `limit`."""
    n = context.size
    lengths = np.zeros(n - 1, dtype=np.int64)  # [N - 1]
    alive = np.arange(n - 1)
    matched = 0
    while alive.size and matched < limit:
        alive = alive[alive >= matched]
        alive = alive[context[alive - matched] == context[n - 1 - matched]]
        matched += 1
        lengths[alive] = matched
    return lengths


MIROSTAT_M = 100  # llama.cpp's m: the most likely tokens mirostat 1 fits its Zipf exponent to


@dataclass
class Mirostat:
    """Mirostat's target surprise, carried from pick to pick of one generation (llama.cpp's mu,
    which starts at 2 x tau and moves by eta x the last pick's surprise above tau)."""

    mu: float

    def pick(self, logits: np.ndarray, params: SamplingParams, uniform: float) -> int:
        """Mirostat 1 or 2 on logits [V] at the temperature, in place of top-k / top-p / min_p and
        the filters: keep the tokens its mu allows, draw one of them with `uniform`, move mu."""
        from .sampling import softmax_probs

        probs = softmax_probs(logits, params.temperature).astype(np.float64)  # [V]
        order = np.argsort(-probs, kind="stable")  # [V] most likely first
        live = int(np.count_nonzero(probs > 0))
        if params.mirostat == 1:
            kept = min(max(int(mirostat_k(probs[order], self.mu, logits.size)), 1), live)
        else:
            surprise = -np.log2(probs[order[:live]])  # [L] ascending
            kept = max(int(np.count_nonzero(surprise <= self.mu)), 1)
        chosen = order[:kept]  # [K]
        p = probs[chosen] / probs[chosen].sum()  # [K]
        by_id = np.argsort(chosen, kind="stable")  # the draw walks the kept tokens in id order, as choose_token
        index = min(int(np.searchsorted(np.cumsum(p[by_id]), uniform, side="right")), kept - 1)
        token = int(chosen[by_id][index])
        self.mu -= params.mirostat_eta * (-float(np.log2(p[by_id][index])) - params.mirostat_tau)
        return token


def mirostat_k(sorted_probs: np.ndarray, mu: float, vocab: int) -> float:
    """Mirostat 1's top-k from the Zipf exponent s fitted to the MIROSTAT_M most likely p
    (descending) and the target surprise mu: ((s - 1) 2^mu / (1 - V^(1 - s)))^(1 / s)."""
    m = min(MIROSTAT_M - 1, sorted_probs.size - 1)
    i = np.arange(m)
    t = np.log((i + 2) / (i + 1))  # [m]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # p of 0 among them: no fit, k 1
        b = np.log(sorted_probs[:m] / sorted_probs[1:m + 1])  # [m]
        s = np.sum(t * b) / np.sum(t * t)
        k = ((s - 1) * np.float64(2.0) ** mu / (1 - np.float64(vocab) ** (1 - s))) ** (1 / s)
    return float(k) if np.isfinite(k) and k > 0 else 1.0
