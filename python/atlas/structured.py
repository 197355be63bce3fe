"""Structured output: the text is one JSON object (OpenAI's response_format json_object), one value
a JSON schema admits (json_schema; atlas.json_schema), a text a regular expression matches whole,
one of a few texts (vLLM's regex and choice) or one a GBNF grammar derives (llama.cpp's grammar,
vLLM's guided_grammar; atlas.gbnf). The byte-level matcher of atlas.json_match says
which tokens may come next and the pick is made among those: greedy takes the most likely allowed
token, sampling draws from the allowed tokens' distribution (top-k / top-p / min_p applied to
it). Once the text is whole and nothing may follow it, only an end-of-sequence id may come."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from .backends.base import SamplingParams, kernel_temperature
from .errors import AtlasError
from .gbnf import compile_grammar_tokens
from .sampling import choose_token
from .json_match import ANY_OBJECT, AfterMarker, Literal, Matcher, Node, Text, Transitions
from .json_regex import RegexError, compile_regex
from .json_schema import compile_schema

GREEDY_CANDIDATES = 64  # the most likely tokens tried first; the full order only when none fits
SAMPLE_CANDIDATES = 256  # sampling walks these most likely tokens first (the device lists them) before the row
NEGLIGIBLE_MASS = 1e-6  # sampling: tokens are checked until the unchecked mass is below this share
SORT_CHUNK = 256  # sampling: tokens put in order a chunk at a time (the walk mostly stops early)
FLOOR_SLACK = 1e-5  # the walk goes a little past the filters' cut: the sampler's float32 may round a tie in
SHAPES = 16  # compiled shapes kept with their transition caches (requests repeat schemas)
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


class NoAllowedToken(AtlasError):
    """The request's rules leave no token to write next (a pattern nothing matches, a choice its
    bad_words forbid): the request's mistake, not the server's."""

    def __init__(self) -> None:
        super().__init__("structured output: no token of the vocabulary continues the text; the request's "
                         "format and token rules leave nothing to write")


@dataclass(frozen=True)
class OutputFormat:
    """What the text must be. kind: "json_object", "json_schema" (spec: the schema, parsed),
    "regex" (spec: a pattern the whole text matches, atlas.json_regex's subset), "choice" (spec:
    a tuple of the texts it may be), "grammar" (spec: GBNF rules whose root derives the whole
    text, atlas.gbnf). after: the format starts once the text holds this, up to 4
    line breaks later (a reasoning block's end, "</think>")."""

    kind: str
    spec: Any = field(default=None, compare=False)
    after: str | None = None

    @staticmethod
    def of(json_object: object = False, json_schema: Any = None, regex: object = None, choice: object = None,
           after: object = None, grammar: object = None) -> OutputFormat | None:
        """From LLM.generate's keywords (at most one format); AtlasError on a malformed one."""
        if not isinstance(json_object, bool):
            raise AtlasError(f"json_object must be True or False, got {json_object!r}")
        specs = (json_object or None, json_schema, regex, choice, grammar)
        given = [(kind, spec) for kind, spec in zip(KINDS, specs, strict=True) if spec is not None]
        if len(given) > 1:
            raise AtlasError(f"{given[0][0]} and {given[1][0]} exclude each other: give one output format")
        if after is not None and (not isinstance(after, str) or not after):
            raise AtlasError(f"output_after must be a non-empty string, got {after!r}")
        if not given:
            if after is not None:
                raise AtlasError("output_after needs an output format "
                                 "(json_object, json_schema, regex, choice or grammar)")
            return None
        kind, spec = given[0]
        if kind in ("regex", "grammar") and not isinstance(spec, str):
            raise AtlasError(f"{kind} must be a string, got {spec!r}")
        if kind == "choice":
            if not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(c, str) and c for c in spec):
                raise AtlasError(f"choice must be a non-empty list of non-empty strings, got {spec!r}")
            spec = tuple(spec)
        return OutputFormat(kind, None if kind == "json_object" else spec, after)

    def shape(self) -> Transitions:
        """The compiled shape (kept for SHAPES formats); AtlasError: one line on what the format
        asks that generation cannot honour."""
        try:
            canonical = json.dumps(self.spec, allow_nan=False)  # key order kept: properties are written in it
        except (TypeError, ValueError) as err:
            raise AtlasError(f"json schema: not JSON ({err})") from None
        except RecursionError:
            raise AtlasError("json schema: nested too deeply to read; flatten it") from None
        try:
            return _shape(self.kind, canonical, self.after)
        except RecursionError:  # the parsers and compilers recurse over the nesting
            raise AtlasError(f"{self.kind.replace('_', ' ')}: nested too deeply to compile; flatten it") from None


@lru_cache(maxsize=SHAPES)
def _shape(kind: str, canonical: str, after: str | None) -> Transitions:
    spec = json.loads(canonical)
    value: Node
    if kind == "json_object":
        value = ANY_OBJECT
    elif kind == "json_schema":
        value = compile_schema(spec)
    elif kind == "choice":
        value = Literal(text.encode() for text in spec)
    elif kind == "grammar":
        value, tokens = compile_grammar_tokens(spec)
        return Transitions(value if after is None else AfterMarker(after.encode(), value), tokens)
    else:
        try:
            value = Text(compile_regex(spec, search=False))
        except RegexError as err:
            raise AtlasError(f"regex: {err}") from None
    return Transitions(value if after is None else AfterMarker(after.encode(), value))


def output_shape(schema: Any = None, after: str | None = None) -> Transitions:
    """A JSON schema's shape (None: JSON mode's object)."""
    return OutputFormat("json_object" if schema is None else "json_schema", schema, after).shape()


class TokenConstraint:
    """Which tokens may come next in one generation (allows), followed pick by pick (advance), and
    the pick among them: greedy takes the most likely allowed token, sampling draws from the
    allowed tokens' distribution. Structured output's OutputConstraint, and atlas.token_rules'
    allowed_token_ids and bad_words."""

    @property
    def complete(self) -> bool:
        """Only an end id may come (the pick is then the best allowed, even when sampling)."""
        return False

    def allows(self, token: int) -> bool:
        raise NotImplementedError

    def advance(self, token: int) -> None:
        """The pick was `token`."""

    def forced(self) -> int | None:
        """The token that must come next without a pick (atlas.thinking_budget's closing), if any."""
        return None

    def first_allowed(self, ids: np.ndarray) -> int | None:
        """The first allowed token of ids (most likely first, -1 ends the list), if any: greedy()
        from a backend's top_ids without reading the row back."""
        for token in ids.tolist():
            if token < 0:
                break
            if self.allows(token):
                return int(token)
        return None

    def greedy(self, logits: np.ndarray) -> int:
        """The most likely allowed token of logits [V] (NaN never; ties: the lower id)."""
        z = np.where(np.isnan(logits), -np.inf, logits)  # [V]
        head = np.argpartition(-z, min(GREEDY_CANDIDATES, z.size - 1))[:GREEDY_CANDIDATES]  # [C]
        orders = (lambda: head[np.lexsort((head, -z[head]))], lambda: np.lexsort((np.arange(z.size), -z)))
        for order in orders:  # the full sort only when no candidate fits
            for token in order():
                if self.allows(int(token)):
                    # The most likely allowed one banned (min_tokens' eos): all are. A complete shape
                    # still ends with it: nothing else may follow the closed value.
                    if z[token] == -np.inf and not self.complete:
                        raise NoAllowedToken()
                    return int(token)
        raise NoAllowedToken()

    def mask(self, logits: np.ndarray, temperature: float, top_k: int = 0, min_p: float = 0.0) -> np.ndarray:
        """logits [V] with every token that is not allowed at -inf. Tokens are checked from the most
        likely until the unchecked ones hold under NEGLIGIBLE_MASS of the allowed mass; those are
        left out too. The walk also stops where the sampler's filters on the allowed tokens would
        drop every later one: past the top_k-th allowed token (and its ties), below min_p x the most
        likely allowed one. Weights are float64 exp((logit - max) / temperature): the allowed
        tokens may lie far below the most likely ones, where float32 probabilities underflow."""
        z = np.where(np.isnan(logits), -np.inf, logits).astype(np.float64)  # [V]
        top, t = z.max(), kernel_temperature(temperature)  # the sampler's T
        with np.errstate(invalid="ignore", over="ignore"):
            probs = np.exp(np.where(z == top, 0.0, (z - top) / t))  # [V] unnormalised, the maxima 1
        allowed, _ = self.walk(descending(probs), top_k, min_p)
        masked = np.full(logits.shape, -np.inf, dtype=np.float32)  # [V]
        masked[allowed] = logits[allowed]
        if not np.isfinite(masked).any():
            if np.isnan(masked).any():  # a numerical fault, not the request's rules
                raise AtlasError("structured output: the step's logits are NaN where the format allows tokens")
            raise NoAllowedToken()  # none allowed, or only ones at -inf
        return masked

    def walk(self, order: Iterable[tuple[int, float, float]], top_k: int, min_p: float) -> tuple[list[int], bool]:
        """mask()'s walk over (token, weight, weight of all tokens after it), most likely first:
        the allowed tokens it keeps, and whether one of its rules ended it (else the order ran out)."""
        allowed: list[int] = []
        mass, floor = 0.0, 0.0  # allowed weight so far; the weight below which none can be kept
        for token, p, after in order:
            if (mass > 0 and p + after < NEGLIGIBLE_MASS * mass) or (allowed and p < floor):
                return allowed, True
            if self.allows(token):
                allowed.append(token)
                mass += p
                if len(allowed) == 1:
                    floor = max(floor, min_p * p * (1 - FLOOR_SLACK))
                if len(allowed) == top_k:
                    floor = max(floor, p * (1 - FLOOR_SLACK))
        return allowed, False

    def sample_listed(self, listed: ListedRow, sampling: SamplingParams, uniform: float) -> int | None:
        """host_pick's sampled choice from a backend's summary of the row instead of the row:
        mask()'s walk over the listed most likely tokens, whose weights and the weight after each
        come from their logits and the row's log-sum-exp at the temperature, then the reference
        sampler over the allowed ones alone (in id order, as over the masked row). None when the
        walk would go past the list (the caller reads the row)."""
        ids = listed.ids[listed.ids >= 0]  # [N] descending
        if ids.size == 0 or not np.isfinite(listed.lse) or sampling.host_filters:  # those see the whole row
            return None
        t = kernel_temperature(sampling.temperature)  # the T of listed.lse
        values = listed.values[: ids.size].astype(np.float64)  # [N] their logits, the first the peak
        weights = np.exp((values - values[0]) / t)  # [N] as mask()'s, the peak's 1
        total = float(np.exp(listed.lse - values[0] / t))  # the whole row's weight
        after = np.maximum(total - np.cumsum(weights), 0.0)  # [N]
        order = zip(ids.tolist(), weights.tolist(), after.tolist())
        allowed, ended = self.walk(order, sampling.top_k, sampling.min_p)
        chosen = sorted(allowed)  # the sampler draws in id order, as over the masked row
        logit_of = dict(zip(ids.tolist(), listed.values[: ids.size].tolist()))
        row = np.array([logit_of[token] for token in chosen], dtype=np.float32)  # [A]
        if not (ended or ids.size == listed.vocab) or not np.isfinite(row).any():
            return None  # past the list, or nothing finite allowed: mask() decides (and says so)
        return chosen[choose_token(row, sampling, uniform)]


class OutputConstraint(TokenConstraint):
    """One generation's structured-output state: the text stays a prefix of the shape's texts
    (JSON mode's object unless another shape is given). special_text: special tokens' text (their
    token_bytes are None), which a grammar's token terminal <text> may name."""

    def __init__(self, token_bytes: Sequence[bytes | None], end_ids: set[int], shape: Transitions | None = None,
                 special_text: dict[int, bytes] | None = None) -> None:
        if not end_ids:
            raise AtlasError("structured output needs an end-of-sequence token to end the text; "
                             "the model has none (or ignore_eos is set)")
        self.token_bytes = token_bytes
        self.end_ids = end_ids
        self.matcher = Matcher(shape or output_shape())
        self.special_text = special_text or {}

    @property
    def complete(self) -> bool:
        """The value is whole and nothing may follow: only an end id may come."""
        return self.matcher.complete

    def allows(self, token: int) -> bool:
        if token in self.end_ids:
            return self.matcher.can_end
        data = self._bytes(token)
        if not self.matcher.transitions.uses_tokens:
            return bool(data) and self.matcher.copy().feed(data)  # type: ignore[arg-type]
        text = self._text(token, data)
        return text is not None and self.matcher.copy().take(token, data, text)

    def advance(self, token: int) -> None:
        if token not in self.end_ids:
            data = self._bytes(token)
            text = self._text(token, data)
            assert text is not None and self.matcher.take(token, data, text), f"token {token} was not allowed"

    def _bytes(self, token: int) -> bytes | None:
        return self.token_bytes[token] if 0 <= token < len(self.token_bytes) else None

    def _text(self, token: int, data: bytes | None) -> bytes | None:
        """A token's text for token terminals; None for an id with none (padding past the
        tokenizer's vocabulary), which no terminal, negated or not, may take."""
        return data if data is not None else self.special_text.get(token)


@dataclass(frozen=True)
class ListedRow:
    """A backend's summary of one row of logits (Backend.logprob_rows at the sampling temperature):
    its most likely ids, descending (-1 past what is listed), their logits, the log-sum-exp of the
    row / T (double), and the row's width."""

    ids: np.ndarray  # [N] i32
    values: np.ndarray  # [N] f32
    lse: float
    vocab: int


def descending(probs: np.ndarray) -> Iterator[tuple[int, float, float]]:
    """(token id, its weight, the weight of all tokens after it) from the most likely, put in
    order a chunk at a time (SORT_CHUNK, then four times as many each time: a peaked distribution
    costs one partial sort, a flat one a few). The weight after is summed, not subtracted from a
    total, so it stays exact where it is tiny beside the total."""
    rest, chunk = np.arange(probs.size), SORT_CHUNK  # [R] not yet ordered
    while rest.size:
        if rest.size > chunk:
            part = np.argpartition(-probs[rest], chunk)[:chunk]  # [C]
            head, rest = rest[part], np.delete(rest, part)
        else:
            head, rest = rest, rest[:0]
        head = head[np.argsort(-probs[head], kind="stable")]  # [C]
        weights = probs[head]  # [C]
        after = float(probs[rest].sum()) + np.concatenate((np.cumsum(weights[::-1])[::-1][1:], [0.0]))  # [C]
        yield from zip(head.tolist(), weights.tolist(), after.tolist())
        chunk *= 4
