"""A request's structured output -> one atlas.structured.OutputFormat, compiled here so that a
format generation cannot follow is a 400 before the request queues. Sources, at most one per
request: OpenAI's response_format ({"type": "text" | "json_object" | "json_schema"}), vLLM's
structured_outputs ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}) and its older
guided_json / guided_regex / guided_choice / guided_grammar fields, llama.cpp's grammar (GBNF, as
guided_grammar) and json_schema fields and its response_format {"type": "json_object", "schema":
{...}}, and a forced tool call (tool_choice "required" or a named function,
tools.forced_call_schema)."""

from __future__ import annotations

from typing import Any

from ..errors import AtlasError
from ..structured import OutputFormat
from .errors import RequestError
from .tools import ToolChoice, forced_call_schema
from .. import json_text

GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",  # vLLM's older fields
          "guided_grammar": "grammar", "grammar": "grammar", "json_schema": "json_schema"}  # the last two: llama.cpp's
# vLLM's request extras that shape the generated text only, not the answer's layout: the Responses
# and Messages routes hand them to the chat request they build (as vLLM takes them on every route)
GENERATION_EXTRAS = ("structured_outputs", *GUIDED, "allowed_token_ids", "bad_words", "ignore_eos", "stop_token_ids",
                     "min_tokens", "skip_special_tokens", "include_stop_str_in_output")
STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
              "json_object": "json_object"}


def parse_output_format(body: dict[str, Any], tools: list[dict[str, Any]] | None, choice: ToolChoice) -> OutputFormat | None:
    """The request's one output format, compiled (None: plain text)."""
    given = [*response_format(body), *vllm_formats(body)]
    parallel = True if body.get("parallel_tool_calls") is None else body["parallel_tool_calls"]  # null: the default
    if not isinstance(parallel, bool):
        raise RequestError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if choice.forced:
        assert tools
        given.append(("tools", OutputFormat("json_schema", forced_call_schema(tools, choice, parallel))))
    if len(given) > 1:
        first, second = (name if name != "tools" else "tool_choice" for name, _ in given[:2])
        raise RequestError(f"'{first}' and '{second}' each set the output format; give one", first)
    if not given:
        return None
    param, output = given[0]
    try:
        output.shape()
    except AtlasError as err:
        reason = f"a forced call follows the tools' parameters, but {err}" if param == "tools" else str(err)
        raise RequestError(reason, param) from None
    if body.get("ignore_eos") is True and not body.get("stop_token_ids"):
        raise RequestError("structured output ends with an end-of-sequence token; leave ignore_eos out", "ignore_eos")
    return output


def response_format(body: dict[str, Any]) -> list[tuple[str, OutputFormat]]:
    """OpenAI's response_format: {"type": "text"} (the default), {"type": "json_object"} (JSON mode)
    or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    value = body.get("response_format")
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return []
    if kind == "json_object":  # llama.cpp's form may carry a schema
        schema = value.get("schema")
        made = OutputFormat("json_object") if schema is None else OutputFormat("json_schema", schema)
        return [("response_format", made)]
    if kind != "json_schema":
        raise RequestError("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                           "{\"type\": \"json_schema\", \"json_schema\": {...}}", "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}',
                           "response_format")
    for key, kind_ in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kind_):
            raise RequestError(f"response_format json_schema's '{key}' must be a {kind_.__name__}", "response_format")
    return [("response_format", OutputFormat("json_schema", spec.get("schema", True)))]


def vllm_formats(body: dict[str, Any]) -> list[tuple[str, OutputFormat]]:
    """vLLM's structured_outputs object and guided_* fields (a JSON schema may come as its text)."""
    found = [(name, output_format(kind, body[name], name)) for name, kind in GUIDED.items() if body.get(name) is not None]
    value = body.get("structured_outputs")
    if value is None:
        return found
    if not isinstance(value, dict):
        raise RequestError("'structured_outputs' must be an object such as {\"json\": {...}}", "structured_outputs")
    unknown = sorted(set(value) - set(STRUCTURED))
    if unknown:
        raise RequestError(f"structured_outputs '{unknown[0]}' is not supported; use json, regex, choice, grammar "
                           "or json_object", "structured_outputs")
    return found + [("structured_outputs", output_format(kind, value[key], "structured_outputs"))
                    for key, kind in STRUCTURED.items() if value.get(key) not in (None, False)]


def output_format(kind: str, spec: Any, param: str) -> OutputFormat:
    if kind == "json_schema" and isinstance(spec, str):
        try:
            spec = json_text.loads(spec)
        except ValueError as err:
            raise RequestError(f"'{param}' is not a JSON schema ({err})", param) from None
    try:
        made = OutputFormat.of(**{kind: spec})
    except AtlasError as err:
        raise RequestError(str(err), param) from None
    if made is None:  # a schema sent as the text "null"
        raise RequestError(f"'{param}' must be a JSON schema, got null", param)
    return made
