"""Host-side sampling helpers shared by backends: the reference token choice and parameter checks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .backends.base import SamplingParams
from .errors import AtlasError

if TYPE_CHECKING:
    from .structured import OutputConstraint

MAX_TOP_K = 2**31 - 1  # SampleParams.top_k is an int32; any top_k >= the vocabulary keeps all
MAX_LOGPROBS = 20  # alternatives listed per generated token (OpenAI's top_logprobs limit)
MAX_PENALTY = 2.0  # presence / frequency penalty range, OpenAI's
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: +-100 bans or forces a token, smaller values nudge it


def is_int(value: object) -> bool:
    """An integer request field (numpy integers too; bool is not one)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """A real-number request field (integers too; bool is not one)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def check_sampling(params: SamplingParams) -> None:
    """Reject settings no backend can honour, with one line naming the setting and the fix."""
    if not np.isfinite(params.temperature) or params.temperature < 0:
        raise AtlasError(f"temperature must be >= 0 (0 = greedy), got {params.temperature}")
    if not 0 <= params.top_k <= MAX_TOP_K:
        raise AtlasError(f"top_k must be in 0..{MAX_TOP_K} (0 = off), got {params.top_k}")
    if not 0.0 < params.top_p <= 1.0:
        raise AtlasError(f"top_p must be in (0, 1] (1 = off), got {params.top_p}")
    if not 0.0 <= params.min_p <= 1.0:
        raise AtlasError(f"min_p must be in [0, 1] (0 = off), got {params.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -MAX_PENALTY <= getattr(params, name) <= MAX_PENALTY:
            raise AtlasError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off), got {getattr(params, name)}")
    if not is_int(params.min_tokens) or params.min_tokens < 0:
        raise AtlasError(f"min_tokens must be an integer >= 0, got {params.min_tokens!r}")
    if not 0.0 < params.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise AtlasError(
            f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), got {params.repetition_penalty}"
        )
    for token, bias in params.logit_bias:
        if not is_int(token) or token < 0:
            raise AtlasError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if not is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise AtlasError(f"logit_bias of token {token} must be a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}")


def logit_bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as given (None, or a mapping of token id -> bias; JSON's string keys "42" too)
    -> (id, bias) pairs by id (of "5" and 5 the later wins); their ranges are check_sampling's."""
    if bias is None:
        return ()
    if not isinstance(bias, Mapping):
        raise AtlasError(f"logit_bias must be a mapping of token id -> bias, got {bias!r}")
    by_id: dict[int, object] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if not is_int(token):
            raise AtlasError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        by_id[int(token)] = value
    return tuple(sorted(by_id.items(), key=lambda pair: pair[0]))  # type: ignore[arg-type]


def check_logit_bias_ids(params: SamplingParams, vocab: int) -> None:
    bad = [token for token, _ in params.logit_bias if token >= vocab]
    if bad:
        raise AtlasError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")


def apply_logit_bias(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """logits [V] -> a float32 copy with each biased token's bias added."""
    z = np.array(logits, dtype=np.float32)  # [V]
    for token, bias in params.logit_bias:
        z[token] += np.float32(bias)
    return z


def pick_state(prompt_ids: list[int], end_ids: set[int], sampling: SamplingParams,
               constraint: OutputConstraint | None) -> Penalties | None:
    """What one sequence's host picks carry from token to token, if anything."""
    if sampling.structured and constraint is None:
        raise AtlasError("structured output needs the tokenizer's token bytes: generate through atlas.LLM")
    return Penalties(prompt_ids, end_ids, constraint) if sampling.penalized or constraint is not None else None


def host_pick(row: np.ndarray, sampling: SamplingParams, uniform: float, penalties: Penalties | None) -> int:
    """The token from logits [V] on the host: biased, penalized, then argmax or the reference
    sampler, among the tokens structured output allows when it is on."""
    if sampling.logit_bias:
        row = apply_logit_bias(row, sampling)
    if penalties is not None:
        row = penalties.apply(row, sampling)
    constraint = penalties.constraint if penalties is not None else None
    if constraint is not None:
        if sampling.temperature == 0 or constraint.complete:  # closed: an end id, even before min_tokens
            return constraint.greedy(row)
        row = constraint.mask(row, sampling.temperature, sampling.top_k, sampling.min_p)
    return host_argmax(row) if sampling.temperature == 0 else choose_token(row, sampling, uniform)


class Penalties:
    """What the penalties read while one sequence is generated: which tokens the prompt or the
    output holds (repetition_penalty) and how often each was generated (presence, frequency); and
    the structured output constraint, advanced by each pick."""

    def __init__(self, prompt_ids: list[int], end_ids: set[int] | None = None, constraint: OutputConstraint | None = None) -> None:
        self.prompt_ids = np.unique(np.asarray(prompt_ids, dtype=np.int64))
        self.end_ids = np.array(sorted(end_ids or ()), dtype=np.int64)  # masked before min_tokens
        self.constraint = constraint  # structured output: which tokens may come next
        self.generated: dict[int, int] = {}
        self.count = 0
        self.seen: np.ndarray | None = None  # [V] bool: in the prompt or generated (made at the first apply)

    def add(self, token: int) -> None:
        if self.constraint is not None:
            self.constraint.advance(token)
        self.generated[token] = self.generated.get(token, 0) + 1
        self.count += 1
        if self.seen is not None and token < self.seen.size:
            self.seen[token] = True

    def apply(self, logits: np.ndarray, params: SamplingParams) -> np.ndarray:
        """logits [V] -> penalized float32 copy: repetition first, then presence and frequency
        (vLLM's order); before min_tokens, the ending ids at -inf. O(V + generated distinct) a
        token, whatever the prompt's length."""
        z = np.array(logits, dtype=np.float32)  # [V]
        if self.count < params.min_tokens:
            z[self.end_ids[self.end_ids < z.size]] = -np.inf
        if params.repetition_penalty != 1:
            r = np.float32(params.repetition_penalty)
            z = np.where(self._seen(z.size), np.where(z > 0, z / r, z * r), z)  # [V]
        if self.generated:
            ids = np.fromiter(self.generated, dtype=np.int64)  # [G]
            counts = np.fromiter(self.generated.values(), dtype=np.float32)  # [G]
            z[ids] -= np.float32(params.frequency_penalty) * counts + np.float32(params.presence_penalty)
        return z

    def _seen(self, size: int) -> np.ndarray:
        if self.seen is None:
            self.seen = np.zeros(size, dtype=bool)  # [V]
            self.seen[self.prompt_ids[self.prompt_ids < size]] = True
            self.seen[[t for t in self.generated if t < size]] = True
        return self.seen


def host_argmax(logits: np.ndarray) -> int:
    """The backends' argmax on one row [V]: NaN never wins, the first maximum does."""
    return int(np.argmax(np.where(np.isnan(logits), -np.inf, logits)))


def check_logprobs(logprobs: object) -> None:
    if logprobs is not None and (not is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):  # type: ignore[operator]
        raise AtlasError(
            f"logprobs must be None (off) or an integer in 0..{MAX_LOGPROBS} (the most likely tokens "
            f"listed beside each generated one), got {logprobs!r}"
        )


def softmax_probs(logits: np.ndarray, temperature: float) -> np.ndarray:
    """logits [V] -> softmax(logits / temperature) [V] float32, as (z - max z) / T so a tiny T
    cannot overflow: z is the logit with NaN read as -inf; the maximal logits (+inf included) get
    exp(0) = 1, so the sum is >= 1 (an all -inf / NaN row is uniform). T below float32's smallest
    normal (it would round to 0 or a denormal) is that smallest normal, as in sampling.cuh."""
    z = np.where(np.isnan(logits), -np.inf, logits).astype(np.float32)  # [V]
    top = z.max()
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf on the maxima (replaced by 0); T > float32 max
        t = max(np.float32(temperature), np.finfo(np.float32).tiny)
        scaled = np.where(z == top, np.float32(0), (z - top) / t)  # [V] <= 0
    exp = np.exp(scaled)  # [V]
    return exp / exp.sum()


def top_k_mask(probs: np.ndarray, top_k: int) -> np.ndarray:
    """Keep tokens whose p is >= the top_k-th largest p (ties kept); 0 keeps all."""
    if top_k <= 0 or top_k >= probs.shape[0]:
        return np.ones(probs.shape, dtype=bool)
    kth = np.partition(probs, probs.shape[0] - top_k)[probs.shape[0] - top_k]
    return probs >= kth


def top_p_mask(probs: np.ndarray, keep: np.ndarray, top_p: float) -> np.ndarray:
    """Of the kept tokens, keep those with p >= t, t the largest threshold whose mass sum(p >= t)
    reaches top_p * the kept mass (ties kept)."""
    top_p = float(np.float32(top_p))  # the kernel's float: 1 - 1e-9 is 1 there too
    if top_p >= 1.0:
        return keep
    kept = np.where(keep, probs, 0.0).astype(np.float64)  # [V]
    descending = np.sort(kept)[::-1]  # [V]
    mass = np.cumsum(descending)  # [V]
    first = int(np.searchsorted(mass, top_p * mass[-1], side="left"))
    threshold = descending[min(first, descending.shape[0] - 1)]
    return keep & (kept >= threshold)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (the raw logits' log-softmax, before
    temperature, top-k and top-p), with the `top` most likely tokens, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """logits [V] -> the TokenLogprob of `token` and the `top` alternatives (ties: lower id first)."""
    z = np.where(np.isnan(logits), -np.inf, logits).astype(np.float64)  # [V]
    peak = z.max()
    logprobs = z - (peak + np.log(np.exp(z - peak).sum())) if np.isfinite(peak) else np.full_like(z, -np.log(z.size))
    order = np.lexsort((np.arange(z.size), -logprobs))[:top]  # [top]
    return TokenLogprob(token, float(logprobs[token]), tuple((int(i), float(logprobs[i])) for i in order))


def choose_token(logits: np.ndarray, params: SamplingParams, uniform: float) -> int:
    """The reference token choice of `Backend.sample` for one row of logits [V]; min_p (host
    picks only) keeps tokens with p >= min_p * the largest p before top_p sees them."""
    probs = softmax_probs(logits, params.temperature)  # [V]
    keep = top_k_mask(probs, params.top_k)
    if params.min_p > 0:
        keep &= probs >= np.float32(params.min_p) * probs.max()
    keep = top_p_mask(probs, keep, params.top_p)
    cumulative = np.cumsum(np.where(keep, probs, 0.0).astype(np.float64))  # [V]
    index = int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"))
    return min(index, logits.shape[0] - 1)
