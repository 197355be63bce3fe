"""OpenAI's Responses API (POST /v1/responses) over the chat-completions machinery: a request is
translated into a chat request (input items -> messages, instructions -> a system message,
text.format -> response_format, function tools), generated like one, and its answer written as
output items (reasoning under --reasoning-parser, the message, function calls), whole or as the
API's typed server-sent events. Responses are stored unless `store` is false (response_store.py),
so previous_response_id goes on from one; `background` runs one beside the request (background.py);
what cannot be honoured (`conversation`, stored `prompt`s, `truncation: "auto"`, other `include`s)
is refused with one line rather than ignored. Logprobs (`top_logprobs`, or `include`
"message.output_text.logprobs") ride on the message's output text: a token's entry goes with the
answer text its piece releases, and tokens of the reasoning block or of tool calls carry none."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from ..sampling import is_int
from .answer import AnswerShaper, Part
from .formats import GENERATION_EXTRAS
from .choices import whole_pieces
from .responses import content_logprobs
from .errors import RequestError
from .tools import ToolCall
from .worker import Event, Finished, ScoredToken, Started, TextPiece

PASSED_THROUGH = ("model", "temperature", "top_p", "stream", "tool_choice", "parallel_tool_calls", "seed", "top_k",
                  "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "logit_bias",
                  "chat_template_kwargs", "thinking_token_budget", *GENERATION_EXTRAS)  # vLLM takes its extras here too
REFUSED = {"conversation": "conversations are not stored here: use previous_response_id, or send the whole "
                           "conversation in 'input'",
           "prompt": "stored prompt templates are not kept here: send the prompt's text in 'input'"}
# field -> (the values that change nothing here, why another is refused)
UNHONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "truncation": ((None, "disabled"), "a conversation past the context is refused, not cut; send a shorter 'input'"),
}
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's; all but none: thinking on
SUMMARIES = ("auto", "concise", "detailed")
OUTPUT_LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = ("reasoning.encrypted_content", OUTPUT_LOGPROBS)  # nothing is encrypted: reasoning items go as plain text
RENAMED_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def chat_request(body: Any, earlier: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A Responses request -> the equivalent /v1/chat/completions body; `earlier`: the input items
    of the conversation it goes on from (previous_response_id's), before its own input."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for key, why in REFUSED.items():
        if body.get(key) not in (None, False):
            raise RequestError(f"'{key}': {why}", key)
    for key, (harmless, why) in UNHONOURED.items():
        if key in body and not any(body[key] == value and type(body[key]) is type(value) for value in harmless):
            raise RequestError(f"'{key}' {json.dumps(body[key])[:40]}: {why}", key)
    check_include(body.get("include"))
    for key in ("store", "background"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise RequestError(f"'{key}' must be true or false", key)
    if body.get("background") and body.get("store") is False:
        raise RequestError("'background' needs 'store' true: a background response is fetched by its id", "background")
    chat: dict[str, Any] = {key: body[key] for key in PASSED_THROUGH if key in body}
    if wants_logprobs(body):
        top = body.get("top_logprobs")
        chat |= {"logprobs": True, "top_logprobs": 0 if top is None else top}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("'instructions' must be a string", "instructions")
    earlier_messages = input_messages(earlier) if earlier else []
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + earlier_messages + \
        input_messages(body.get("input"))
    check_item_ids(earlier or [], body["input"])
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = function_tools(body["tools"])
    if isinstance(body.get("tool_choice"), dict):
        chat["tool_choice"] = named_choice(body["tool_choice"])
    if body.get("text") is not None:
        chat["response_format"] = text_format(body["text"])
    if reasoning_off(body.get("reasoning")):
        chat["chat_template_kwargs"] = {**(chat.get("chat_template_kwargs") or {}), "enable_thinking": False}
    check_metadata(body.get("metadata"))
    if body.get("max_tool_calls") is not None and not (is_int(body["max_tool_calls"]) and body["max_tool_calls"] >= 0):
        raise RequestError("'max_tool_calls' must be an integer >= 0", "max_tool_calls")  # no built-in tools: any holds
    return chat


def check_include(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise RequestError("'include' must be a list of strings", "include")
    other = [item for item in value if item not in INCLUDABLE]
    if other:
        raise RequestError(f"'include' {other[0]!r} is not produced here (only {', '.join(INCLUDABLE)} are taken)",
                           "include")


def wants_logprobs(body: dict[str, Any]) -> bool:
    """The output text carries logprobs: include names them, or top_logprobs asks for alternatives
    (a top_logprobs that is not an integer is the chat request's to refuse)."""
    top = body.get("top_logprobs")
    return OUTPUT_LOGPROBS in (body.get("include") or ()) or not (top is None or (is_int(top) and top == 0))


def reasoning_off(value: Any) -> bool:
    """`reasoning`: effort "none" turns the chat template's thinking off; the other efforts leave
    it on (Qwen3.6 thinks or not: thinking_token_budget bounds it). A summary of any kind is
    answered by the reasoning items' full text, as vLLM answers it."""
    if value is None:
        return False
    if not isinstance(value, dict) or set(value) - {"effort", "summary", "generate_summary"}:
        raise RequestError("'reasoning' must be an object of 'effort' and 'summary'", "reasoning")
    for key in ("summary", "generate_summary"):
        if value.get(key) not in (None, *SUMMARIES):
            raise RequestError(f"'reasoning.{key}' must be one of {', '.join(SUMMARIES)}", f"reasoning.{key}")
    effort = value.get("effort")
    if effort not in (None, *EFFORTS):
        raise RequestError(f"'reasoning.effort' must be one of {', '.join(EFFORTS)}", "reasoning.effort")
    return effort == "none"


def check_metadata(value: Any) -> None:
    """`metadata`, echoed in the response: OpenAI's up to 16 string pairs (keys up to 64 characters,
    values up to 512)."""
    if value is None:
        return
    if not isinstance(value, dict) or len(value) > 16 or not all(
        isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items()
    ):
        raise RequestError("'metadata' must be an object of at most 16 string values (keys up to 64 characters, "
                           "values up to 512)", "metadata")


def renamed(err: RequestError) -> RequestError:
    """A chat request's error named with the Responses parameter it came from."""
    param = err.param
    for chat_name, name in RENAMED_PARAMS.items():
        if param is not None and (param == chat_name or param.startswith(f"{chat_name}[") or param.startswith(f"{chat_name}.")):
            param = name + param[len(chat_name):]
    message = err.message.replace("'messages'", "'input'").replace("max_tokens", "max_output_tokens")
    return RequestError(message.replace("response_format", "text.format"), param, err.code, err.status)


def check_item_ids(earlier: list[dict[str, Any]], value: Any) -> None:
    """An item id names one item of a conversation, as OpenAI has it (a repeat is refused): the
    stored conversation is listed and paged by them (GET /v1/responses/{id}/input_items)."""
    seen = {item.get("id") for item in earlier}
    for i, item in enumerate(input_items(value)):
        own = item.get("id")
        if isinstance(own, str) and own:
            if own in seen:
                raise RequestError(f"input[{i}]: an item with id {own!r} is already in this conversation (previous "
                                   "response or this input); leave the id out or make it unique", f"input[{i}].id")
            seen.add(own)


def input_items(value: Any) -> list[dict[str, Any]]:
    """`input` as a list of items (a string is one user message)."""
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else list(value)


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input`: a string (one user message) or a list of items: messages (role + content: a string
    or input_text / output_text parts), function_call and function_call_output items, and
    reasoning items, whose text becomes the reasoning_content of the assistant turn after them
    (Qwen's template writes it for the turns after the last user message). A function call joins
    the assistant turn before it (its text, earlier calls), as the model wrote them in one turn."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise RequestError("'input' must be a string or a non-empty list of input items", "input")
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise RequestError(f"input[{i}] must be an object", f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning = reasoning_text(item)
            continue
        if kind == "function_call" and reasoning is None and messages and messages[-1]["role"] == "assistant":
            messages[-1].setdefault("tool_calls", []).append(function_call(item))
            continue
        message = item_message(item, kind, i)
        if reasoning is not None and message["role"] == "assistant":
            message["reasoning_content"] = reasoning
        reasoning = None
        messages.append(message)
    return messages


def item_message(item: dict[str, Any], kind: str, index: int) -> dict[str, Any]:
    """A message, function_call or function_call_output item as a chat message."""
    if kind == "message":
        return input_message(item, index)
    if kind == "function_call":
        return {"role": "assistant", "content": "", "tool_calls": [function_call(item)]}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
            raise RequestError(f"input[{index}] (function_call_output) needs string 'call_id' and 'output'", f"input[{index}]")
        return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
    raise RequestError(f"input[{index}]: items of type {kind!r} are not supported (text messages, function_call, "
                       "function_call_output and reasoning are)", f"input[{index}].type")


def function_call(item: dict[str, Any]) -> dict[str, Any]:
    return {"id": item.get("call_id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")}}


def reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its reasoning_text parts (else its summary's text parts)."""
    for key in ("content", "summary"):
        parts = item.get(key)
        texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)] \
            if isinstance(parts, list) else []
        if texts:
            return "".join(texts)
    return ""


REPLAYED = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
            "function_call_output": ("call_id", "output"), "reasoning": ("content", "summary")}


ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
ITEM_STATUSES = ("completed", "incomplete", "in_progress")


def replayed(item: dict[str, Any]) -> dict[str, Any]:
    """An item as a stored conversation keeps it (and GET .../input_items lists it): its id (a new
    one when it has none), the fields input_messages reads, a message's text as a text part, and
    its status."""
    kind = item.get("type", "message")
    own = item.get("id")
    kept = {"id": own if isinstance(own, str) and own else f"{ITEM_ID_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex}",
            "type": kind, **{key: item[key] for key in REPLAYED.get(kind, ()) if key in item}}
    if kind == "message" and isinstance(kept.get("content"), str):
        part = "output_text" if kept.get("role") == "assistant" else "input_text"
        kept["content"] = [{"type": part, "text": kept["content"]}]
    kept["status"] = item["status"] if item.get("status") in ITEM_STATUSES else "completed"
    return kept


def input_message(item: dict[str, Any], index: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise RequestError(f"input[{index}].role must be user, system, developer or assistant", f"input[{index}].role")
    content = item.get("content")
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") in ("input_text", "output_text")]
        if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
            raise RequestError(f"input[{index}].content must be a string or input_text / output_text parts "
                               "(only text is supported)", f"input[{index}].content")
        content = "".join(texts)
    elif not isinstance(content, str):
        raise RequestError(f"input[{index}].content must be a string or a list of text parts", f"input[{index}].content")
    return {"role": "system" if role == "developer" else role, "content": content}


def function_tools(value: Any) -> list[dict[str, Any]]:
    """Responses' flat {"type": "function", "name", "description", "parameters"} -> chat's nested form."""
    if not isinstance(value, list):
        raise RequestError("'tools' must be a list of function tools", "tools")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise RequestError(f"tools[{i}]: only function tools are supported, got {kind!r}", f"tools[{i}]")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        tools.append({"type": "function", "function": function})
    return tools


def named_choice(value: dict[str, Any]) -> dict[str, Any]:
    if value.get("type") != "function" or not isinstance(value.get("name"), str):
        raise RequestError("'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                           "tool_choice")
    return {"type": "function", "function": {"name": value["name"]}}


def text_format(value: Any) -> dict[str, Any]:
    """`text`: {"format": {"type": "text" | "json_object"} or {"type": "json_schema", "name",
    "schema", "strict"}} -> response_format."""
    if not isinstance(value, dict):
        raise RequestError("'text' must be an object, e.g. {\"format\": {\"type\": \"text\"}}", "text")
    form = value.get("format")
    if form is None:
        return {"type": "text"}
    if not isinstance(form, dict):
        raise RequestError("'text.format' must be an object with a 'type'", "text.format")
    if form.get("type") != "json_schema":
        return form
    if "schema" not in form:  # the chat nesting ({"json_schema": {"schema": ...}}) would mean any JSON
        raise RequestError("'text.format.schema' is required: the Responses API puts the schema in the format itself",
                           "text.format.schema")
    return {"type": "json_schema", "json_schema": {key: form[key] for key in ("name", "schema", "strict") if key in form}}


# --- the answer --------------------------------------------------------------------------------
@dataclass
class ResponseMeta:
    """What every response body of one request shares, and its running sequence of events."""

    model: str
    request: dict[str, Any]  # the Responses request, whose settings the response echoes
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    sequence: int = 0
    keep: Callable[[dict[str, Any]], None] | None = None  # given the final response (the store's put)

    @property
    def logprobs(self) -> bool:
        return wants_logprobs(self.request)

    def final(self, status: str, output: list[dict[str, Any]], finished: Finished | None, error: str | None = None,
              code: str = "server_error") -> dict[str, Any]:
        """The finished (or failed, with its error message and code) response's body, handed to `keep` first."""
        body = self.body(status, output, finished)
        if error is not None:
            body["error"] = {"code": code, "message": error}
        if self.keep is not None:
            self.keep(body)
        return body

    def body(self, status: str, output: list[dict[str, Any]], finished: Finished | None = None) -> dict[str, Any]:
        r = self.request
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "model": self.model,
            "output": output, "error": None, "incomplete_details": None, "instructions": r.get("instructions"),
            "max_output_tokens": r.get("max_output_tokens"), "temperature": r.get("temperature"),
            "top_p": r.get("top_p"), "tools": r.get("tools") or [], "tool_choice": r.get("tool_choice", "auto"),
            "parallel_tool_calls": r.get("parallel_tool_calls", True), "text": r.get("text") or {"format": {"type": "text"}},
            "metadata": r.get("metadata") or {}, "store": self.keep is not None, "usage": None,
            "previous_response_id": r.get("previous_response_id"), "background": bool(r.get("background")),
        }
        if finished is not None:
            body["usage"] = usage(finished)
            if finished.finish_reason == "length":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
        return body

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def usage(finished: Finished) -> dict[str, Any]:
    return {"input_tokens": finished.prompt_tokens, "input_tokens_details": {"cached_tokens": finished.cached_tokens},
            "output_tokens": finished.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": finished.prompt_tokens + finished.completion_tokens}


def status_of(finished: Finished) -> str:
    return "incomplete" if finished.finish_reason == "length" else "completed"


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or f"rs_{uuid.uuid4().hex}", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def message_item(text: str, status: str = "completed", item_id: str | None = None,
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    parts = [content_part("message", text, logprobs)] if status != "in_progress" else []
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": parts}


def call_item(call: ToolCall, arguments: str | None = None, status: str = "completed") -> dict[str, Any]:
    text = json.dumps(call.arguments, ensure_ascii=False) if arguments is None else arguments
    return {"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id, "name": call.name,
            "arguments": text, "status": status}


class ContentLogprobs:
    """The logprob entries of the message's tokens: a piece's tokens go with the first answer text
    released by it or, while the shaper holds text back, by a later piece. Tokens that leave the
    text inside the reasoning block (its end and the line breaks after it included), or that end as
    tool calls, carry none: the API gives those items no logprobs."""

    def __init__(self, wanted: bool, shaper: AnswerShaper | None) -> None:
        self.wanted, self.shaper = wanted, shaper
        self.pending: list[ScoredToken] = []

    def take(self, scored: tuple[ScoredToken, ...], released: list[Part]) -> list[dict[str, Any]]:
        """After the shaper took a piece: the entries that go with the first content part of
        `released` ([] when it has none)."""
        if not self.wanted:
            return []
        if self.shaper is not None and self.shaper.in_reasoning:
            self.pending = []
            return []
        self.pending += scored
        if any(kind == "content" for kind, _ in released):
            taken, self.pending = self.pending, []
            return content_logprobs(tuple(taken))
        return []

    def rest(self, calls: bool) -> list[dict[str, Any]]:
        """At the end: the entries no text took (an end token's, a stop string's), unless the
        held text became tool calls."""
        taken, self.pending = self.pending, []
        return [] if calls else content_logprobs(tuple(taken))


def output_items(pieces: list[TextPiece], shaper: AnswerShaper | None, logprobs: bool) -> list[dict[str, Any]]:
    """A whole answer -> its output items, the ones its stream writes: reasoning and the message
    when they have text, calls; the pieces go through the shaper one by one, as a stream's do, so
    each token's entry finds its text."""
    if shaper is None:
        scored = tuple(s for p in pieces for s in p.scored)
        return [message_item("".join(p.text for p in pieces), logprobs=content_logprobs(scored) if logprobs else [])]
    router = ContentLogprobs(logprobs, shaper)
    parts: list[Part] = []
    entries: list[dict[str, Any]] = []
    for piece in pieces:
        released = shaper.push(piece.text)
        entries += router.take(piece.scored, released)
        parts += released
    held, calls = shaper.finish()
    entries += router.take((), held)
    parts += held
    content = "".join(text for kind, text in parts if kind == "content")
    entries += router.rest(bool(calls)) if content else []  # a stream's message is open only with content
    reasoning = "".join(text for kind, text in parts if kind == "reasoning_content")
    items = [reasoning_item(reasoning)] if reasoning else []
    if content or not (reasoning or calls):  # as a stream: an answer with nothing else is one empty message
        items.append(message_item(content, logprobs=entries))
    return items + [call_item(call) for call in calls]


async def whole_response(meta: ResponseMeta, events: AsyncGenerator[Event, None], shaper: AnswerShaper | None) -> dict[str, Any]:
    pieces, finished = await whole_pieces(events)
    return meta.final(status_of(finished), output_items(pieces, shaper, meta.logprobs), finished)


@dataclass
class OpenItem:
    """The reasoning or message item a stream is writing."""

    kind: str  # "reasoning" | "message"
    id: str
    index: int  # output_index
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # the message's entries


class ResponseStream:
    """A generation's text -> the Responses API's events, items opened and closed as the shaper
    moves between the reasoning block and the answer; calls and the final response at the end."""

    def __init__(self, meta: ResponseMeta, shaper: AnswerShaper | None, queued: bool = False) -> None:
        """queued: a background response, queued until the engine takes it (a Started event)."""
        self.meta, self.shaper = meta, shaper
        self.done: list[dict[str, Any]] = []  # output items written
        self.open: OpenItem | None = None
        self.running = not queued
        self.logprobs = ContentLogprobs(meta.logprobs, shaper)

    def start(self) -> list[str]:
        if not self.running:
            queued = self.meta.body("queued", [])
            return [self.meta.event("response.created", response=queued), self.meta.event("response.queued", response=queued)]
        pending = self.meta.body("in_progress", [])
        return [self.meta.event("response.created", response=pending), self.meta.event("response.in_progress", response=pending)]

    def started(self) -> list[str]:
        """The engine took a queued response."""
        self.running = True
        return [self.meta.event("response.in_progress", response=self.meta.body("in_progress", []))]

    def push(self, text: str, scored: tuple[ScoredToken, ...] = ()) -> list[str]:
        return self.parts(self.shaper.push(text) if self.shaper is not None else [("content", text)], scored)

    def parts(self, parts: list[Part], scored: tuple[ScoredToken, ...] = ()) -> list[str]:
        entries = self.logprobs.take(scored, parts)
        lines = []
        for kind, text in parts:
            lines += self.part(kind, text, entries if kind == "content" else [])
            entries = entries if kind != "content" else []
        return lines

    def part(self, kind: str, text: str, logprobs: list[dict[str, Any]]) -> list[str]:
        item = "reasoning" if kind == "reasoning_content" else "message"
        lines = [] if self.open is not None and self.open.kind == item else [*self.close(), *self.begin(item)]
        assert self.open is not None
        self.open.text.append(text)
        self.open.logprobs += logprobs
        event = "response.reasoning_text.delta" if item == "reasoning" else "response.output_text.delta"
        extra = {} if item == "reasoning" else {"logprobs": logprobs}
        lines.append(self.meta.event(event, item_id=self.open.id, output_index=self.open.index, content_index=0,
                                     delta=text, **extra))
        return lines

    def begin(self, kind: str) -> list[str]:
        self.open = OpenItem(kind, f"{'rs' if kind == 'reasoning' else 'msg'}_{uuid.uuid4().hex}", len(self.done))
        item = (reasoning_item if kind == "reasoning" else message_item)("", "in_progress", self.open.id)
        return [self.meta.event("response.output_item.added", output_index=self.open.index, item=item),
                self.meta.event("response.content_part.added", item_id=self.open.id, output_index=self.open.index,
                                content_index=0, part=content_part(kind, ""))]

    def close(self, status: str = "completed") -> list[str]:
        if self.open is None:
            return []
        opened, self.open = self.open, None
        text = "".join(opened.text)
        item = reasoning_item(text, status, opened.id) if opened.kind == "reasoning" else \
            message_item(text, status, opened.id, opened.logprobs)
        done = "response.reasoning_text.done" if opened.kind == "reasoning" else "response.output_text.done"
        where = {"item_id": opened.id, "output_index": opened.index}
        extra = {} if opened.kind == "reasoning" else {"logprobs": opened.logprobs}
        self.done.append(item)
        return [self.meta.event(done, **where, content_index=0, text=text, **extra),
                self.meta.event("response.content_part.done", **where, content_index=0,
                                part=content_part(opened.kind, text, opened.logprobs)),
                self.meta.event("response.output_item.done", output_index=opened.index, item=item)]

    def finish(self, finished: Finished) -> list[str]:
        parts, calls = self.shaper.finish() if self.shaper is not None else ([], [])
        lines = self.parts(parts)
        rest = self.logprobs.rest(bool(calls))
        if rest and self.open is not None and self.open.kind == "message":
            lines += self.part("content", "", rest)
        if not self.done and self.open is None and not calls:
            lines += self.begin("message")  # an empty answer is still one (empty) message
        lines += self.close()
        for call in calls:
            lines += self.call_lines(call)
        status = status_of(finished)
        final = "response.completed" if status == "completed" else "response.incomplete"
        return [*lines, self.meta.event(final, response=self.meta.final(status, self.done, finished))]

    def fail(self, message: str, status: int = 500) -> list[str]:
        """A generation that failed midway: the item being written closes as it stands, and
        response.failed carries the response (status failed, its error: the request's own rules
        leaving nothing to write are OpenAI's invalid_prompt), which is stored as such."""
        lines = self.close("incomplete")
        code = "server_error" if status >= 500 else "invalid_prompt"
        return [*lines, self.meta.event("response.failed", response=self.meta.final("failed", self.done, None, message, code))]

    def so_far(self) -> list[dict[str, Any]]:
        """The output items written so far, the open one in progress with its text so far."""
        if self.open is None:
            return list(self.done)
        text, kind = "".join(self.open.text), self.open.kind
        item = reasoning_item(text, "completed", self.open.id) if kind == "reasoning" else \
            message_item(text, "completed", self.open.id, self.open.logprobs)
        return [*self.done, {**item, "status": "in_progress"}]

    def cancel(self) -> list[str]:
        """A background response cancelled midway: the item being written closes as it stands and the
        response is stored as cancelled (the API has no event for it: a follower's stream just ends)."""
        parts = self.shaper.finish()[0] if self.shaper is not None else []  # text it held back; no calls
        lines = self.parts(parts) + self.close("incomplete")
        self.meta.final("cancelled", self.done, None)
        return lines

    def call_lines(self, call: ToolCall) -> list[str]:
        index, item = len(self.done), call_item(call)
        where = {"item_id": item["id"], "output_index": index}
        self.done.append(item)
        return [self.meta.event("response.output_item.added", output_index=index, item=call_item(call, "", "in_progress")),
                self.meta.event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
                self.meta.event("response.function_call_arguments.done", **where, arguments=item["arguments"]),
                self.meta.event("response.output_item.done", output_index=index, item=item)]


def content_part(kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text} if kind == "reasoning" else \
        {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs or [])}


async def stream_response(stream: ResponseStream, events: AsyncGenerator[Event, None]) -> AsyncGenerator[str, None]:
    for line in stream.start():
        yield line
    async with aclosing(events):
        async for event in events:
            if isinstance(event, TextPiece):
                for line in stream.push(event.text, event.scored):
                    yield line
            elif isinstance(event, Started):
                for line in stream.started():
                    yield line
            elif isinstance(event, Finished):
                for line in stream.finish(event):
                    yield line
                return
            else:
                for line in stream.fail(event.message, event.status):
                    yield line
                return
