"""Structured output: JSON mode (OpenAI's response_format json_object: the text is one JSON object)
and JSON schemas (json_schema: the text is one value the schema admits; atlas.json_schema). The
byte-level matcher of atlas.json_match says which tokens may come next and the pick is made among
those: greedy takes the most likely allowed token, sampling draws from the allowed tokens'
distribution (top-k / top-p / min_p applied to it). Once the value is whole and nothing may follow
it, only an end-of-sequence id may come."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from .errors import AtlasError
from .json_match import ANY_OBJECT, AfterMarker, Matcher, Transitions
from .json_schema import compile_schema

GREEDY_CANDIDATES = 64  # the most likely tokens tried first; the full order only when none fits
NEGLIGIBLE_MASS = 1e-6  # sampling: tokens are checked until the unchecked mass is below this share
SORT_CHUNK = 256  # sampling: tokens put in order a chunk at a time (the walk mostly stops early)
SHAPES = 16  # compiled shapes kept with their transition caches (requests repeat schemas)


@lru_cache(maxsize=SHAPES)
def _shape(canonical: str | None, after: str | None) -> Transitions:
    value = ANY_OBJECT if canonical is None else compile_schema(json.loads(canonical))
    return Transitions(value if after is None else AfterMarker(after.encode(), value))


def output_shape(schema: Any = None, after: str | None = None) -> Transitions:
    """The shape JSON output keeps to: one value `schema` admits (None: JSON mode's object), after
    free text up to `after` when given (a reasoning block's end). SchemaError: one line on what
    the schema asks that generation cannot honour."""
    if schema is None:
        return _shape(None, after)
    try:
        canonical = json.dumps(schema, allow_nan=False)  # key order kept: properties are written in it
    except (TypeError, ValueError) as err:
        raise AtlasError(f"json schema: not JSON ({err})") from None
    return _shape(canonical, after)


class JsonConstraint:
    """One generation's structured-output state: which tokens may come next (the text stays a
    prefix of the shape's texts: JSON mode's object unless a schema's shape is given), and the
    pick among them."""

    def __init__(self, token_bytes: Sequence[bytes | None], end_ids: set[int], shape: Transitions | None = None) -> None:
        if not end_ids:
            raise AtlasError("JSON output needs an end-of-sequence token to end the value; "
                             "the model has none (or ignore_eos is set)")
        self.token_bytes = token_bytes
        self.end_ids = end_ids
        self.matcher = Matcher(shape or output_shape())

    @property
    def complete(self) -> bool:
        """The value is whole and nothing may follow: only an end id may come."""
        return self.matcher.complete

    def allows(self, token: int) -> bool:
        if token in self.end_ids:
            return self.matcher.can_end
        data = self.token_bytes[token] if token < len(self.token_bytes) else None
        return bool(data) and self.matcher.copy().feed(data)  # type: ignore[arg-type]

    def advance(self, token: int) -> None:
        if token not in self.end_ids:
            data = self.token_bytes[token]
            assert data and self.matcher.feed(data), f"token {token} was not allowed"

    def greedy(self, logits: np.ndarray) -> int:
        """The most likely allowed token of logits [V] (NaN never; ties: the lower id)."""
        z = np.where(np.isnan(logits), -np.inf, logits)  # [V]
        head = np.argpartition(-z, min(GREEDY_CANDIDATES, z.size - 1))[:GREEDY_CANDIDATES]  # [C]
        orders = (lambda: head[np.lexsort((head, -z[head]))], lambda: np.lexsort((np.arange(z.size), -z)))
        for order in orders:  # the full sort only when no candidate fits
            for token in order():
                if self.allows(int(token)):
                    return int(token)
        raise AtlasError("structured output: no token of the vocabulary continues the JSON text")

    def mask(self, logits: np.ndarray, probs: np.ndarray) -> np.ndarray:
        """logits [V] with every token that is not allowed at -inf. Tokens are checked from the most
        likely (probs [V]) until the unchecked ones hold under NEGLIGIBLE_MASS of the allowed mass;
        those are left out too."""
        masked = np.full(logits.shape, -np.inf, dtype=np.float32)  # [V]
        checked = allowed = 0.0
        for token in descending(probs):
            if allowed > 0 and 1.0 - checked < NEGLIGIBLE_MASS * allowed:
                break
            checked += float(probs[token])
            if self.allows(int(token)):
                masked[token] = logits[token]
                allowed += float(probs[token])
        if not np.isfinite(masked).any():
            raise AtlasError("structured output: no token of the vocabulary continues the JSON text")
        return masked


def descending(probs: np.ndarray) -> Iterator[int]:
    """Token ids of probs [V] from the most likely, put in order a chunk at a time (SORT_CHUNK,
    then four times as many each time: a peaked distribution costs one partial sort, a flat one
    a few)."""
    rest, chunk = np.arange(probs.size), SORT_CHUNK  # [R] not yet ordered
    while rest.size:
        if rest.size > chunk:
            part = np.argpartition(-probs[rest], chunk)[:chunk]  # [C]
            head, rest = rest[part], np.delete(rest, part)
        else:
            head, rest = rest, rest[:0]
        yield from (int(t) for t in head[np.argsort(-probs[head], kind="stable")])
        chunk *= 4
