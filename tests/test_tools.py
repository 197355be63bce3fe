"""Tool calling (atlas.serve --tool-call-parser qwen3_coder): Qwen's XML calls parsed into OpenAI
tool_calls with arguments typed by the tool's schema, streamed content cut anywhere, assistant
tool_calls and tool turns handed to the chat template, and the official openai client reading
both the whole and the streamed answer (canned engine output through the starlette app)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlas.server.errors import RequestError
from atlas.server.tools import ToolCallStream, parse_calls, template_tool_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                                     "where": {"type": "object"}, "note": {"type": ["string", "null"]}}}}}
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        "<parameter=metric>\ntrue\n</parameter>\n<parameter=where>\n{\"lat\": 48.8}\n</parameter>\n"
        "<parameter=note>\n42\n</parameter>\n</function>\n</tool_call>")
CALL_ARGS = {"city": "Paris", "days": 3, "metric": True, "where": {"lat": 48.8}, "note": "42"}
SECOND = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\nsoon\n</parameter>\n</function>\n</tool_call>"


def test_calls_are_typed_by_the_schema() -> None:
    calls = parse_calls(CALL + "\n" + SECOND, [WEATHER])
    assert calls is not None
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", CALL_ARGS), ("get_weather", {"city": "Rome", "days": "soon"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    wire = calls[0].wire(0)
    assert wire["index"] == 0 and wire["type"] == "function" and json.loads(wire["function"]["arguments"]) == CALL_ARGS


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_false_keeps_the_first_call(parallel: bool) -> None:
    """OpenAI's parallel_tool_calls false (Anthropic's disable_parallel_tool_use) under tool_choice
    auto: the answer's first call only."""
    stream = ToolCallStream([WEATHER], parallel)
    assert stream.push("Sure. " + CALL + "\n" + SECOND) == "Sure. "
    text, calls = stream.finish()
    assert text == "" and [c.arguments.get("city") for c in calls] == (["Paris", "Rome"] if parallel else ["Paris"])


@pytest.mark.parametrize("text", [CALL[:-3], CALL + " trailing words", "<tool_call>\n<function=x>\n</tool_call>"])
def test_a_call_that_does_not_parse_stays_content(text: str) -> None:
    assert parse_calls(text, [WEATHER]) is None
    stream = ToolCallStream([WEATHER])
    sent = stream.push(text)
    tail, calls = stream.finish()
    assert (sent + tail, calls) == (text, [])


def test_streamed_content_cut_anywhere(rng: np.random.Generator) -> None:
    for _ in range(200):
        content = "".join(rng.choice(["Let me check.", "\n", " <", "<tool", "a<b>"], size=int(rng.integers(0, 5))))
        text = content + (CALL if rng.integers(0, 2) else "")
        stream = ToolCallStream([WEATHER])
        cuts = sorted(rng.integers(0, len(text) + 1, size=int(rng.integers(0, 6))).tolist())
        sent = "".join(stream.push(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True))
        tail, calls = stream.finish()
        whole = parse_calls(text[text.find("<tool_call>"):], [WEATHER]) if "<tool_call>" in text else None
        if whole:
            assert sent + tail == text[: text.find("<tool_call>")] and [c.arguments for c in calls] == [c.arguments for c in whole]
        else:
            assert sent + tail == text and calls == []


@pytest.mark.parametrize("written", ["NaN", "-Infinity", "1e999", '"\\ud800"', "1" + "0" * 5000])
def test_arguments_no_json_can_carry_stay_text(written: str) -> None:
    """A number parameter the model wrote as NaN, 1e999 or a lone surrogate escape (which would
    make the answer's JSON invalid, or fail to encode) is kept as the text it wrote."""
    call = f"<tool_call>\n<function=get_weather>\n<parameter=days>\n{written}\n</parameter>\n</function>\n</tool_call>"
    [parsed] = parse_calls(call, [WEATHER]) or []
    assert parsed.arguments == {"days": written}
    json.dumps(parsed.arguments, allow_nan=False).encode("utf-8")


def test_assistant_tool_calls_reach_the_template_as_mappings() -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert template_tool_calls(calls, "m")[0]["function"]["arguments"] == {"city": "Paris"}
    with pytest.raises(RequestError, match="not valid JSON"):
        template_tool_calls([{"function": {"name": "f", "arguments": "{oops"}}], "m")
    with pytest.raises(RequestError, match="JSON object"):
        template_tool_calls([{"function": {"name": "f", "arguments": "[1]"}}], "m")


# --- through the app with the official client -------------------------------------------------------
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from atlas import LLM  # noqa: E402
from _demo_copy import demo_copy  # noqa: E402
from atlas.demo import DEMO_NAME  # noqa: E402
from atlas.server.app import ServerState, create_app  # noqa: E402
from atlas.server.metrics import Metrics  # noqa: E402
from atlas.server.worker import Finished, TextPiece  # noqa: E402

TOOLS_TEMPLATE = (  # ChatML with Qwen's tool rendering, reduced: tools in a system turn, calls as XML
    "{% if tools %}<|im_start|>system\n{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call><function={{ c.function.name }}>"
    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>{{ v }}</parameter>{% endfor %}"
    "</function></tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ANSWER = ["Let me ", "check.\n", "<tool", "_call>\n<function=get_weather>\n", CALL[len("<tool_call>\n<function=get_weather>\n"):]]


class CannedWorker:
    """Answers with ANSWER's pieces; keeps the last prompt it was given."""

    alive = True
    waiting = 0

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.prompt = ""
        self.opts: Any = None
        self.metrics = Metrics()

    def kv_cache_usage(self) -> float:
        return 0.0

    async def events(self, prompt_ids: list[int], opts: Any, returns: Any = None) -> AsyncIterator[Any]:
        self.prompt = self.llm.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        self.opts = opts
        for piece in ANSWER:
            yield TextPiece(piece)
        yield Finished("stop", len(prompt_ids), len(ANSWER))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, CannedWorker, TestClient]:
    llm = LLM(str(demo_copy(tmp_path_factory.mktemp("tools") / "demo", TOOLS_TEMPLATE)), device="cpu")
    worker = CannedWorker(llm)
    http = TestClient(create_app(ServerState(DEMO_NAME, worker, llm, tool_call_parser="qwen3_coder")))  # type: ignore[arg-type]
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    return client, worker, http


def ask(client: Any, **kw: Any) -> Any:
    messages = kw.pop("messages", [{"role": "user", "content": "Weather in Paris?"}])
    return client.chat.completions.create(model=DEMO_NAME, messages=messages, **{"max_tokens": 40, **kw})


def test_tool_calls_whole(served: tuple[Any, CannedWorker, TestClient]) -> None:
    client, worker, _ = served
    choice = ask(client, tools=[WEATHER]).choices[0]
    assert "TOOL get_weather" in worker.prompt
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALL_ARGS


def test_tool_calls_streamed(served: tuple[Any, CannedWorker, TestClient]) -> None:
    client, _, _ = served
    chunks = list(ask(client, tools=[WEATHER], stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me check.\n"
    [call] = [t for d in deltas for t in d.tool_calls or []]
    assert call.index == 0 and call.id.startswith("call_") and json.loads(call.function.arguments) == CALL_ARGS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_turns_reach_the_template(served: tuple[Any, CannedWorker, TestClient]) -> None:
    client, worker, _ = served
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "sunny, 21 C"},
    ]
    ask(client, tools=[WEATHER], messages=messages)
    assert "<parameter=city>Paris</parameter>" in worker.prompt and "<|im_start|>tool\nsunny, 21 C" in worker.prompt


def test_parallel_tool_calls_null_is_the_default(served: tuple[Any, CannedWorker, TestClient]) -> None:
    _, _, http = served
    body = {"model": DEMO_NAME, "messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER], "max_tokens": 4}
    for forced in ("auto", "required"):
        assert http.post("/v1/chat/completions", json={**body, "tool_choice": forced, "parallel_tool_calls": None}).status_code == 200


def test_tool_choice_none_shows_the_tools_but_takes_no_calls(served: tuple[Any, CannedWorker, TestClient]) -> None:
    """As vLLM by default: the template still renders the tools (the model knows of them), the
    answer is not searched for calls, and a server without a tool parser takes such a request."""
    client, worker, _ = served
    choice = ask(client, tools=[WEATHER], tool_choice="none").choices[0]
    assert "TOOL" in worker.prompt and "get_weather" in worker.prompt
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None and "<tool_call>" in choice.message.content
    llm = worker.llm
    plain = TestClient(create_app(ServerState(DEMO_NAME, CannedWorker(llm), llm)))  # type: ignore[arg-type]
    body = {"model": DEMO_NAME, "messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER], "max_tokens": 4}
    assert plain.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).status_code == 200
    assert plain.post("/v1/chat/completions", json=body).status_code == 400  # auto needs the parser


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": {"get_weather": {}}}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),  # nothing to call
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(?=a)"}}}}}], "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
])
def test_bad_tool_requests(served: tuple[Any, CannedWorker, TestClient], body: dict[str, Any], param: str) -> None:
    _, _, http = served
    request = {"model": DEMO_NAME, "messages": [{"role": "user", "content": "hi"}], **body}
    answer = http.post("/v1/chat/completions", json=request)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def test_tools_need_the_parser(tmp_path: Path) -> None:
    llm = LLM(device="cpu")
    http = TestClient(create_app(ServerState(DEMO_NAME, CannedWorker(llm), llm)))  # type: ignore[arg-type]
    answer = http.post("/v1/chat/completions", json={"model": DEMO_NAME, "messages": [{"role": "user", "content": "hi"}],
                                                     "tools": [WEATHER]})
    assert answer.status_code == 400 and "--tool-call-parser" in answer.json()["error"]["message"]


def test_odd_schemas_leave_parameters_as_text() -> None:
    odd = {"type": "function", "function": {"name": "get_weather", "parameters": {"properties": ["city", "days"]}}}
    calls = parse_calls(CALL, [odd])
    assert calls is not None and calls[0].arguments["days"] == "3" and calls[0].arguments["metric"] == "true"


# --- forced calls: tool_choice "required" or a named function, generated as JSON -------------------
BOUNDED = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"], "$defs": {"Days": {
        "type": "integer", "minimum": 1, "maximum": 7}},
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"$ref": "#/$defs/Days"}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
FORCED_TOOLS = [BOUNDED, CLOCK]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def generating(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, LLM]]:
    """The app over a real engine (demo model, tools template), and a second model in-process."""
    from atlas.server.worker import EngineWorker

    model_dir = demo_copy(tmp_path_factory.mktemp("forced") / "demo", TOOLS_TEMPLATE)
    worker = EngineWorker(lambda: LLM(str(model_dir), device="cpu", prompt_cache=0))
    llm = worker.start()
    http = TestClient(create_app(ServerState(DEMO_NAME, worker, llm, tool_call_parser="qwen3_coder")))  # type: ignore[arg-type]
    try:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0), \
            LLM(str(model_dir), device="cpu", prompt_cache=0)
    finally:
        worker.stop()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("choice", "parallel"), [("required", True), ("required", False), (NAMED, True)],
                         ids=["required", "required-one", "named"])
def test_forced_calls(generating: tuple[Any, LLM], rng: np.random.Generator, choice: Any, parallel: bool, stream: bool) -> None:
    """A forced call is the in-process model's answer under the call schema, read back into
    tool_calls whose arguments the tool's parameters admit; finish_reason "tool_calls" for
    required, "stop" for a named function (OpenAI's). parallel_tool_calls false: one call. (The
    demo model never closes a list of calls by itself: with parallel calls it is cut at max_tokens,
    and the text stays content.)"""
    import jsonschema

    from atlas.server.tools import ToolChoice, forced_call_schema

    client, reference = generating
    messages = [{"role": "user", "content": str(rng.choice(["Weather in Paris?", "What time is it?", "Flat is"]))}]
    temperature = float(rng.choice([0.0, 0.9]))
    answer = ask(client, messages=messages, tools=FORCED_TOOLS, tool_choice=choice, stream=stream, max_tokens=80,
                 temperature=temperature, seed=7, parallel_tool_calls=parallel)
    if stream:
        chunks = [c for c in answer if c.choices]
        deltas = [c.choices[0].delta for c in chunks]
        content, finish = "".join(d.content or "" for d in deltas), chunks[-1].choices[0].finish_reason
        calls = [t.function for d in deltas for t in d.tool_calls or []]
    else:
        message, finish = answer.choices[0].message, answer.choices[0].finish_reason
        content, calls = message.content or "", [t.function for t in message.tool_calls or []]
    forced = ToolChoice("required") if choice == "required" else ToolChoice("function", "get_time")
    want = reference.chat(messages, template_kwargs={"tools": FORCED_TOOLS}, max_tokens=80, temperature=temperature,
                          seed=7, json_schema=forced_call_schema(FORCED_TOOLS, forced, parallel))
    try:
        value = json.loads(want.text)
    except ValueError:  # cut before the JSON ended: the text stays content
        assert (content, calls, finish) == (want.text, [], "length")
        return
    expected = [("get_time", value)] if choice == NAMED else [(c["name"], c["arguments"]) for c in value]
    assert parallel or len(expected) == 1
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == expected
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED_TOOLS}
    for name, arguments in expected:
        jsonschema.validate(arguments, schemas[name])
    assert finish == ("stop" if choice == NAMED else "tool_calls")


@pytest.mark.parametrize("opens", [True, False])
def test_json_output_starts_after_the_reasoning_block(tmp_path: Path, opens: bool) -> None:
    """Under --reasoning-parser, a prompt that opens a <think> block makes JSON output (a
    response_format, a forced call) start after "</think>", as vLLM's structured output does."""
    template = TOOLS_TEMPLATE.replace("assistant\n{% endif %}", "assistant\n<think>\n{% endif %}") if opens else TOOLS_TEMPLATE
    llm = LLM(str(demo_copy(tmp_path / "demo", template)), device="cpu")
    worker = CannedWorker(llm)
    http = TestClient(create_app(ServerState(DEMO_NAME, worker, llm, reasoning_parser="qwen3",  # type: ignore[arg-type]
                                             tool_call_parser="qwen3_coder")))
    request = {"model": DEMO_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    for extra in ({"response_format": {"type": "json_object"}}, {"tools": [CLOCK], "tool_choice": "required"}, {}):
        assert http.post("/v1/chat/completions", json={**request, **extra}).status_code == 200
        output = worker.opts.output
        assert (output is not None) == bool(extra)
        assert (output and output.after) == ("</think>" if opens and extra else None)


def test_tokenize_renders_the_tools(served: tuple[Any, CannedWorker, TestClient]) -> None:
    """vLLM's /tokenize with messages and tools: the template describes the tools, as in a chat request."""
    _, worker, http = served
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    plain = http.post("/tokenize", json={"model": DEMO_NAME, "messages": messages}).json()["tokens"]
    with_tools = http.post("/tokenize", json={"model": DEMO_NAME, "messages": messages, "tools": [WEATHER]}).json()["tokens"]
    assert with_tools == worker.llm.tokenizer.encode_chat(messages, True, {"tools": [WEATHER]})
    assert "TOOL get_weather" in worker.llm.tokenizer.decode(with_tools) and len(with_tools) > len(plain)
    for bad in ({"messages": messages, "tools": 5}, {"prompt": "Weather?", "tools": [WEATHER]}):
        answer = http.post("/tokenize", json={"model": DEMO_NAME, **bad})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "tools", answer.text
