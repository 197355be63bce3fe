"""A cap on a thinking model's reasoning: vLLM's thinking_token_budget, llama.cpp's reasoning
budget, the Messages API's thinking.budget_tokens. Once the reasoning block holds `budget`
tokens, the next picks are replaced by the tokens of CLOSING, so the answer gets the rest of
max_tokens instead of a reasoning block cut off at the end.

The block is found in the text's bytes, however the tokenizer splits the tags: it is open from the
first new token when the prompt ends with "<think>" (and whitespace), as the server's reasoning
split reads a prompt (Qwen3.6's generation prompt opens it), or opens where the text writes
"<think>"; it closes where the text writes "</think>". One block is capped; after it the picks are
free. The cap waits up to UTF8_WAIT tokens for a character the last token left unfinished (a
byte-level token may hold part of one), so the reasoning text never ends in a broken character.
Forced tokens skip the pick (no sampling, no draw) but count as picks for penalties and the rest;
a forced token that another rule of the request forbids (structured output from the first token)
is not forced, and the cap gives way."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .errors import AtlasError
from .sampling import is_int
from .structured import TokenConstraint

START, END = b"<think>", b"</think>"
CLOSING = "\n</think>\n\n"  # Qwen's block ends "\n</think>\n\n" before the answer
UTF8_WAIT = 3  # at most this many tokens past the budget to finish a character


def check_budget(budget: object) -> None:
    if budget is not None and (not is_int(budget) or budget < 0):  # type: ignore[operator]
        raise AtlasError(f"thinking_token_budget must be an integer >= 0 (tokens of reasoning), got {budget!r}")


def prompt_opens_block(prompt: bytes) -> bool:
    return prompt.rstrip().endswith(START)


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
    closing_ids: CLOSING's tokens; opened: the prompt opened the block."""

    def __init__(self, budget: int, token_bytes: Callable[[int], bytes], closing_ids: Sequence[int], opened: bool) -> None:
        check_budget(budget)
        if not closing_ids:
            raise AtlasError("thinking_token_budget: the tokenizer writes no tokens for the block's end")
        self.budget = budget
        self.token_bytes = token_bytes
        self.closing = tuple(closing_ids)
        self.state = "idle"  # idle -> counting -> closing -> done
        self.spent = 0  # tokens in the block so far
        self.tail = b""  # the text's last bytes, for a tag split across tokens
        self.unfinished = 0  # continuation bytes the text's last character still needs
        self.queued: list[int] = []  # closing tokens still to force
        if opened:
            self._open()

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
        window, self.tail = self.tail + data, (self.tail + data)[-len(END):]
        self.unfinished = utf8_unfinished(self.unfinished, data)
        if self.state == "idle":
            if START in window:
                self.tail = window[window.rindex(START) + len(START):]
                self._open()
        elif END in window:
            self.state = "done"
        else:
            self.spent += 1
            self._check_spent()

    def _open(self) -> None:
        self.state, self.spent = "counting", 0
        self._check_spent()

    def _check_spent(self) -> None:
        if self.spent >= self.budget and (self.unfinished == 0 or self.spent >= self.budget + UTF8_WAIT):
            self.state, self.queued = "closing", list(self.closing)

    def _closed_by(self, token: int) -> None:
        """A pick while closing: the forced token, or another rule's (the cap gives way)."""
        if self.queued and token == self.queued[0]:
            self.queued.pop(0)
            if self.queued:
                return
        self.state, self.queued = "done", []
