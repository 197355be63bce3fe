"""Response bodies and stream chunks in the OpenAI shapes, for text and chat completions."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .answer import AnswerShaper
from .worker import Finished, ScoredToken, TextPiece


@dataclass(frozen=True)
class Reply:
    """What every body and chunk of one response shares."""

    chat: bool
    model: str
    logprobs: bool = False  # the request asked for them: each choice carries a logprobs object
    token_ids: bool = False  # vLLM's return_token_ids: prompt_token_ids and each choice's token_ids
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    usage_each_chunk: bool = False  # vLLM's stream_options.continuous_usage_stats: every chunk has usage so far
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl" if self.chat else "cmpl"
            object.__setattr__(self, "id", f"{prefix}-{uuid.uuid4().hex}")

    def head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def usage(finished: list[Finished], n: int = 1) -> dict[str, Any]:
    """OpenAI's usage object over a request's choices, n per prompt in order (each prompt counted
    once, as OpenAI does); prompt_tokens_details.cached_tokens: the prompt cache's share of the
    first choice of each prompt."""
    firsts = finished[::n]
    prompt, completion = sum(f.prompt_tokens for f in firsts), sum(f.completion_tokens for f in finished)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in firsts)},
    }


def full_body(
    reply: Reply, choices: list[dict[str, Any]], finished: list[Finished], n: int = 1, prompt_ids: tuple[int, ...] = ()
) -> dict[str, Any]:
    """A chat's prompt_logprobs and prompt_token_ids (vLLM's) sit beside its choices: one prompt
    for them all."""
    body = {**reply.head("chat.completion" if reply.chat else "text_completion"), "choices": choices}
    if reply.chat and finished and finished[0].prompt_logprobs is not None:
        body["prompt_logprobs"] = list(finished[0].prompt_logprobs)
    if reply.chat and reply.token_ids:
        body["prompt_token_ids"] = list(prompt_ids)
    return {**body, "usage": usage(finished, n)}


def choice_body(
    reply: Reply, index: int, pieces: list[TextPiece], finished: Finished, shaper: AnswerShaper | None = None,
    prompt_ids: tuple[int, ...] = (),
) -> dict[str, Any]:
    """One whole choice; shaper: a chat answer's reasoning block and tool calls go to their
    message fields; prompt_ids: its prompt's (return_token_ids)."""
    text = "".join(p.text for p in pieces)
    logprobs = logprobs_body(reply, tuple(s for p in pieces for s in p.scored), 0)
    finish_reason = finished.finish_reason
    if reply.chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if shaper is not None:
            fields, calls = shaper.whole(text)
            message.update(fields)
            if calls:
                message["tool_calls"] = [call.wire() for call in calls]
                finish_reason = shaper.calls_finish_reason
        choice = {"index": index, "message": message, "logprobs": logprobs}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs}
        if finished.prompt_logprobs is not None:  # vLLM's, per prompt of a batch
            choice["prompt_logprobs"] = list(finished.prompt_logprobs)
    if reply.token_ids:
        choice.update(token_fields(reply, tuple(t for p in pieces for t in p.token_ids), prompt_ids))
    choice["finish_reason"] = finish_reason
    choice["stop_reason"] = finished.stop_reason  # vLLM's: the stop string or stop token id, else null
    return choice


def token_fields(reply: Reply, token_ids: tuple[int, ...], prompt_ids: tuple[int, ...] | None) -> dict[str, Any]:
    """vLLM's return_token_ids fields of a choice: the ids it generated (or a chunk carries), and
    a completions choice's prompt_token_ids (a chat's sit beside the choices; None: not in this chunk)."""
    fields: dict[str, Any] = {"token_ids": list(token_ids)}
    if prompt_ids is not None and not reply.chat:
        fields["prompt_token_ids"] = list(prompt_ids)
    return fields


def chunk(
    reply: Reply, delta: dict[str, Any], finish_reason: str | None = None, logprobs: dict[str, Any] | None = None,
    index: int = 0, ids: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One stream chunk of choice `index`; delta is {"content": ...} / {"role": ...} (chat) or
    {"text": ...}; logprobs: logprobs_body of the tokens whose text it carries; ids: its
    token_fields."""
    if reply.chat:
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs}
        body = reply.head("chat.completion.chunk")
    else:
        choice = {"index": index, "text": delta.get("text", ""), "logprobs": logprobs}
        body = reply.head("text_completion")
    choice.update(ids or {})
    choice["finish_reason"] = finish_reason
    return {**body, "choices": [choice]}


def logprobs_body(reply: Reply, scored: tuple[ScoredToken, ...], offset: int) -> dict[str, Any] | None:
    """A choice's logprobs in OpenAI's shape: chat {"content": [{token, logprob, bytes,
    top_logprobs}]}; completions {tokens, token_logprobs, top_logprobs, text_offset}, offsets
    counted from `offset` in the completion text (return_tokens_as_token_ids names each token
    "token_id:<id>"). None when the request did not ask."""
    if not reply.logprobs:
        return None
    offsets = [offset + sum(len(s.text) for s in scored[:i]) for i in range(len(scored))]
    if reply.tokens_as_ids:
        scored = tuple(s.named_by_id() for s in scored)
    if reply.chat:
        return {"content": content_logprobs(scored), "refusal": None}
    return {
        "tokens": [s.text for s in scored],
        "token_logprobs": [s.logprob for s in scored],
        "top_logprobs": [dict(s.top) if s.logprob is not None else None for s in scored],
        "text_offset": offsets,
    }


def content_logprobs(scored: tuple[ScoredToken, ...]) -> list[dict[str, Any]]:
    """Chat's logprobs.content entries (the Responses API's output_text logprobs have the same shape)."""
    return [{**token_entry(s.text, s.logprob), "top_logprobs": [token_entry(t, lp) for t, lp in s.top]} for s in scored]


def token_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def text_delta(reply: Reply, text: str) -> dict[str, str]:
    return {"content": text} if reply.chat else {"text": text}


def usage_so_far(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """A streamed choice's usage at one chunk (continuous_usage_stats)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage_chunk(reply: Reply, finished: list[Finished], n: int = 1) -> dict[str, Any]:
    kind = "chat.completion.chunk" if reply.chat else "text_completion"
    return {**reply.head(kind), "choices": [], "usage": usage(finished, n)}


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"
