"""Reasoning split for chat answers (`atlas.serve --reasoning-parser qwen3`): what a thinking model
writes inside <think> ... </think> goes to `reasoning_content`, the rest to `content` (vLLM's and
DeepSeek's field). Qwen3.6's generation prompt already opens the block ("<think>\n"), so the
answer starts inside it and only closes it; an older or non-thinking prompt leaves it to the
answer to open one. Streamed text is split as it comes, holding back only what may be part of a
tag, so the pieces always join to what the whole answer splits into."""

from __future__ import annotations

from typing import Literal

from ..stop_strings import partial_suffix

Field = Literal["reasoning_content", "content"]
PARSERS = ("qwen3",)  # --reasoning-parser choices: Qwen3 / QwQ / DeepSeek-R1 tags
START, END = "<think>", "</think>"


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """The generation prompt opened a block: the rendered prompt ends with START (and whitespace);
    a START inside a message does not count."""
    return prompt_text.rstrip().endswith(START)


class ReasoningSplitter:
    """push(text) -> [(field, text)] in order; flush() at the end for what was held back."""

    def __init__(self, opened: bool) -> None:
        # undecided: an answer that may still open a block; reasoning: inside one; content: after or none
        self.mode = "reasoning" if opened else "undecided"
        self.pending = ""
        self.strip_newlines = False  # at the start of the content after a block

    def push(self, text: str) -> list[tuple[Field, str]]:
        self.pending += text
        out: list[tuple[Field, str]] = []
        while self.pending:
            before = (self.mode, self.pending)
            out += self._step()
            if (self.mode, self.pending) == before:  # held back: needs more text
                break
        return [(f, t) for f, t in out if t]

    @property
    def in_block(self) -> bool:
        """The text so far ends inside the reasoning block, or in the line breaks after it."""
        return self.mode == "reasoning" or (self.mode == "content" and self.strip_newlines)

    def flush(self) -> list[tuple[Field, str]]:
        text, self.pending = self.pending, ""
        if self.mode == "content" and self.strip_newlines:
            text = text.lstrip("\n")
        field: Field = "reasoning_content" if self.mode == "reasoning" else "content"
        return [(field, text)] if text else []

    def _step(self) -> list[tuple[Field, str]]:
        if self.mode == "undecided":
            return self._decide()
        if self.mode == "reasoning":
            return self._reason()
        return self._content()

    def _decide(self) -> list[tuple[Field, str]]:
        """Reasoning if the answer (after leading whitespace) starts with START, else content."""
        head = self.pending.lstrip()
        if head.startswith(START):
            self.mode, self.pending = "reasoning", head[len(START) :]
        elif not START.startswith(head):  # cannot become START any more
            self.mode = "content"
        return []

    def _reason(self) -> list[tuple[Field, str]]:
        cut = self.pending.find(END)
        if cut >= 0:
            reasoning, self.pending = self.pending[:cut], self.pending[cut + len(END) :]
            self.mode, self.strip_newlines = "content", True
            return [("reasoning_content", reasoning)]
        keep = partial_suffix(self.pending, END)
        sent, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        return [("reasoning_content", sent)]

    def _content(self) -> list[tuple[Field, str]]:
        if self.strip_newlines:
            self.pending = self.pending.lstrip("\n")
            if not self.pending:
                return []
            self.strip_newlines = False
        sent, self.pending = self.pending, ""
        return [("content", sent)]
