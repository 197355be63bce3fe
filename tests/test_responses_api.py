"""POST /v1/responses through the official openai client: the answer is the chat answer to the same
conversation (input items, instructions), whole and streamed as the API's typed events; structured
output through text.format; function tools out (function_call items) and back in
(function_call_output items); reasoning items under --reasoning-parser; every bad request one 400
naming the Responses parameter."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the openai client is in the test extra: pip install '.[test]'")
pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from atlas import LLM  # noqa: E402
from _demo_copy import demo_copy  # noqa: E402
from _engine_app import engine_app  # noqa: E402
from atlas.demo import DEMO_NAME  # noqa: E402
from atlas.server.app import ServerState, create_app  # noqa: E402
from atlas.server.worker import Failed, TextPiece  # noqa: E402
from test_reasoning import ANSWER as THINKING_ANSWER  # noqa: E402
from test_reasoning import THINKING_TEMPLATE  # noqa: E402
from test_reasoning import CannedWorker as ThinkingWorker  # noqa: E402
from test_tools import CALL_ARGS, TOOLS_TEMPLATE, WEATHER, CannedWorker  # noqa: E402

FLAT_WEATHER = {"type": "function", **WEATHER["function"]}  # the Responses API's flat tool form


def client_over(app: Any) -> Any:
    http = TestClient(app)
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0), http


@pytest.fixture(scope="module")
def generating() -> Iterator[tuple[Any, Any, LLM]]:
    """The app over a real engine (the demo model), its raw HTTP client, and a second model in-process."""
    with engine_app() as (app, reference):
        yield *client_over(app), reference


def chat_answer(reference: LLM, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, str, int, int]:
    """(text, status, input tokens, output tokens) of the same conversation as a chat, in process."""
    result = reference.chat(messages, max_tokens=max_tokens)
    status = "incomplete" if result.finish_reason == "length" else "completed"
    return result.text, status, len(reference.tokenizer.encode_chat(messages)), len(result.token_ids)


def conversation(rng: np.random.Generator) -> tuple[Any, str | None, list[dict[str, str]]]:
    """A Responses input (a string, or items with text parts and a developer turn), the
    instructions, and the chat messages they stand for."""
    words = ["Beautiful is better", "Flat is", "Simple is better than", "Errors should never"]
    prompt = str(rng.choice(words))
    if rng.random() < 0.5:
        return prompt, None, [{"role": "user", "content": prompt}]
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]}]
    return items, "Zen only.", [{"role": "system", "content": "Zen only."}, {"role": "system", "content": "Be brief."},
                                {"role": "user", "content": prompt}]


def test_response_is_the_chat_answer(generating: tuple[Any, Any, LLM], rng: np.random.Generator) -> None:
    client, _, reference = generating
    for _ in range(3):
        given, instructions, messages = conversation(rng)
        max_tokens = int(rng.integers(1, 60))
        text, status, prompt_tokens, count = chat_answer(reference, messages, max_tokens)
        response = client.responses.create(model=DEMO_NAME, input=given, instructions=instructions,
                                           max_output_tokens=max_tokens, temperature=0)
        assert response.object == "response" and response.id.startswith("resp_")
        assert response.status == status and response.output_text == text
        [item] = response.output
        assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
        assert (response.usage.input_tokens, response.usage.output_tokens) == (prompt_tokens, count)
        assert (response.incomplete_details is not None) == (status == "incomplete")


def test_streamed_response_events(generating: tuple[Any, Any, LLM], rng: np.random.Generator) -> None:
    client, _, reference = generating
    given, instructions, messages = conversation(rng)
    max_tokens = int(rng.integers(1, 60))
    text, status, _, count = chat_answer(reference, messages, max_tokens)
    events = list(client.responses.create(model=DEMO_NAME, input=given, instructions=instructions,
                                          max_output_tokens=max_tokens, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == count
    assert events[-4].text == text  # output_text.done carries the whole text


@pytest.mark.parametrize("stream", [False, True])
def test_previous_response_id_goes_on_from_a_stored_response(generating: tuple[Any, Any, LLM], rng: np.random.Generator,
                                                             stream: bool) -> None:
    """A stored response's input and output come before the next request's input (its
    instructions do not): the answer is the chat answer to the whole conversation. GET finds a
    stored response as it was sent, DELETE forgets it, and store false keeps none."""
    client, _, reference = generating
    given, instructions, messages = conversation(rng)
    if stream:
        events = list(client.responses.create(model=DEMO_NAME, input=given, instructions=instructions,
                                              max_output_tokens=8, temperature=0, stream=True))
        first = events[-1].response
    else:
        first = client.responses.create(model=DEMO_NAME, input=given, instructions=instructions, max_output_tokens=8,
                                        temperature=0)
    assert first.store is True and client.responses.retrieve(first.id).model_dump() == first.model_dump()
    follow = str(rng.choice(["Flat is", "Sparse is", "Readability"]))
    second = client.responses.create(model=DEMO_NAME, input=follow, previous_response_id=first.id,
                                     max_output_tokens=int(rng.integers(1, 30)), temperature=0)
    kept = [m for m in messages if m["role"] != "system" or m["content"] != instructions]  # not the instructions
    whole = [*kept, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": follow}]
    text, status, prompt_tokens, _ = chat_answer(reference, whole, second.max_output_tokens)
    assert (second.output_text, second.status, second.usage.input_tokens) == (text, status, prompt_tokens)
    assert second.previous_response_id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as gone:
        client.responses.create(model=DEMO_NAME, input="x", previous_response_id=first.id, max_output_tokens=2)
    assert gone.value.code == "previous_response_not_found"
    unstored = client.responses.create(model=DEMO_NAME, input="x", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_input_items_list_what_a_response_answered(generating: tuple[Any, Any, LLM], rng: np.random.Generator) -> None:
    """GET /v1/responses/{id}/input_items (the client's input_items.list): a chained response's
    conversation before its output, newest first by default, each item with a stable id; pages of
    `limit` chained by `after` (the client's auto-paging) give the same list; asc is its reverse."""
    client, http, _ = generating
    given, _, _ = conversation(rng)
    first = client.responses.create(model=DEMO_NAME, input=given, max_output_tokens=4, temperature=0)
    follow = str(rng.choice(["Flat is", "Sparse is", "Readability"]))
    second = client.responses.create(model=DEMO_NAME, input=follow, previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    listed = client.responses.input_items.list(second.id, limit=100)
    texts = [(item.type, getattr(item, "role", None), item.content[0].text) for item in listed.data]
    earlier = [("message", m.get("role", "user"), m["content"] if isinstance(m["content"], str) else m["content"][0]["text"])
               for m in ([{"role": "user", "content": given}] if isinstance(given, str) else given)]
    assert texts == [("message", "user", follow), ("message", "assistant", first.output_text), *earlier[::-1]]
    assert [item.id for item in listed.data][1] == first.output[0].id and listed.has_more is False
    paged = list(client.responses.input_items.list(second.id, limit=1))
    assert [item.id for item in paged] == [item.id for item in listed.data]  # ids stay as they were given
    ascending = http.get(f"/v1/responses/{second.id}/input_items", params={"order": "asc", "limit": 2}).json()
    assert [item["id"] for item in ascending["data"]] == [item.id for item in listed.data][::-1][:2]
    assert ascending["has_more"] is (len(listed.data) > 2) and ascending["last_id"] == ascending["data"][-1]["id"]
    newest = listed.data[0].id
    before = http.get(f"/v1/responses/{second.id}/input_items", params={"order": "asc", "before": newest, "limit": 1}).json()
    assert [item["id"] for item in before["data"]] == [listed.data[1].id]  # the nearest before it
    for query, param in (({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"), ({"order": "up"}, "order"),
                         ({"after": "msg_none"}, "after")):
        answer = http.get(f"/v1/responses/{second.id}/input_items", params=query)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param
    assert http.get("/v1/responses/resp_none/input_items").status_code == 404


def test_a_repeated_item_id_is_refused(generating: tuple[Any, Any, LLM]) -> None:
    """An item id already in the conversation (the previous response's output sent again, or twice
    in one input) is a 400 naming the item, before anything runs: ids page input_items."""
    client, _, _ = generating
    first = client.responses.create(model=DEMO_NAME, input="Flat is", max_output_tokens=3, temperature=0)
    again = first.output[0].model_dump(exclude_none=True)
    twice = [{"id": "msg_x", "role": "user", "content": "a"}, {"id": "msg_x", "role": "user", "content": "b"}]
    for request in ({"previous_response_id": first.id, "input": [again, {"role": "user", "content": "Sparse is"}]},
                    {"input": twice}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=DEMO_NAME, max_output_tokens=3, **request)
        assert refused.value.param in ("input[0].id", "input[1].id") and "already in this conversation" in str(refused.value)


def test_the_store_keeps_the_newest(rng: np.random.Generator) -> None:
    from atlas.server.response_store import ResponseStore, StoredResponse

    capacity = int(rng.integers(1, 5))
    store = ResponseStore(capacity)
    for i in range(capacity + 2):
        store.put(f"resp_{i}", StoredResponse({"id": f"resp_{i}"}, ()))
    assert [i for i in range(capacity + 2) if store.get(f"resp_{i}") is not None] == list(range(2, capacity + 2))
    assert store.delete("resp_2") and not store.delete("resp_2") and store.get("resp_2") is None
    big = StoredResponse({"id": "big", "text": "x" * 1000}, ())
    bounded = ResponseStore(capacity=100, max_bytes=3 * big.size())
    for i in range(5):
        bounded.put(f"resp_{i}", big)
    assert [i for i in range(5) if bounded.get(f"resp_{i}") is not None] == [2, 3, 4]  # the bytes bound, not the count


def test_text_format_json_schema(generating: tuple[Any, Any, LLM], rng: np.random.Generator) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    client, _, _ = generating
    schema = {"type": "object", "additionalProperties": False, "required": ["n", "score"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                             "score": {"type": "number", "minimum": 0, "maximum": 1}}}
    closed = 0
    for seed in range(3):
        response = client.responses.create(
            model=DEMO_NAME, input="Flat is", max_output_tokens=40, temperature=0.8, extra_body={"seed": seed},
            text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
        if response.status == "completed":
            jsonschema.validate(json.loads(response.output_text), schema)
            closed += 1
    assert closed, "no answer closed its JSON in 40 tokens"


@pytest.fixture(scope="module")
def canned_tools(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, CannedWorker]:
    llm = LLM(str(demo_copy(tmp_path_factory.mktemp("responses_tools") / "demo", TOOLS_TEMPLATE)), device="cpu")
    worker = CannedWorker(llm)
    client, _ = client_over(create_app(ServerState(DEMO_NAME, worker, llm, tool_call_parser="qwen3_coder")))  # type: ignore[arg-type]
    return client, worker


class FailingWorker(CannedWorker):
    """Writes one piece, then fails as a lost GPU would."""

    async def events(self, prompt_ids: list[int], opts: Any, returns: Any = None) -> Any:
        yield TextPiece("Partly")
        yield Failed("the CUDA context was lost; restart the server", status=503)


def test_a_failed_stream_ends_with_response_failed(tmp_path: Path) -> None:
    """A generation that fails midway: its message item closes incomplete with the text so far,
    response.failed carries the response (status failed, the error), and the store keeps it so."""
    llm = LLM(str(demo_copy(tmp_path / "demo")), device="cpu")
    client, _ = client_over(create_app(ServerState(DEMO_NAME, FailingWorker(llm), llm)))  # type: ignore[arg-type]
    events = list(client.responses.create(model=DEMO_NAME, input="Hi", stream=True))
    assert [e.type for e in events[-2:]] == ["response.output_item.done", "response.failed"]
    assert events[-2].item.status == "incomplete" and events[-2].item.content[0].text == "Partly"
    failed = events[-1].response
    assert failed.status == "failed" and "context was lost" in failed.error.message and failed.output_text == "Partly"
    assert client.responses.retrieve(failed.id).model_dump() == failed.model_dump()


def test_function_calls(canned_tools: tuple[Any, CannedWorker]) -> None:
    """The canned answer's text, then its call, as items; the same streamed."""
    client, worker = canned_tools
    response = client.responses.create(model=DEMO_NAME, input="Weather in Paris?", tools=[FLAT_WEATHER])
    assert "TOOL get_weather" in worker.prompt
    message, call = response.output
    assert message.type == "message" and message.content[0].text == "Let me check.\n"
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == CALL_ARGS
    events = list(client.responses.create(model=DEMO_NAME, input="Weather in Paris?", tools=[FLAT_WEATHER], stream=True))
    [done] = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done) == CALL_ARGS
    assert [i.type for i in events[-1].response.output] == ["message", "function_call"]


def test_function_call_outputs_reach_the_template(canned_tools: tuple[Any, CannedWorker]) -> None:
    client, worker = canned_tools
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_7", "output": "sunny, 21 C"}]
    client.responses.create(model=DEMO_NAME, input=items, tools=[FLAT_WEATHER])
    assert "<parameter=city>Paris</parameter>" in worker.prompt and "<|im_start|>tool\nsunny, 21 C" in worker.prompt


def test_a_tool_round_trip_through_previous_response_id(canned_tools: tuple[Any, CannedWorker]) -> None:
    """A stored answer's text and call come back as the one assistant turn the model wrote, the
    same prompt as the chat request carrying that turn and the call's output."""
    client, worker = canned_tools
    first = client.responses.create(model=DEMO_NAME, input="Weather in Paris?", tools=[FLAT_WEATHER])
    message, call = first.output
    client.responses.create(model=DEMO_NAME, previous_response_id=first.id, tools=[FLAT_WEATHER],
                            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    turn = {"role": "assistant", "content": message.content[0].text, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}
    messages = [{"role": "user", "content": "Weather in Paris?"}, turn,
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    from atlas.server.tools import template_tool_calls

    turn["tool_calls"] = template_tool_calls(turn["tool_calls"], "turn")
    want = worker.llm.tokenizer.apply_chat_template(messages, tools=[WEATHER])
    assert worker.prompt == want


def test_reasoning_items_reach_the_next_assistant_turn() -> None:
    """A reasoning item's text is the reasoning_content of the assistant turn after it (the chat
    path keeps an assistant message's reasoning_content too), and the stored copy of an item is
    what the replay reads and input_items lists (an id, a status), nothing more."""
    from atlas.server.protocol import parse_message
    from atlas.server.responses_api import input_messages, replayed

    items = [{"role": "user", "content": "hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "plan"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "status": "completed"}]
    messages = input_messages(items)
    assert messages[1]["reasoning_content"] == "plan" and messages[1]["content"] == "Hello"
    assert len(messages) == 2 and messages[1]["tool_calls"][0]["id"] == "c1"  # the call joins that turn
    kept = replayed(items[3])
    assert kept == {"id": kept["id"], "type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}",
                    "status": "completed"} and kept["id"].startswith("fc_")
    assert replayed(items[1])["id"] == "rs_1" and replayed(items[0])["content"] == [{"type": "input_text", "text": "hi"}]
    assert input_messages([replayed(i) for i in items]) == messages
    chat = parse_message({"role": "assistant", "content": "Hello", "reasoning_content": "plan"}, 0)
    assert chat["reasoning_content"] == "plan"


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Any:
    llm = LLM(str(demo_copy(tmp_path_factory.mktemp("responses_thinking") / "demo", THINKING_TEMPLATE)), device="cpu")
    client, _ = client_over(create_app(ServerState(DEMO_NAME, ThinkingWorker(), llm, reasoning_parser="qwen3")))  # type: ignore[arg-type]
    return client


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_item(thinking: Any, stream: bool) -> None:
    answer = thinking.responses.create(model=DEMO_NAME, input="hi", stream=stream)
    if stream:
        events = list(answer)
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "plan it"
        answer = events[-1].response
    reasoning, message = answer.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "plan it"
    assert message.type == "message" and answer.output_text == "The answer."


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "previous_response_id": 5}, "previous_response_id"),
    ({"input": "hi", "store": "yes"}, "store"),
    ({"input": "hi", "background": 1}, "background"),
    ({"input": "hi", "background": True, "store": False}, "background"),
    ({"input": []}, "input"),
    ({"input": 3}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "call_id": 7, "output": "x"}]}, "input[0]"),
    ({"input": "hi", "max_output_tokens": "ten"}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 10**9}, "max_output_tokens"),
    ({"input": "hi", "instructions": ["a"]}, "instructions"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "hi", "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}}, "text.format"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "model": "gpt-x"}, "model"),
    ({"input": "hi", "text": 2}, "text"),
    ({"input": "hi", "metadata": "x"}, "metadata"),
    ({"input": "hi", "metadata": {"n": 5}}, "metadata"),
    ({"input": "hi", "metadata": {"note": "\udc80"}}, "metadata.note"),
    ({"input": "hi", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "hi", "top_logprobs": True}, "top_logprobs"),
    # fields that would otherwise be accepted and not applied
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "hi", "include": ["file_search_call.results"]}, "include"),
    ({"input": "hi", "reasoning": {"effort": "max"}}, "reasoning.effort"),
    ({"input": "hi", "reasoning": {"summary": "everything"}}, "reasoning.summary"),
    ({"input": "hi", "reasoning": {"budget": 5}}, "reasoning"),
    ({"input": "hi", "max_tool_calls": -1}, "max_tool_calls"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}}},
     "text.format.schema"),
])
def test_bad_requests(generating: tuple[Any, Any, LLM], body: dict[str, Any], param: str) -> None:
    _, http, _ = generating
    answer = http.post("/v1/responses", content=json.dumps({"model": DEMO_NAME, **body}),  # ASCII: "\udc80" escaped
                       headers={"Content-Type": "application/json"})
    assert answer.status_code in (400, 404), answer.text
    error = answer.json()["error"]
    assert error["param"] == param and "\n" not in error["message"], error
    assert http.post("/v1/responses", content=b"{not json").status_code == 400


@pytest.mark.parametrize("echoed", ['"metadata": {"x": 1e400}', '"text": {"format": {"type": "text"}, "verbosity": -1e999}'])
def test_numbers_past_the_float_range_are_refused_before_they_are_echoed(generating: tuple[Any, Any, LLM],
                                                                         echoed: str) -> None:
    _, http, _ = generating
    raw = '{"model": "%s", "input": "hi", "max_output_tokens": 2, %s}' % (DEMO_NAME, echoed)
    answer = http.post("/v1/responses", content=raw, headers={"Content-Type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "invalid_json"


def test_harmless_values_of_unhonoured_fields_and_effort_none(generating: tuple[Any, Any, LLM]) -> None:
    """Defaults pass; reasoning effort 'none' is the template's enable_thinking false."""
    from atlas.server.responses_api import chat_request

    body = {"model": DEMO_NAME, "input": "hi", "top_logprobs": 0, "truncation": "disabled", "max_tool_calls": 3,
            "include": ["reasoning.encrypted_content"], "reasoning": {"effort": "none"}}
    assert chat_request(body)["chat_template_kwargs"] == {"enable_thinking": False}
    assert "chat_template_kwargs" not in chat_request({**body, "reasoning": None})
    codex = {"effort": "medium", "summary": "auto"}  # what Codex sends for a thinking model
    assert "chat_template_kwargs" not in chat_request({**body, "reasoning": codex})
    assert "chat_template_kwargs" not in chat_request({**body, "reasoning": {"effort": "high", "generate_summary": None}})
    _, http, _ = generating
    answer = http.post("/v1/responses", json={**body, "max_output_tokens": 3})
    assert answer.status_code == 200, answer.text


def test_output_text_logprobs_are_the_chat_answers(generating: tuple[Any, Any, LLM], rng: np.random.Generator) -> None:
    """top_logprobs (or include "message.output_text.logprobs") -> the message's output text carries
    the entries chat completions' logprobs.content gives the same conversation, whole and streamed
    (each delta its own tokens', output_text.done and the final response all of them)."""
    _, http, _ = generating
    given, instructions, messages = conversation(rng)
    top, max_tokens = int(rng.integers(0, 6)), int(rng.integers(1, 30))
    chat = http.post("/v1/chat/completions", json={"model": DEMO_NAME, "messages": messages, "max_tokens": max_tokens,
                                                   "temperature": 0, "logprobs": True, "top_logprobs": top})
    expected = chat.json()["choices"][0]["logprobs"]["content"]
    asked = {"top_logprobs": top} if top else {"include": ["message.output_text.logprobs"]}
    body = {"model": DEMO_NAME, "input": given, "instructions": instructions, "max_output_tokens": max_tokens,
            "temperature": 0, **asked}
    whole = http.post("/v1/responses", json=body).json()
    assert whole["output"][0]["content"][0]["logprobs"] == expected and len(expected) >= 1
    assert all(len(entry["top_logprobs"]) == top for entry in expected)
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as answer:
        events = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [entry for e in deltas for entry in e["logprobs"]] == expected
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == expected
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == expected
    plain = http.post("/v1/responses", json={**body, "top_logprobs": 0, "include": []}).json()
    assert plain["output"][0]["content"][0]["logprobs"] == []


END_TOKEN = "<|im_end|>"


class ScoredThinkingWorker:
    """The thinking answer's pieces, one token each, with a logprob entry per token."""

    alive = True

    async def events(self, prompt_ids: list[int], opts: Any, returns: Any = None) -> Any:
        from atlas.server.worker import Finished, ScoredToken

        for i, piece in enumerate(THINKING_ANSWER):
            yield TextPiece(piece, (ScoredToken(piece, -0.25 * (i + 1), (), i),), (i,), 1)
        yield TextPiece("", (ScoredToken(END_TOKEN, -2.0, (), 99),), (99,), 1)  # the end token: no text
        yield Finished("stop", len(prompt_ids), len(THINKING_ANSWER) + 1)


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_tokens_carry_no_output_logprobs(tmp_path_factory: pytest.TempPathFactory, stream: bool) -> None:
    """Under --reasoning-parser the reasoning block's tokens (its end and the line breaks after it
    too) carry no entries; the answer's do, and so does the end token, whose text is not written."""
    llm = LLM(str(demo_copy(tmp_path_factory.mktemp("responses_scored") / "demo", THINKING_TEMPLATE)), device="cpu")
    state = ServerState(DEMO_NAME, ScoredThinkingWorker(), llm, reasoning_parser="qwen3")  # type: ignore[arg-type]
    http = TestClient(create_app(state))
    body = {"model": DEMO_NAME, "input": "hi", "top_logprobs": 1, "stream": stream}
    if stream:
        with http.stream("POST", "/v1/responses", json=body) as answer:
            events = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: ")]
        streamed = [entry for e in events if e["type"] == "response.output_text.delta" for entry in e["logprobs"]]
        response = events[-1]["response"]
    else:
        response = http.post("/v1/responses", json=body).json()
    reasoning, message = response["output"]
    assert reasoning["content"][0]["text"] == "plan it" and message["content"][0]["text"] == "The answer."
    tokens = [entry["token"] for entry in message["content"][0]["logprobs"]]
    assert tokens == ["The", " answer.", END_TOKEN]
    assert [entry["logprob"] for entry in message["content"][0]["logprobs"]] == [-1.25, -1.5, -2.0]
    if stream:
        assert streamed == message["content"][0]["logprobs"]


class PiecesWorker:
    """Answers with the given pieces, finishing for the given reason."""

    alive = True

    def __init__(self, pieces: list[str], reason: str) -> None:
        self.pieces, self.reason = pieces, reason

    async def events(self, prompt_ids: list[int], opts: Any, returns: Any = None) -> Any:
        from atlas.server.worker import Finished

        for piece in self.pieces:
            yield TextPiece(piece)
        yield Finished(self.reason, len(prompt_ids), len(self.pieces))


@pytest.mark.parametrize(("pieces", "reason"), [
    (["plan", " more"], "length"),  # cut inside the reasoning block: no message
    ([], "stop"),  # nothing at all: one empty message
    (["plan", "</think>", "\n\n"], "stop"),  # a block and no answer
    (THINKING_ANSWER, "stop"),
])
def test_whole_and_streamed_responses_hold_the_same_items(tmp_path_factory: pytest.TempPathFactory,
                                                          pieces: list[str], reason: str) -> None:
    llm = LLM(str(demo_copy(tmp_path_factory.mktemp("responses_items") / "demo", THINKING_TEMPLATE)), device="cpu")
    state = ServerState(DEMO_NAME, PiecesWorker(pieces, reason), llm, reasoning_parser="qwen3")  # type: ignore[arg-type]
    http = TestClient(create_app(state))
    body = {"model": DEMO_NAME, "input": "hi"}
    whole = http.post("/v1/responses", json=body).json()["output"]
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as answer:
        events = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: ")]
    streamed = events[-1]["response"]["output"]
    assert [{k: v for k, v in item.items() if k != "id"} for item in whole] == \
        [{k: v for k, v in item.items() if k != "id"} for item in streamed]
    assert [item["type"] for item in whole] == (["reasoning"] if pieces[:1] == ["plan"] else []) + \
        (["message"] if not pieces or "The" in pieces else [])


def test_vllm_extras_shape_the_text(generating: tuple[Any, Any, LLM]) -> None:
    """vLLM's guided_choice / structured_outputs on /v1/responses constrain the text, as on chat (were ignored)."""
    client, _, _ = generating
    for extra in ({"guided_choice": ["Simple", "Complex"]}, {"structured_outputs": {"choice": ["Simple", "Complex"]}}):
        answer = client.responses.create(model=DEMO_NAME, input="Pick one.", max_output_tokens=8, extra_body=extra)
        assert answer.output_text in ("Simple", "Complex"), answer.output_text
