"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens: the anthropic client,
agents written against it), as vLLM and llama.cpp serve it: a request is translated into a chat
request (system -> a system message, text / thinking / tool_use / tool_result blocks -> chat
messages, tools -> function tools, thinking -> the template's enable_thinking), and its one answer
comes back as a message of content blocks (thinking under --reasoning-parser, text, tool_use under
--tool-call-parser), whole or as the API's server-sent events. Errors have Anthropic's shape.
output_config.format (a JSON schema) is structured output; temperature / top_p / top_k (which the
current client sends only in extra_body) and vLLM's sampling extras pass through. Not supported
(refused): image and document blocks, server tools, MCP servers, containers; hints with no effect
here (cache_control, metadata, service_tier, effort) are accepted."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse

from ..sampling import is_int
from .answer import AnswerShaper
from .choices import whole_text
from .errors import RequestError
from .formats import GENERATION_EXTRAS
from .tools import ToolCall
from .worker import Event, Failed, Finished, TextPiece

PASSED_THROUGH = ("model", "temperature", "top_p", "top_k", "stream", "seed", "min_p", "repetition_penalty",
                  *GENERATION_EXTRAS)
REFUSED = {"mcp_servers": "MCP servers are not supported", "container": "containers are not supported"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 503: "overloaded_error"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_request(body: Any, counting: bool = False, template_defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Messages request -> the equivalent /v1/chat/completions body (counting: count_tokens',
    which has no max_tokens; template_defaults: the server's --chat-template-kwargs). A final
    assistant turn is a prefill the answer continues."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for key, why in REFUSED.items():
        if body.get(key) is not None:
            raise RequestError(f"'{key}': {why}", key)
    chat: dict[str, Any] = {key: body[key] for key in PASSED_THROUGH if key in body}
    if counting:
        chat["max_tokens"] = 1
    elif not isinstance(body.get("max_tokens"), int) or isinstance(body["max_tokens"], bool) or body["max_tokens"] < 1:
        raise RequestError("'max_tokens' is required: the most tokens to generate, an integer >= 1", "max_tokens")
    else:
        chat["max_tokens"] = body["max_tokens"]
    chat["messages"] = system_messages(body.get("system")) + chat_messages(body.get("messages"))
    final = chat["messages"][-1]
    if final["role"] == "assistant" and final["content"] and not final.get("tool_calls"):
        if final["content"] != final["content"].rstrip():  # as Anthropic: the continuation would start oddly
            raise RequestError("the final assistant turn (a prefill) must not end with whitespace; strip it", "messages")
        chat.update(add_generation_prompt=False, continue_final_message=True)
    if body.get("stop_sequences") is not None:
        if not isinstance(body["stop_sequences"], list):
            raise RequestError("'stop_sequences' must be a list of strings", "stop_sequences")
        chat["stop"] = body["stop_sequences"]
    if body.get("tools") is not None:
        chat["tools"] = function_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat.update(tool_choice(body["tool_choice"]))
    if body.get("output_config") is not None:
        chat.update(output_format(body["output_config"]))
    kwargs = {**template_kwargs(body), **thinking_kwargs(body.get("thinking"))}
    if isinstance(thinking := body.get("thinking"), dict) and thinking["type"] == "enabled":
        chat["thinking_token_budget"] = thinking["budget_tokens"]
    if "enable_thinking" not in kwargs and "enable_thinking" not in (template_defaults or {}):
        kwargs["enable_thinking"] = False  # Anthropic's: no thinking unless asked for
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    return chat


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    value = body.get("chat_template_kwargs")  # vLLM's extension
    if value is not None and not isinstance(value, dict):
        raise RequestError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    return value or {}


def thinking_kwargs(value: Any) -> dict[str, Any]:
    """`thinking` -> the chat template's enable_thinking (Qwen's); an enabled block's
    budget_tokens caps it (chat_request passes it on as thinking_token_budget). Any budget >= 1
    is taken (Anthropic's API asks for >= 1024: small models think in fewer)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or value.get("type") not in ("enabled", "adaptive", "disabled"):
        raise RequestError("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"adaptive\"} "
                           "or {\"type\": \"disabled\"}", "thinking")
    budget = value.get("budget_tokens")
    if value["type"] == "enabled" and (not is_int(budget) or budget < 1):
        raise RequestError(f"'thinking.budget_tokens' must be an integer >= 1 (the most tokens of thinking), got {budget!r}",
                           "thinking.budget_tokens")
    return {"enable_thinking": value["type"] != "disabled"}


def system_messages(value: Any) -> list[dict[str, Any]]:
    """`system`: a string or text blocks -> one system message (none when absent)."""
    if value is None:
        return []
    return [{"role": "system", "content": value if isinstance(value, str) else block_text(value, "system")}]


def block_text(blocks: Any, where: str, between: str = "") -> str:
    """Text blocks (a system prompt, a tool result) -> their text, `between` each."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list) or not all(isinstance(b, dict) and b.get("type") == "text" and
                                                isinstance(b.get("text"), str) for b in blocks):
        raise RequestError(f"'{where}' must be a string or a list of text blocks (only text is supported)", where)
    return between.join(b["text"] for b in blocks)


def chat_messages(value: Any) -> list[dict[str, Any]]:
    """`messages`: user and assistant turns, each a string or content blocks -> chat messages (a
    user turn's tool_result blocks become tool messages before its text)."""
    if not isinstance(value, list) or not value:
        raise RequestError("'messages' must be a non-empty list of {\"role\", \"content\"} turns", "messages")
    messages: list[dict[str, Any]] = []
    for role, blocks, i in merged_turns(value):
        messages += turn_messages(role, blocks, i)
    return messages


def merged_turns(value: list[Any]) -> list[tuple[str, list[Any], int]]:
    """The turns as (role, content blocks, index of the first), consecutive turns of one role
    merged into one as Anthropic merges them (their texts a blank line apart)."""
    turns: list[tuple[str, list[Any], int]] = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
            raise RequestError(f"messages[{i}] must be an object whose role is user or assistant", f"messages[{i}]")
        content = turn.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise RequestError(f"messages[{i}].content must be a string or a list of content blocks",
                               f"messages[{i}].content")
        if turns and turns[-1][0] == turn["role"]:
            role, blocks, first = turns[-1]
            text_meets_text = blocks and content and all(isinstance(b, dict) and b.get("type") == "text"
                                                         for b in (blocks[-1], content[0]))
            turns[-1] = (role, [*blocks, *([{"type": "text", "text": "\n\n"}] if text_meets_text else []), *content], first)
        else:
            turns.append((turn["role"], list(content), i))
    return turns


@dataclass
class Turn:
    """One Messages turn's blocks, gathered into chat fields."""

    text: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    results: list[dict[str, Any]] = field(default_factory=list)  # tool messages


def turn_messages(role: str, blocks: list[Any], index: int) -> list[dict[str, Any]]:
    turn = Turn()
    for j, block in enumerate(blocks):
        add_block(turn, role, block, f"messages[{index}].content[{j}]")
    if role == "user":
        return turn.results + ([{"role": "user", "content": "".join(turn.text)}] if turn.text or not turn.results else [])
    message: dict[str, Any] = {"role": "assistant", "content": "".join(turn.text)}
    if turn.thinking:
        message["reasoning_content"] = "".join(turn.thinking)
    if turn.calls:
        message["tool_calls"] = turn.calls
    return [message]


def add_block(turn: Turn, role: str, block: Any, where: str) -> None:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text" and isinstance(block.get("text"), str):
        turn.text.append(block["text"])
    elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
        turn.thinking.append(block["thinking"])
    elif kind == "redacted_thinking" and role == "assistant":
        pass  # opaque: a client sends back what it was given
    elif kind == "tool_use" and role == "assistant" and isinstance(block.get("name"), str) and isinstance(block.get("input"), dict):
        turn.calls.append({"id": block.get("id") if isinstance(block.get("id"), str) else f"toolu_{uuid.uuid4().hex[:24]}",
                           "type": "function",
                           "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}})
    elif kind == "tool_result" and role == "user" and isinstance(block.get("tool_use_id"), str):
        content = block_text(block.get("content", ""), f"{where}.content", "\n")
        if block.get("is_error") is True:  # else the model could not tell a failure from a result
            content = f"Error: {content}"
        turn.results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
    else:
        raise RequestError(f"{where}: a {kind!r} block is not supported here (text, and for the assistant thinking and "
                           "tool_use, for the user tool_result; each with its fields)", where)


def function_tools(value: Any) -> list[dict[str, Any]]:
    """Messages tools {"name", "description", "input_schema"} -> chat function tools."""
    if not isinstance(value, list):
        raise RequestError("'tools' must be a list of tools", "tools")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom") or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise RequestError(f"tools[{i}]: only custom tools (name, description, input_schema) are supported, got "
                               f"type {kind!r}", f"tools[{i}]")
        function = {"name": tool["name"], "parameters": input_schema(tool.get("input_schema"), i)}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    return tools


def input_schema(value: Any, index: int) -> dict[str, Any]:
    """A tool's input_schema: an object schema (its type may be left out), as a tool_use input is
    an object."""
    schema = {"type": "object"} if value is None else value
    if not isinstance(schema, dict) or schema.setdefault("type", "object") != "object":
        raise RequestError(f"tools[{index}].input_schema must be a JSON schema of type object", f"tools[{index}].input_schema")
    return schema


def tool_choice(value: Any) -> dict[str, Any]:
    """`tool_choice` {"type": auto | any | tool (+ name) | none, "disable_parallel_tool_use"} ->
    the chat request's tool_choice and parallel_tool_calls."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "tool" and isinstance(value.get("name"), str):
        chosen: Any = {"type": "function", "function": {"name": value["name"]}}
    elif kind in TOOL_CHOICES:
        chosen = TOOL_CHOICES[kind]
    else:
        raise RequestError("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", "
                           "\"name\": ...}", "tool_choice")
    return {"tool_choice": chosen, "parallel_tool_calls": value.get("disable_parallel_tool_use") is not True}


def output_format(value: Any) -> dict[str, Any]:
    """`output_config`: its format {"type": "json_schema", "schema"} -> response_format (its
    effort is the model's own business: not enforced)."""
    form = value.get("format") if isinstance(value, dict) else None
    if form is None and isinstance(value, dict):
        return {}
    if not isinstance(form, dict) or form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
        raise RequestError("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}",
                           "output_config.format")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": form["schema"]}}}


def error_response(err: RequestError) -> JSONResponse:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    return JSONResponse(error_body(renamed(err.message), err.status), err.status, headers=err.headers)


def is_messages_path(path: str) -> bool:
    """A route of this API (its clients read Anthropic's error shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(message: str, status: int) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def renamed(message: str) -> str:
    """A chat request's refusal in the Messages request's words."""
    for chat_word, word in (("'stop'", "'stop_sequences'"), ("max_completion_tokens", "max_tokens"),
                            ("tool_choice 'required'", "tool_choice any"), (".function.parameters", ".input_schema"),
                            ("response_format", "output_config.format")):
        message = message.replace(chat_word, word)
    return message


# --- the answer ----------------------------------------------------------------------------------
@dataclass
class MessageMeta:
    model: str
    prompt_tokens: int  # for message_start, before any cache hit is known
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")

    def message(self, content: list[dict[str, Any]], stop_reason: str | None = None, stop_sequence: str | None = None,
                finished: Finished | None = None) -> dict[str, Any]:
        usage = usage_of(finished) if finished is not None else {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


def usage_of(finished: Finished) -> dict[str, int]:
    """Anthropic counts the prompt tokens the cache held apart: input + cache reads = the prompt."""
    return {"input_tokens": finished.prompt_tokens - finished.cached_tokens, "output_tokens": finished.completion_tokens,
            "cache_read_input_tokens": finished.cached_tokens, "cache_creation_input_tokens": 0}


def stop_of(finished: Finished, calls: list[ToolCall]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if calls:
        return "tool_use", None
    if finished.finish_reason == "length":
        return "max_tokens", None
    if isinstance(finished.stop_reason, str):
        return "stop_sequence", finished.stop_reason
    return "end_turn", None


def tool_use_block(call: ToolCall, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments if arguments is None else arguments}


def content_blocks(text: str, shaper: AnswerShaper | None) -> tuple[list[dict[str, Any]], list[ToolCall]]:
    """A whole answer -> its content blocks: thinking, text (when there is any), tool_use."""
    fields, calls = shaper.whole(text) if shaper is not None else ({"content": text or None}, [])
    blocks = []
    if fields.get("reasoning_content") is not None:
        blocks.append({"type": "thinking", "thinking": fields["reasoning_content"], "signature": ""})
    if fields.get("content"):
        blocks.append({"type": "text", "text": fields["content"]})
    return blocks + [tool_use_block(call) for call in calls], calls


async def whole_message(meta: MessageMeta, events: AsyncGenerator[Event, None], shaper: AnswerShaper | None) -> dict[str, Any]:
    text, finished = await whole_text(events)
    blocks, calls = content_blocks(text, shaper)
    return meta.message(blocks, *stop_of(finished, calls), finished=finished)


def sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class MessageStream:
    """A generation's text -> the Messages API's events: a content block opened per kind of text
    (thinking, text) as the shaper moves between them, tool_use blocks and the stop at the end."""

    def __init__(self, meta: MessageMeta, shaper: AnswerShaper | None) -> None:
        self.meta, self.shaper = meta, shaper
        self.index = -1  # of the open block
        self.open: str | None = None  # "thinking" | "text"

    def start(self) -> list[str]:
        return [sse("message_start", {"message": self.meta.message([])})]

    def push(self, text: str) -> list[str]:
        parts = self.shaper.push(text) if self.shaper is not None else [("content", text)] if text else []
        return [line for kind, part in parts for line in self.part(kind, part)]

    def part(self, kind: str, text: str) -> list[str]:
        block = "thinking" if kind == "reasoning_content" else "text"
        lines = [] if self.open == block else [*self.close(), *self.begin(block)]
        delta = {"type": "thinking_delta", "thinking": text} if block == "thinking" else {"type": "text_delta", "text": text}
        return [*lines, sse("content_block_delta", {"index": self.index, "delta": delta})]

    def begin(self, block: str) -> list[str]:
        self.index += 1
        self.open = block
        empty = {"type": "thinking", "thinking": "", "signature": ""} if block == "thinking" else {"type": "text", "text": ""}
        return [sse("content_block_start", {"index": self.index, "content_block": empty})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        lines = [sse("content_block_delta", {"index": self.index, "delta": {"type": "signature_delta", "signature": ""}})] \
            if self.open == "thinking" else []
        self.open = None
        return [*lines, sse("content_block_stop", {"index": self.index})]

    def finish(self, finished: Finished) -> list[str]:
        parts, calls = self.shaper.finish() if self.shaper is not None else ([], [])
        lines = [line for kind, part in parts for line in self.part(kind, part)] + self.close()
        for call in calls:
            self.index += 1
            where = {"index": self.index}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(call.arguments, ensure_ascii=False)}
            lines += [sse("content_block_start", {**where, "content_block": tool_use_block(call, {})}),
                      sse("content_block_delta", {**where, "delta": delta}), sse("content_block_stop", where)]
        stop_reason, stop_sequence = stop_of(finished, calls)
        usage = usage_of(finished)
        return [*lines, sse("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                              "usage": usage}), sse("message_stop", {})]

    def fail(self, message: str, status: int) -> list[str]:
        return [*self.close(), sse("error", error_body(message, status))]


async def stream_message(meta: MessageMeta, events: AsyncGenerator[Event, None],
                         shaper: AnswerShaper | None) -> AsyncGenerator[str, None]:
    stream = MessageStream(meta, shaper)
    for line in stream.start():
        yield line
    async with aclosing(events):
        async for event in events:
            if isinstance(event, TextPiece):
                lines = stream.push(event.text)
            elif isinstance(event, Finished):
                lines = stream.finish(event)
            elif isinstance(event, Failed):
                lines = stream.fail(event.message, event.status)
            else:  # Started: only background responses ask for it
                continue
            for line in lines:
                yield line
            if not isinstance(event, TextPiece):
                return
