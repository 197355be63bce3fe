"""Tool calling for chat (`atlas.serve --tool-call-parser qwen3_coder`): the request's `tools` go
to the chat template, and the answer's tool calls come back as OpenAI `tool_calls`.

Qwen3.5 / 3.6 (and Qwen3-Coder) write a call as XML, not JSON (vLLM's qwen3_coder parser):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's text is converted by the type the tool's JSON schema gives it (a string stays text;
numbers, booleans, objects and arrays are read as JSON, and kept as text when they do not parse).
Text before the first <tool_call> is the message content; streamed, it goes out as it comes
(holding back only what may begin the tag) and the calls follow in one delta at the end.

tool_choice "required" or a named function forces a call the way vLLM does: the answer is
generated as JSON under a schema built from the tools (atlas.json_schema), whatever the model's own
call format, and read back into tool_calls (ForcedCallStream)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .errors import RequestError
from ..stop_strings import partial_suffix
from .. import json_text

PARSERS = ("qwen3_coder",)
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
CALL_RE = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
PARAMETER_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
TOOL_CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "auto" (the model decides), "none", "required" (one call or more), "function" (that one)
    name: str | None = None  # mode "function": the function called

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"call_{uuid.uuid4().hex[:24]}")

    def wire(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's tool_calls entry (with `index` in a stream delta)."""
        entry: dict[str, Any] = {"id": self.id, "type": "function",
                                 "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        return entry if index is None else {"index": index, **entry}


# --- request side -------------------------------------------------------------------------------
def parse_tools(value: Any) -> list[dict[str, Any]] | None:
    """`tools`: a list of {"type": "function", "function": {"name", "description"?, "parameters"?}}."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise RequestError("'tools' must be a list of function tools", "tools")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", f"tools[{i}]")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"tools[{i}].function.name must be a non-empty string", f"tools[{i}].function.name")
        if not isinstance(function.get("parameters", {}), dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}].function.parameters")
    return value


def parse_tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """OpenAI's tool_choice: "auto" (the default), "none", "required", or {"type": "function",
    "function": {"name": ...}}; without tools, "none"."""
    if isinstance(value, dict):
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if value.get("type") != "function" or not isinstance(name, str):
            raise RequestError("'tool_choice' must be 'auto', 'none', 'required' or "
                               "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if not any(tool["function"]["name"] == name for tool in tools or []):
            raise RequestError(f"tool_choice names the function {name!r}, which 'tools' does not offer", "tool_choice")
        return ToolChoice("function", name)
    choice = "auto" if value is None else value
    if choice not in TOOL_CHOICES:
        raise RequestError(f"'tool_choice' {choice!r} is not supported; use 'auto', 'none', 'required' "
                           "or a named function", "tool_choice")
    if choice == "required" and not tools:
        raise RequestError("tool_choice 'required' needs 'tools'", "tool_choice")
    return ToolChoice(choice if tools else "none")


def forced_call_schema(tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool = True) -> dict[str, Any]:
    """The JSON a forced call is generated as: a named function's arguments object; for
    "required", a list of {"name", "arguments"} calls of any offered tools (one call when not
    `parallel`: OpenAI's parallel_tool_calls false)."""
    parameters = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}}
                  for t in tools}
    if choice.mode == "function":
        assert choice.name is not None
        return parameters[choice.name]
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"], "properties": {
        "name": {"const": name},
        "arguments": rebase_refs(schema, f"#/items/anyOf/{i}/properties/arguments")}}
        for i, (name, schema) in enumerate(parameters.items())]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": calls}}


def rebase_refs(schema: Any, base: str) -> Any:
    """A copy of `schema` whose "#..." references point into it where it sits at `base`."""
    if isinstance(schema, list):
        return [rebase_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: rebase_refs(value, base) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out


def template_tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls for the chat template: arguments as a mapping (Qwen's
    template iterates them), read from OpenAI's JSON string."""
    if not isinstance(calls, list):
        raise RequestError(f"{param} must be a list", param)
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"{param}[{i}] must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", f"{param}[{i}]")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json_text.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                raise RequestError(f"{param}[{i}].function.arguments is not valid JSON", f"{param}[{i}].function.arguments") from None
        if not isinstance(arguments, dict):
            raise RequestError(f"{param}[{i}].function.arguments must be a JSON object", f"{param}[{i}].function.arguments")
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


# --- answer side --------------------------------------------------------------------------------
def parameter_types(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """tool name -> {parameter name: its JSON schema type}; a schema without usable properties
    leaves its parameters as text."""
    types: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool["function"]
        properties = (function.get("parameters") or {}).get("properties")
        if not isinstance(properties, dict):
            properties = {}
        types[function["name"]] = {k: v.get("type") if isinstance(v, dict) else None for k, v in properties.items()}
    return types


def convert(text: str, kind: Any) -> Any:
    """A parameter's text by its schema type (None or "string": the text itself)."""
    if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
        return text
    try:
        return json_text.loads_finite(text)
    except ValueError:  # not JSON, or JSON no answer can carry (NaN, 1e999, "\ud800"): the text itself
        return text


def parse_calls(text: str, tools: list[dict[str, Any]]) -> list[ToolCall] | None:
    """The calls in `text` (from its first <tool_call> on); None when any block does not parse,
    so the text stays content rather than being half read."""
    types = parameter_types(tools)
    calls = []
    rest = text
    for match in CALL_RE.finditer(text):
        name = match.group(1).strip()
        kinds = types.get(name, {})
        arguments = {p.strip(): convert(strip_newline(v), kinds.get(p.strip())) for p, v in PARAMETER_RE.findall(match.group(2))}
        calls.append(ToolCall(name, arguments))
        rest = rest.replace(match.group(0), "", 1)
    return calls if calls and not rest.strip() else None


def strip_newline(value: str) -> str:
    """The one newline the format puts on each side of a parameter's text."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class ToolCallStream:
    """Content text in, content text out until a <tool_call> begins; then everything is kept for
    finish(), which returns (the content still held back, the calls or [] when they do not parse)."""

    finish_reason = "tool_calls"  # of an answer that made calls

    def __init__(self, tools: list[dict[str, Any]], parallel: bool = True) -> None:
        self.tools = tools
        self.parallel = parallel  # False (parallel_tool_calls false): the first call only
        self.pending = ""
        self.calling = False

    def push(self, text: str) -> str:
        self.pending += text
        if self.calling:
            return ""
        start = self.pending.find(CALL_START)
        if start >= 0:
            self.calling = True
            sent, self.pending = self.pending[:start], self.pending[start:]
            return sent
        keep = partial_suffix(self.pending, CALL_START)
        sent, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        return sent

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self.pending = self.pending, ""
        calls = parse_calls(text, self.tools) if self.calling else None
        return ("", calls if self.parallel else calls[:1]) if calls else (text, [])


class ForcedCallStream:
    """A forced call's JSON (forced_call_schema) in, nothing out as content; finish() reads the
    calls, or returns the text as content when it was cut before its end (max_tokens)."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self.pending = ""
        self.finish_reason = "stop" if choice.mode == "function" else "tool_calls"  # OpenAI's, for each

    def push(self, text: str) -> str:
        self.pending += text
        return ""

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self.pending = self.pending, ""
        try:
            value = json_text.loads_finite(text)
        except ValueError:
            return text, []
        if self.choice.mode == "function":
            assert self.choice.name is not None
            return "", [ToolCall(self.choice.name, value)]
        return "", [ToolCall(call["name"], call["arguments"]) for call in value]
