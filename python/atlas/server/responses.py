"""Response bodies and stream chunks in the OpenAI shapes, for text and chat completions."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .worker import Finished


@dataclass(frozen=True)
class Reply:
    """What every body and chunk of one response shares."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl" if self.chat else "cmpl"
            object.__setattr__(self, "id", f"{prefix}-{uuid.uuid4().hex}")

    def head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def usage(finished: Finished) -> dict[str, Any]:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens: the prompt cache's share."""
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": finished.cached_tokens},
    }


def full_body(reply: Reply, text: str, finished: Finished) -> dict[str, Any]:
    if reply.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
        body = reply.head("chat.completion")
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
        body = reply.head("text_completion")
    choice["finish_reason"] = finished.finish_reason
    return {**body, "choices": [choice], "usage": usage(finished)}


def chunk(reply: Reply, delta: dict[str, str], finish_reason: str | None = None) -> dict[str, Any]:
    """One stream chunk; delta is {"content": ...} / {"role": ...} (chat) or {"text": ...}."""
    if reply.chat:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
        body = reply.head("chat.completion.chunk")
    else:
        choice = {"index": 0, "text": delta.get("text", ""), "logprobs": None}
        body = reply.head("text_completion")
    choice["finish_reason"] = finish_reason
    return {**body, "choices": [choice]}


def text_delta(reply: Reply, text: str) -> dict[str, str]:
    return {"content": text} if reply.chat else {"text": text}


def usage_chunk(reply: Reply, finished: Finished) -> dict[str, Any]:
    kind = "chat.completion.chunk" if reply.chat else "text_completion"
    return {**reply.head(kind), "choices": [], "usage": usage(finished)}


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"
