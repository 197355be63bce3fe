"""vLLM's allowed_token_ids and bad_words as constraints on each pick (atlas.structured's
TokenConstraint), picked on the host as structured output is, and combined with a structured
output format when a request has both."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .errors import AtlasError
from .structured import TokenConstraint


class AllowedTokens(TokenConstraint):
    """Only these ids may be picked (an end-of-sequence id too only when listed, as vLLM's)."""

    def __init__(self, ids: Iterable[int]) -> None:
        self.ids = frozenset(ids)

    def allows(self, token: int) -> bool:
        return token in self.ids


class BadWords(TokenConstraint):
    """No generated text ends with one of the words' token sequences: the last token of a sequence
    is ruled out where the tokens before it were the last ones generated (vLLM's rule)."""

    def __init__(self, sequences: Iterable[Sequence[int]]) -> None:
        self.finals: dict[tuple[int, ...], set[int]] = {}  # a sequence's tokens but the last -> its last tokens
        for sequence in sequences:
            if sequence:
                self.finals.setdefault(tuple(sequence[:-1]), set()).add(sequence[-1])
        self.generated: list[int] = []
        self.banned = self._banned()

    def allows(self, token: int) -> bool:
        return token not in self.banned

    def advance(self, token: int) -> None:
        self.generated.append(token)
        self.banned = self._banned()

    def _banned(self) -> set[int]:
        """The tokens that would complete a sequence now."""
        out: set[int] = set()
        for prefix, finals in self.finals.items():
            if not prefix or tuple(self.generated[-len(prefix):]) == prefix:
                out |= finals
        return out


class AllConstraints(TokenConstraint):
    """Tokens every part allows (a structured output format beside allowed_token_ids / bad_words)."""

    def __init__(self, parts: Sequence[TokenConstraint]) -> None:
        self.parts = tuple(parts)

    @property
    def complete(self) -> bool:
        return any(part.complete for part in self.parts)

    def allows(self, token: int) -> bool:
        return all(part.allows(token) for part in self.parts)

    def advance(self, token: int) -> None:
        for part in self.parts:
            part.advance(token)

    def forced(self) -> int | None:
        """A part's forced token, unless another part forbids it (that part wins)."""
        token = next((t for part in self.parts if (t := part.forced()) is not None), None)
        return token if token is not None and self.allows(token) else None


def bad_word_sequences(words: Iterable[str], encode: object) -> list[list[int]]:
    """Each word's tokens, alone and after a space (the two ways a tokenizer meets a word in text)."""
    sequences = []
    for word in words:
        for text in dict.fromkeys((word, " " + word.lstrip())):
            sequences.append(list(encode(text)))  # type: ignore[operator]
    return sequences


def check_token_rules(allowed: object, bad_words: object, vocab: int) -> None:
    """allowed_token_ids: None or a non-empty list of ids in the vocabulary; bad_words: a list of
    non-empty strings. One line naming the problem otherwise."""
    from .sampling import is_int

    if allowed is not None:
        ids = list(allowed) if isinstance(allowed, (list, tuple)) else None
        if not ids or not all(is_int(t) and 0 <= t < vocab for t in ids):
            raise AtlasError(f"allowed_token_ids must be a non-empty list of token ids in 0..{vocab - 1}, got {allowed!r}")
    if not isinstance(bad_words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in bad_words):
        raise AtlasError(f"bad_words must be a list of non-empty strings, got {bad_words!r}")
