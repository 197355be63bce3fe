"""A cap on a thinking model's reasoning: vLLM's thinking_token_budget, llama.cpp's reasoning
budget, the Messages API's thinking.budget_tokens. Once the reasoning block holds `budget`
tokens, the next picks are replaced by the tokens of CLOSING, so the answer gets the rest of
max_tokens instead of a reasoning block cut off at the end.

The block is found in the text's bytes, however the tokenizer splits the tags, as the server's
reasoning split reads it (atlas.server.reasoning): the prompt's last turn (its bytes after its last
special token) leaves it open when its last "<think>" comes after its last "</think>" (Qwen3.6's
generation prompt, a continued message inside its block; reasoning already there is not counted),
closed when a "</think>" follows (a template with thinking off); with neither, an answer that
starts with "<think>" (after whitespace) opens it. It closes where the text writes "</think>".
One block is capped; after it the picks are free. Past the budget the cap waits up to WAIT
tokens for a character the last token left unfinished (a byte-level token may hold part of one)
or a "</think>" the text has started, so the reasoning never ends in a broken character or tag.
Forced tokens skip the pick (no sampling, no draw, no logit_bias) but count as picks for penalties
and the rest; a forced token that another rule of the request forbids (structured output from the
first token, allowed_token_ids, bad_words) is not forced, and the cap gives way."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .errors import AtlasError
from .sampling import is_int
from .structured import TokenConstraint

START, END = b"<think>", b"</think>"
CLOSING = "\n</think>\n\n"  # Qwen's block ends "\n</think>\n\n" before the answer
WAIT = 8  # at most this many tokens past the budget to finish a character or a started "</think>"


def check_budget(budget: object) -> None:
    if budget is not None and (not is_int(budget) or budget < 0):  # type: ignore[operator]
        raise AtlasError(f"thinking_token_budget must be an integer >= 0 (tokens of reasoning), got {budget!r}")


def prompt_state(last_turn: bytes) -> str:
    """The cap's state after the prompt, from its last turn's bytes: "counting" (the block is
    open), "done" (it was closed) or "undecided" (the answer may open one at its start)."""
    opened, closed = last_turn.rfind(START), last_turn.rfind(END)
    if opened > closed:
        return "counting"
    return "done" if closed >= 0 else "undecided"


def partial_tag(tail: bytes, tag: bytes) -> bool:
    """The text ends with a proper start of tag."""
    return any(tail.endswith(tag[:k]) for k in range(1, len(tag)))


def utf8_unfinished(pending: int, data: bytes) -> int:
    """Continuation bytes the text still needs after `data`, `pending` needed before it."""
    for byte in data:
        if pending and byte & 0xC0 == 0x80:
            pending -= 1
        else:
            pending = 3 if byte >= 0xF0 else 2 if byte >= 0xE0 else 1 if byte >= 0xC0 else 0
    return pending


class ThinkingBudget(TokenConstraint):
    """Allows every token; forced() names the token that must come next, once the block is spent.

    token_bytes: a token's bytes in the text (tags included when they are special tokens);
    closing_ids: CLOSING's tokens; last_turn: the prompt's bytes after its last special token."""

    def __init__(self, budget: int, token_bytes: Callable[[int], bytes], closing_ids: Sequence[int],
                 last_turn: bytes) -> None:
        check_budget(budget)
        if not closing_ids:
            raise AtlasError("thinking_token_budget: the tokenizer writes no tokens for the block's end")
        self.budget = budget
        self.token_bytes = token_bytes
        self.closing = tuple(closing_ids)
        self.state = "undecided"  # undecided -> counting -> closing -> done (or undecided -> done)
        self.spent = 0  # tokens in the block so far
        self.head = b""  # undecided: the answer so far
        self.tail = b""  # the text's last bytes, for a tag split across tokens
        self.unfinished = 0  # continuation bytes the text's last character still needs
        self.queued: list[int] = []  # closing tokens still to force
        after_prompt = prompt_state(last_turn)
        if after_prompt == "counting":
            self._open()
        elif after_prompt == "done":
            self.state = "done"

    def allows(self, token: int) -> bool:
        return True

    def forced(self) -> int | None:
        return self.queued[0] if self.queued else None

    def advance(self, token: int) -> None:
        if self.state == "closing":
            self._closed_by(token)
            return
        if self.state == "done":
            return
        data = self.token_bytes(token)
        if self.state == "undecided":
            self._decide(data)
            return
        window, self.tail = self.tail + data, (self.tail + data)[-len(END):]
        self.unfinished = utf8_unfinished(self.unfinished, data)
        if END in window:
            self.state = "done"
        else:
            self.spent += 1
            self._check_spent()

    def _decide(self, data: bytes) -> None:
        """An answer that starts with START (after whitespace) opens the block; any other start
        leaves it unopened for good."""
        self.head += data
        text = self.head.lstrip()
        if text.startswith(START):
            after = text[len(START):]
            self.tail, self.unfinished = after[-len(END):], utf8_unfinished(0, after)
            if END in after:  # opened and closed in one token
                self.state = "done"
            else:
                self._open()
        elif not START.startswith(text):
            self.state = "done"

    def _open(self) -> None:
        self.state, self.spent = "counting", 0
        self._check_spent()

    def _check_spent(self) -> None:
        waiting = self.unfinished > 0 or partial_tag(self.tail, END)
        if self.spent >= self.budget and (not waiting or self.spent >= self.budget + WAIT):
            self.state, self.queued = "closing", list(self.closing)

    def _closed_by(self, token: int) -> None:
        """A pick while closing: the forced token, or another rule's (the cap gives way)."""
        if self.queued and token == self.queued[0]:
            self.queued.pop(0)
            if self.queued:
                return
        self.state, self.queued = "done", []
