"""Sampling rules shared by the backends: the reference token choice and penalties (the numpy
backend's ops, what the CUDA kernels must equal), the checks, and what one generation's picks carry."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .backends.base import NO_TOKEN, Backend, PenaltyOperands, SamplingParams, Tensor, kernel_temperature
from .errors import AtlasError
from .sampling_filters import (Mirostat, check_filters, dry_penalties, dynamic_temperature, top_n_sigma_mask,
                               typical_mask, xtc_mask)

if TYPE_CHECKING:
    from .structured import TokenConstraint

MAX_TOP_K = 2**31 - 1  # SampleParams.top_k is an int32; any top_k >= the vocabulary keeps all
MAX_LOGPROBS = 20  # alternatives listed per generated token (OpenAI's top_logprobs limit)
MAX_PENALTY = 2.0  # presence / frequency penalty range, OpenAI's
MAX_REPETITION_PENALTY = 10.0
MIN_REPETITION_PENALTY = 1 / MAX_REPETITION_PENALTY  # below, logits / r leave float32's range
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: +-100 bans or forces a token, smaller values nudge it
UNIFORM_BITS = 24  # a draw's uniform is a float32 (the kernels' SampleParams.uniform): 24 bits in [0, 1)


def draw_uniform(rng: np.random.Generator) -> float:
    """A sampled pick's uniform in [0, 1), exactly a float32, so every backend draws with the same
    value (a float64 draw rounded on the way to a kernel moved the target by up to 6e-8 of the
    mass: across a token boundary now and then at Qwen's 248K entries)."""
    return int(rng.integers(0, 1 << UNIFORM_BITS)) / (1 << UNIFORM_BITS)


def is_int(value: object) -> bool:
    """An integer request field (numpy integers too; bool is not one)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """A real-number request field that a float holds (integers too, up to ~1.8e308; bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    try:
        float(value)
    except OverflowError:  # an integer of 309+ digits
        return False
    return True


def check_sampling(params: SamplingParams) -> None:
    """Reject settings no backend can honour, with one line naming the setting and the fix."""
    if not np.isfinite(params.temperature) or params.temperature < 0:
        raise AtlasError(f"temperature must be a finite number >= 0 (0 = greedy), got {params.temperature}")
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
    if not MIN_REPETITION_PENALTY <= params.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise AtlasError(
            f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 = off), "
            f"got {params.repetition_penalty}"
        )
    for token, bias in params.logit_bias:
        if not is_int(token) or token < 0:
            raise AtlasError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if not is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise AtlasError(f"logit_bias of token {token} must be a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}")
    check_filters(params)


def logit_bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as given (None, or a mapping of token id -> bias; JSON's string keys "42" too)
    -> (id, bias) pairs by id (of "5" and 5 the later wins); their ranges are check_sampling's."""
    if bias is None:
        return ()
    if not isinstance(bias, Mapping):
        raise AtlasError(f"logit_bias must be a mapping of token id -> bias, got {bias!r}")
    by_id: dict[int, object] = {}
    for key, value in bias.items():
        digits = isinstance(key, str) and key.isascii() and key.isdigit()
        if digits and len(key) > 12:  # past any vocabulary (and int() of 4300+ digits raises)
            raise AtlasError(f"logit_bias token id {key[:24]}... is outside the vocabulary")
        token = int(key) if digits else key
        if not is_int(token):
            raise AtlasError(f"logit_bias keys must be token ids (integers >= 0), got {str(key)[:40]!r}")
        by_id[int(token)] = value
    return tuple(sorted(by_id.items(), key=lambda pair: pair[0]))  # type: ignore[arg-type]


def check_logit_bias_ids(params: SamplingParams, vocab: int) -> None:
    bad = [token for token, _ in params.logit_bias if token >= vocab]
    if bad:
        raise AtlasError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")


PROMPT_TOKEN = 1  # PenaltyOperands.flags bits (sampling.cuh kPromptToken, kEndToken)
END_TOKEN = 2


def pick_state(prompt_ids: list[int], end_ids: set[int], sampling: SamplingParams,
               constraint: TokenConstraint | None) -> Penalties | None:
    """What one sequence's picks carry from token to token, if anything."""
    if sampling.structured and constraint is None:
        raise AtlasError("structured output needs the tokenizer's token bytes: generate through atlas.LLM")
    wanted = sampling.adjusts_logits or constraint is not None or sampling.host_state
    return Penalties(prompt_ids, end_ids, constraint) if wanted else None


def host_pick(row: np.ndarray, sampling: SamplingParams, uniform: float, constraint: TokenConstraint,
              xtc_chance: float | None = None) -> int:
    """Structured output's token from (penalized) logits [V] on the host: the best allowed token
    when greedy or once the shape is complete (an end id, even before min_tokens), else the
    reference sampler over the allowed tokens."""
    if sampling.temperature == 0 or constraint.complete:
        return constraint.greedy(row)
    masked = constraint.mask(row, sampling.temperature, sampling.top_k, sampling.min_p)  # [V]
    return choose_token(masked, sampling, uniform, xtc_chance)


def penalize_row(logits: np.ndarray, counts: np.ndarray, flags: np.ndarray, bias: np.ndarray | None,
                 params: SamplingParams, mask_ends: bool) -> np.ndarray:
    """Backend.penalize on one row: logits, counts, flags [V] (bias [V] or None) -> a float32 copy."""
    z = np.array(logits, dtype=np.float32)  # [V]
    if bias is not None:
        z += bias
    if mask_ends:
        z[(flags & END_TOKEN) != 0] = -np.inf
    generated = counts > 0  # [V]
    if params.repetition_penalty != 1:
        r = np.float32(params.repetition_penalty)
        with np.errstate(invalid="ignore"):  # inf / r and NaN compare as the kernel's
            z = np.where(generated | ((flags & PROMPT_TOKEN) != 0), np.where(z > 0, z / r, z * r), z)  # [V]
    subtract = np.float32(params.frequency_penalty) * counts[generated].astype(np.float32) + np.float32(params.presence_penalty)
    z[generated] -= subtract  # [G]
    return z


class Penalties:
    """What one sequence's picks carry: its penalty operands on the backend (made at the first
    pick, the vocabulary being the logits' width: which tokens the prompt holds, which end a
    generation, logit_bias; each pick is then counted there, so nothing but the id crosses) and
    the structured-output constraint, advanced by each pick."""

    def __init__(self, prompt_ids: list[int], end_ids: set[int] | None = None, constraint: TokenConstraint | None = None) -> None:
        self.prompt = list(prompt_ids)  # in order: DRY looks for repeats in the prompt and the picks
        self.mirostat: Mirostat | None = None
        self.prompt_ids = np.unique(np.asarray(prompt_ids, dtype=np.int64))
        self.end_ids = np.array(sorted(end_ids or ()), dtype=np.int64)  # masked before min_tokens
        self.constraint = constraint  # structured output: which tokens may come next
        self.generated: list[int] = []  # picks made before the operands exist are counted into them
        self.unread = 0  # picks counted on the backend whose ids the host has not read yet (run-ahead)
        self.backend: Backend | None = None
        self.operands: PenaltyOperands | None = None

    @property
    def count(self) -> int:
        """Picks made so far, read back or not (min_tokens counts them all)."""
        return len(self.generated) + self.unread

    def forced(self) -> int | None:
        """The next token when the constraint forces one (no pick, no draw)."""
        return None if self.constraint is None else self.constraint.forced()

    def add(self, token: int, token_t: Tensor | None = None) -> None:
        """Record a pick; `token_t` its [1] i32 tensor on the backend (uploaded when None)."""
        if token_t is None and self.operands is not None and self.backend is not None:
            token_t = self.backend.upload(np.array([token], dtype=np.int32), "i32")
        self.counted(token_t)
        self.read(token)

    def counted(self, token_t: Tensor | None) -> None:
        """A pick made on the backend into `token_t`, its id not read yet: counted there now."""
        self.unread += 1
        if self.operands is not None and self.backend is not None and token_t is not None:
            self.backend.count_token(self.operands.counts, token_t)

    def read(self, token: int) -> None:
        """The id of the oldest pick `counted` and not yet read."""
        if not self.unread:
            raise RuntimeError("Penalties.read of a pick that was never counted")
        self.unread -= 1
        if self.constraint is not None:
            self.constraint.advance(token)
        self.generated.append(token)

    def apply(self, backend: Backend, logits: Tensor, params: SamplingParams) -> Tensor:
        """logits [1, V] on `backend` -> the penalized, biased [1, V] there (Backend.penalize)."""
        if self.operands is None or self.backend is not backend:
            self.backend, self.operands = backend, self.operands_on(backend, int(logits.shape[-1]), params)
        return backend.penalize(logits, self.operands, params, self.count < params.min_tokens)

    def mirostat_state(self, params: SamplingParams) -> Mirostat:
        """Mirostat's mu for this sequence, 2 x tau before its first pick (llama.cpp's)."""
        if self.mirostat is None:
            self.mirostat = Mirostat(2 * params.mirostat_tau)
        return self.mirostat

    def dry_row(self, row: np.ndarray, params: SamplingParams) -> np.ndarray:
        """row [V] (read back) less DRY's penalties for the sequence so far."""
        return row - dry_penalties(self.prompt + self.generated, params, row.shape[0])  # [V]

    def operands_on(self, backend: Backend, vocab: int, params: SamplingParams) -> PenaltyOperands:
        if self.unread:  # their ids are not known here yet, so they could not be counted in
            raise RuntimeError("penalty operands made while picks are unread")
        counts = np.bincount(np.asarray(self.generated, dtype=np.int64), minlength=vocab)[:vocab]  # [V]
        flags = np.zeros(vocab, dtype=np.int32)  # [V]
        flags[self.prompt_ids[self.prompt_ids < vocab]] |= PROMPT_TOKEN
        flags[self.end_ids[self.end_ids < vocab]] |= END_TOKEN
        bias = None
        if params.logit_bias:
            bias = np.zeros(vocab, dtype=np.float32)  # [V]
            for token, value in params.logit_bias:
                bias[token] += np.float32(value)
            bias = backend.upload(bias, "f32")
        return PenaltyOperands(backend.upload(counts.astype(np.int32), "i32"), backend.upload(flags, "i32"), bias)


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
    exp(0) = 1, so the sum is >= 1 (an all -inf / NaN row is uniform). T is the kernels' float32
    (kernel_temperature), as in sampling.cuh."""
    z = np.where(np.isnan(logits), -np.inf, logits).astype(np.float32)  # [V]
    top = z.max()
    t = np.float32(kernel_temperature(temperature))
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf on the maxima (replaced by 0); a tiny T: -inf
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
    rank: int | None = None  # the logits at or above the token's, itself and ties included (1: the most likely)


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """logits [V] -> the TokenLogprob of `token` and the `top` alternatives (ties: lower id first)."""
    z = np.where(np.isnan(logits), -np.inf, logits).astype(np.float64)  # [V]
    peak = z.max()
    logprobs = z - (peak + np.log(np.exp(z - peak).sum())) if np.isfinite(peak) else np.full_like(z, -np.log(z.size))
    order = top_order(logprobs, top)  # [top]
    rank = int((z >= z[token]).sum())
    return TokenLogprob(token, float(logprobs[token]), tuple((int(i), float(logprobs[i])) for i in order), rank)


def top_order(values: np.ndarray, top: int) -> np.ndarray:
    """The ids of the `top` largest values [V], largest first, ties the lower id first: the
    values at or above the top-th largest (its ties too) sorted, not the whole row."""
    if top <= 0:
        return np.zeros(0, dtype=np.int64)
    ids = np.arange(values.size)  # [V]
    if top < values.size:
        ids = np.flatnonzero(values >= np.partition(values, values.size - top)[values.size - top])  # [>= top]
    return ids[np.lexsort((ids, -values[ids]))][:top]


def choose_token(logits: np.ndarray, params: SamplingParams, uniform: float, xtc_chance: float | None = None) -> int:
    """The reference token choice of `Backend.sample` for one row of logits [V]; min_p keeps the
    tokens with p >= min_p * the largest kept p before top_p sees them. On the host also llama.cpp's
    filters in its order: top-n-sigma before top_k, typical-p after it, XTC last when its draw
    `xtc_chance` is <= xtc_probability, then the kept tokens drawn at dynatemp's temperature when it
    has a range (atlas.sampling_filters). A row of NaN alone has no token: NO_TOKEN."""
    if np.isnan(logits).all():
        return NO_TOKEN
    probs = softmax_probs(logits, params.temperature)  # [V]
    keep = top_k_mask(probs, params.top_k)
    if params.top_n_sigma > 0:
        keep &= top_n_sigma_mask(logits, params.top_n_sigma)
    if params.typical_p < 1:
        keep = typical_mask(probs, keep, params.typical_p)
    if params.min_p > 0:
        keep &= probs >= np.float32(params.min_p) * probs[keep].max()
    keep = top_p_mask(probs, keep, params.top_p)
    if xtc_chance is not None and xtc_chance <= params.xtc_probability:
        keep = xtc_mask(probs, keep, params.xtc_threshold)
    if params.temperature > 0 and params.dynatemp_range > 0:
        probs = softmax_probs(np.where(keep, logits, -np.inf), dynamic_temperature(logits, keep, params))  # [V]
    cumulative = np.cumsum(np.where(keep, probs, 0.0).astype(np.float64))  # [V]
    index = int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"))
    return min(index, logits.shape[0] - 1)
