"""A chat answer's text shaped into OpenAI's message fields under the server's parsers: the
reasoning block (reasoning.py) and tool calls (tools.py), the same way streamed or whole."""

from __future__ import annotations

from dataclasses import dataclass

from .reasoning import Field, ReasoningSplitter
from .tools import ForcedCallStream, ToolCall, ToolCallStream

Part = tuple[Field, str]


@dataclass
class AnswerShaper:
    reasoning: ReasoningSplitter | None = None
    tools: ToolCallStream | ForcedCallStream | None = None  # only content can hold tool calls

    @property
    def calls_finish_reason(self) -> str:
        """finish_reason of an answer that made tool calls."""
        return self.tools.finish_reason if self.tools is not None else "tool_calls"

    @property
    def in_reasoning(self) -> bool:
        """The text so far ends inside the reasoning block, or in the line breaks after it."""
        return self.reasoning is not None and self.reasoning.in_block

    def push(self, text: str) -> list[Part]:
        """Generated text -> the (field, text) parts that may be sent now."""
        return self._route(self.reasoning.push(text) if self.reasoning else [("content", text)])

    def finish(self) -> tuple[list[Part], list[ToolCall]]:
        """At the end: the parts held back, and the tool calls the content ended with."""
        parts = self._route(self.reasoning.flush()) if self.reasoning else []
        calls: list[ToolCall] = []
        if self.tools is not None:
            tail, calls = self.tools.finish()
            parts += [("content", tail)] if tail else []
        return parts, calls

    def whole(self, text: str) -> tuple[dict[str, str | None], list[ToolCall]]:
        """A whole answer -> ({"content", "reasoning_content"?}: None where empty, tool calls)."""
        parts = self.push(text)
        held, calls = self.finish()
        parts += held
        fields: dict[str, str | None] = {"content": "".join(t for f, t in parts if f == "content") or None}
        if self.reasoning is not None:
            fields["reasoning_content"] = "".join(t for f, t in parts if f == "reasoning_content") or None
        return fields, calls

    def _route(self, parts: list[Part]) -> list[Part]:
        out: list[Part] = []
        for field, text in parts:
            if field == "content" and self.tools is not None:
                text = self.tools.push(text)
            if text:
                out.append((field, text))
        return out
