"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the official
anthropic client: the answer is the chat answer to the same conversation, whole and streamed as
the API's events; stop sequences, tool_use blocks out and tool_result blocks back in, thinking
blocks under --reasoning-parser, token counting, and every refusal in Anthropic's error shape."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

anthropic = pytest.importorskip("anthropic", reason="the anthropic client is in the test extra: pip install '.[test]'")
pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from atlas import LLM  # noqa: E402
from _demo_copy import demo_copy  # noqa: E402
from _engine_app import engine_app  # noqa: E402
from atlas.demo import DEMO_NAME  # noqa: E402
from atlas.server.app import ServerState, create_app  # noqa: E402
from test_reasoning import THINKING_TEMPLATE  # noqa: E402
from test_reasoning import CannedWorker as ThinkingWorker  # noqa: E402
from test_serve import random_prompt  # noqa: E402
from test_tools import CALL_ARGS, TOOLS_TEMPLATE, WEATHER, CannedWorker  # noqa: E402

TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}  # the Messages API's tool form


def client_over(app: Any) -> tuple[Any, TestClient]:
    http = TestClient(app)
    return anthropic.Anthropic(base_url="http://testserver", api_key="none", http_client=http, max_retries=0), http


@pytest.fixture(scope="module")
def generating() -> Iterator[tuple[Any, TestClient, LLM]]:
    """The app over a real engine (the demo model), its raw HTTP client, and a second model in-process."""
    with engine_app() as (app, reference):
        yield *client_over(app), reference


def ask(client: Any, stream: bool, **request: Any) -> tuple[Any, list[Any]]:
    """(the final message, the stream's events: none when whole)."""
    if not stream:
        return client.messages.create(model=DEMO_NAME, **request), []
    with client.messages.stream(model=DEMO_NAME, **request) as events:
        seen = list(events)
        return events.get_final_message(), seen


@pytest.mark.parametrize("stream", [False, True])
def test_message_is_the_chat_answer(generating: tuple[Any, TestClient, LLM], rng: np.random.Generator, stream: bool) -> None:
    client, _, reference = generating
    prompt, max_tokens = random_prompt(rng), int(rng.integers(1, 40))
    system = "Zen only." if rng.random() < 0.5 else [{"type": "text", "text": "Zen"}, {"type": "text", "text": " only."}]
    message, events = ask(client, stream, system=system, max_tokens=max_tokens, extra_body={"temperature": 0},
                          messages=[{"role": "user", "content": [{"type": "text", "text": prompt}]}])
    chat = [{"role": "system", "content": "Zen only."}, {"role": "user", "content": prompt}]
    want = reference.chat(chat, max_tokens=max_tokens)
    assert [b.type for b in message.content] == (["text"] if want.text else [])
    assert "".join(b.text for b in message.content) == want.text
    assert message.stop_reason == ("max_tokens" if want.finish_reason == "length" else "end_turn")
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(reference.tokenizer.encode_chat(chat))
    assert message.usage.output_tokens == len(want.token_ids) and message.id.startswith("msg_")
    if stream:
        kinds = [e.type for e in events]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
        assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == want.text


def test_stop_sequences(generating: tuple[Any, TestClient, LLM], rng: np.random.Generator) -> None:
    """A stop sequence the answer reaches ends it there: stop_reason stop_sequence, and which."""
    client, _, reference = generating
    for _ in range(20):
        prompt = random_prompt(rng)
        full = reference.chat([{"role": "user", "content": prompt}], max_tokens=40).text
        if len(full.split()) >= 2:
            break
    stop = full.split()[int(rng.integers(1, len(full.split())))]
    message = client.messages.create(model=DEMO_NAME, max_tokens=40, extra_body={"temperature": 0}, stop_sequences=["\x00never", stop],
                                     messages=[{"role": "user", "content": prompt}])
    assert message.content[0].text == full[: full.index(stop)]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)


@pytest.fixture(scope="module")
def canned_tools(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, CannedWorker]:
    llm = LLM(str(demo_copy(tmp_path_factory.mktemp("messages_tools") / "demo", TOOLS_TEMPLATE)), device="cpu")
    worker = CannedWorker(llm)
    client, _ = client_over(create_app(ServerState(DEMO_NAME, worker, llm, tool_call_parser="qwen3_coder")))  # type: ignore[arg-type]
    return client, worker


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_blocks(canned_tools: tuple[Any, CannedWorker], stream: bool) -> None:
    """The canned answer's text, then its call as a tool_use block (input parsed; streamed as an
    input_json_delta), stop_reason tool_use."""
    client, worker = canned_tools
    message, _ = ask(client, stream, max_tokens=40, tools=[TOOL], messages=[{"role": "user", "content": "Weather in Paris?"}],
                     tool_choice={"type": "auto"})
    text, call = message.content
    assert (text.type, text.text) == ("text", "Let me check.\n")
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", CALL_ARGS)
    assert message.stop_reason == "tool_use"


def test_turns_become_the_chat_conversation(canned_tools: tuple[Any, CannedWorker]) -> None:
    """Consecutive turns of one role merge (a blank line apart); a failed tool_result says so, its
    text blocks a line apart; a final assistant turn is a prefill the answer continues."""
    client, worker = canned_tools
    tokenizer = worker.llm.tokenizer
    client.messages.create(model=DEMO_NAME, max_tokens=4, messages=[
        {"role": "user", "content": "Weather"}, {"role": "user", "content": [{"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "network"}]}]},
        {"role": "assistant", "content": "It is"}], tools=[TOOL])
    from atlas.server.tools import template_tool_calls

    calls = [{"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]
    chat = [{"role": "user", "content": "Weather\n\nin Paris?"},
            {"role": "assistant", "content": "", "tool_calls": template_tool_calls(calls, "turn")},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: no\nnetwork"},
            {"role": "assistant", "content": "It is"}]
    want = tokenizer.decode(tokenizer.encode_chat(chat, add_generation_prompt=False, template_kwargs={"tools": [WEATHER]},
                                                  continue_final=True), skip_special_tokens=False)
    assert worker.prompt == want and worker.prompt.endswith("It is")


def test_tool_choice_becomes_the_chat_one() -> None:
    from atlas.server.messages_api import chat_request

    base = {"model": DEMO_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], "tools": [TOOL]}
    for choice, want in (({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
                         ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}})):
        chat = chat_request({**base, "tool_choice": {**choice, "disable_parallel_tool_use": True}})
        assert (chat["tool_choice"], chat["parallel_tool_calls"]) == (want, False)
    assert chat_request({**base, "tool_choice": {"type": "auto"}})["parallel_tool_calls"] is True


def test_tool_results_reach_the_template(canned_tools: tuple[Any, CannedWorker]) -> None:
    """An assistant turn of text + tool_use and a user turn of tool_result blocks render as the chat
    request with that assistant turn and a tool message."""
    client, worker = canned_tools
    turn = [{"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]
    client.messages.create(model=DEMO_NAME, max_tokens=8, tools=[TOOL], messages=[
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": turn},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "sunny"}]}]}])
    from atlas.server.tools import template_tool_calls

    calls = [{"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Let me check.", "tool_calls": template_tool_calls(calls, "turn")},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}]
    assert worker.prompt == worker.llm.tokenizer.apply_chat_template(messages, tools=[WEATHER])


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_blocks(tmp_path: Path, stream: bool) -> None:
    """Under --reasoning-parser qwen3 the reasoning comes back as a thinking block before the text
    (streamed as thinking_delta events); thinking disabled, or left out as Anthropic has it unless
    the server's --chat-template-kwargs say otherwise, renders the template without it."""
    llm = LLM(str(demo_copy(tmp_path / "demo", THINKING_TEMPLATE)), device="cpu")
    client, _ = client_over(create_app(ServerState(DEMO_NAME, ThinkingWorker(), llm, reasoning_parser="qwen3")))  # type: ignore[arg-type]
    message, events = ask(client, stream, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                          thinking={"type": "enabled", "budget_tokens": 1024})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", "plan it"), ("text", "The answer.")]
    if stream:
        assert any(e.type == "content_block_delta" and e.delta.type == "thinking_delta" for e in events)
    recorder = CannedWorker(llm)
    plain, _ = client_over(create_app(ServerState(DEMO_NAME, recorder, llm)))  # type: ignore[arg-type]
    for thinking, opened in (({"type": "disabled"}, False), (None, False), ({"type": "enabled", "budget_tokens": 1024}, True)):
        plain.messages.create(model=DEMO_NAME, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                              **({"thinking": thinking} if thinking else {}))
        assert recorder.prompt.endswith("<think>\n" if opened else "<|im_start|>assistant\n"), thinking
    llm.parts.tokenizer = dataclasses.replace(llm.tokenizer, template_defaults={"enable_thinking": True})
    plain.messages.create(model=DEMO_NAME, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert recorder.prompt.endswith("<think>\n")  # the server's default, not Anthropic's


def test_output_config_json_schema(generating: tuple[Any, TestClient, LLM]) -> None:
    """output_config.format's schema holds the text to a value it admits."""
    jsonschema = pytest.importorskip("jsonschema")
    client, _, _ = generating
    schema = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    closed = 0
    for seed in range(3):
        message = client.messages.create(model=DEMO_NAME, max_tokens=30, messages=[{"role": "user", "content": "Flat is"}],
                                         output_config={"format": {"type": "json_schema", "schema": schema}},
                                         extra_body={"seed": seed, "temperature": 0.8})
        if message.stop_reason == "end_turn":
            jsonschema.validate(json.loads(message.content[0].text), schema)
            closed += 1
    assert closed, "no answer closed its JSON in 30 tokens"


def test_a_failed_stream_ends_with_an_error_event(tmp_path: Path) -> None:
    """A generation that fails midway: the open block closes, then Anthropic's error event (the
    client raises it)."""
    from test_responses_api import FailingWorker

    llm = LLM(str(demo_copy(tmp_path / "demo")), device="cpu")
    client, http = client_over(create_app(ServerState(DEMO_NAME, FailingWorker(llm), llm)))  # type: ignore[arg-type]
    request = {"model": DEMO_NAME, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    lines = http.post("/v1/messages", json=request).text.strip().split("\n\n")
    kinds = [line.split("\n")[0].removeprefix("event: ") for line in lines]
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_stop", "error"]
    error = json.loads(lines[-1].split("\ndata: ")[1])
    assert error["error"]["type"] == "overloaded_error" and "context was lost" in error["error"]["message"]  # a 503
    with pytest.raises(anthropic.APIStatusError):
        list(client.messages.create(**request))


def test_the_anthropic_client_lists_the_model(generating: tuple[Any, TestClient, LLM]) -> None:
    client, _, reference = generating
    [card] = list(client.models.list())
    assert (card.id, card.type, card.display_name) == (DEMO_NAME, "model", DEMO_NAME)
    assert client.models.retrieve(DEMO_NAME).max_input_tokens == reference.parts.spec.context_length


def test_count_tokens(generating: tuple[Any, TestClient, LLM], rng: np.random.Generator) -> None:
    client, _, reference = generating
    prompt = random_prompt(rng)
    counted = client.messages.count_tokens(model=DEMO_NAME, system="Zen only.", messages=[{"role": "user", "content": prompt}])
    chat = [{"role": "system", "content": "Zen only."}, {"role": "user", "content": prompt}]
    assert counted.input_tokens == len(reference.tokenizer.encode_chat(chat))


GOOD = {"model": DEMO_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize(("body", "words"), [
    ({k: v for k, v in GOOD.items() if k != "max_tokens"}, "'max_tokens' is required"),
    ({**GOOD, "messages": []}, "'messages'"),
    ({**GOOD, "messages": [{"role": "system", "content": "x"}]}, "role is user or assistant"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image' block"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]}, "'tool_use' block"),
    ({**GOOD, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "only custom tools"),
    ({**GOOD, "tool_choice": {"type": "sometimes"}}, "'tool_choice'"),
    ({**GOOD, "thinking": {"type": "on"}}, "'thinking'"),
    ({**GOOD, "mcp_servers": [{"url": "x"}]}, "MCP servers"),
    ({**GOOD, "stop_sequences": [""]}, "'stop_sequences' must be a non-empty string or a list"),
    ({**GOOD, "system": [{"type": "image"}]}, "'system'"),
    ({**GOOD, "tools": [{"name": "s", "input_schema": {"type": "string"}}]}, "input_schema must be a JSON schema of type object"),
    ({**GOOD, "tool_choice": {"type": "any"}}, "tool_choice any needs 'tools'"),
    ({**GOOD, "stop_sequences": "END"}, "'stop_sequences' must be a list"),
    ({**GOOD, "messages": [*GOOD["messages"], {"role": "assistant", "content": "Sure "}]}, "must not end with whitespace"),
])
def test_bad_requests(generating: tuple[Any, TestClient, LLM], body: dict[str, Any], words: str) -> None:
    """Each is a 400 in Anthropic's error shape with one line naming the problem; the client raises
    BadRequestError."""
    client, http, _ = generating
    answer = http.post("/v1/messages", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"] and "\n" not in error["error"]["message"]
    if "max_tokens" in body:  # the client itself insists on it
        core = {k: body[k] for k in ("model", "max_tokens", "messages")}
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(**core, extra_body={k: v for k, v in body.items() if k not in core})
    assert http.post("/v1/messages", content=b"{not json").json()["error"]["type"] == "invalid_request_error"


def test_another_model_is_not_found(generating: tuple[Any, TestClient, LLM]) -> None:
    """A 404 not_found_error, as Anthropic's API answers a model it does not have."""
    client, _, _ = generating
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="claude-opus", max_tokens=4, messages=GOOD["messages"])
    assert unknown.value.body["error"]["type"] == "not_found_error"
    assert "'claude-opus' is not served here" in unknown.value.body["error"]["message"]


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/v1/messages", 405), ("POST", "/v1/messages/batches", 404)])
def test_routing_errors_are_in_anthropics_shape(generating: tuple[Any, TestClient, LLM], method: str, path: str,
                                                status: int) -> None:
    _, http, _ = generating
    answer = http.request(method, path, json=GOOD)
    assert answer.status_code == status
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] == {404: "not_found_error", 405: "invalid_request_error"}[status]
    assert path in error["error"]["message"]


def test_vllm_extras_shape_the_text(generating: tuple[Any, TestClient, LLM]) -> None:
    """vLLM's guided_choice on /v1/messages constrains the text, as on chat (was ignored)."""
    client, _, _ = generating
    answer = client.messages.create(model=DEMO_NAME, max_tokens=8, messages=[{"role": "user", "content": "Pick one."}],
                                    extra_body={"guided_choice": ["Simple", "Complex"]})
    assert answer.content[0].text in ("Simple", "Complex"), answer.content
