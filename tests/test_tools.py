"""Tool calling (atlas.serve --tool-call-parser qwen3_coder): Qwen's XML calls parsed into OpenAI
tool_calls with arguments typed by the tool's schema, streamed content cut anywhere, assistant
tool_calls and tool turns handed to the chat template, and the official openai client reading
both the whole and the streamed answer (canned engine output through the starlette app)."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
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
from atlas.demo import DEMO_DIR, DEMO_NAME  # noqa: E402
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
        self.metrics = Metrics()

    async def events(self, prompt_ids: list[int], opts: Any, stops: tuple[str, ...], echo: str | None = None) -> AsyncIterator[Any]:
        self.prompt = self.llm.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        for piece in ANSWER:
            yield TextPiece(piece)
        yield Finished("stop", len(prompt_ids), len(ANSWER))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, CannedWorker, TestClient]:
    model_dir = tmp_path_factory.mktemp("tools") / "demo"
    shutil.copytree(DEMO_DIR, model_dir, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    (model_dir / "chat_template.jinja").write_text(TOOLS_TEMPLATE, encoding="utf-8")
    llm = LLM(str(model_dir), device="cpu")
    worker = CannedWorker(llm)
    http = TestClient(create_app(ServerState(DEMO_NAME, worker, llm, tool_call_parser="qwen3_coder")))  # type: ignore[arg-type]
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    return client, worker, http


def ask(client: Any, **kw: Any) -> Any:
    messages = kw.pop("messages", [{"role": "user", "content": "Weather in Paris?"}])
    return client.chat.completions.create(model=DEMO_NAME, messages=messages, max_tokens=40, **kw)


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


def test_tool_choice_none_offers_nothing(served: tuple[Any, CannedWorker, TestClient]) -> None:
    client, worker, _ = served
    choice = ask(client, tools=[WEATHER], tool_choice="none").choices[0]
    assert "TOOL" not in worker.prompt
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None and "<tool_call>" in choice.message.content


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": {"get_weather": {}}}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
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
