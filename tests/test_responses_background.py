"""Background responses (POST /v1/responses with background true) through the official openai
client on a real server: answered at once as queued, polled to the chat answer, cancelled midway
(the engine's slot freed), a streamed one resumed after its client left, stopped at shutdown, and
each misuse one 400 / 404."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the openai client is in the test extra: pip install '.[test]'")
pytest.importorskip("uvicorn")

from atlas import LLM  # noqa: E402
from _engine_app import engine_app, serving  # noqa: E402
from atlas.demo import DEMO_NAME  # noqa: E402
from atlas.server.app import ServerState, create_app  # noqa: E402
from atlas.server.metrics import Metrics  # noqa: E402
from atlas.server.background import BackgroundRuns  # noqa: E402
from atlas.server.response_store import ResponseStore, StoredResponse  # noqa: E402
from atlas.server.responses_api import ResponseMeta, ResponseStream  # noqa: E402
from atlas.server.worker import Finished, Started, TextPiece  # noqa: E402

TIMEOUT_S = 60.0
PIECES = ["Now ", "is ", "better ", "than ", "never."]


class GatedWorker:
    """Takes a job once `taking` (sending Started first when the job asks, as the engine worker
    does), then writes PIECES, the i-th only once the test has let out more than i (`allowed`);
    counts the generations started and those closed before their end (a slot freed)."""

    alive = True
    waiting = 0
    lost = None

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.taking = True
        self.allowed = 0
        self.started = 0
        self.closed_early = 0

    async def events(self, prompt_ids: list[int], opts: Any, returns: Any = None) -> AsyncIterator[Any]:
        ended = False
        try:
            while not self.taking:
                await asyncio.sleep(0.005)
            self.started += 1
            if returns is not None and returns.started:
                yield Started()
            for i, piece in enumerate(PIECES):
                while self.allowed <= i:
                    await asyncio.sleep(0.005)
                yield TextPiece(piece)
            ended = True
            yield Finished("stop", len(prompt_ids), len(PIECES))
        finally:
            self.closed_early += not ended


def client_at(port: int) -> Any:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=TIMEOUT_S, max_retries=0)


def until(check: Any, what: str) -> Any:
    deadline = time.monotonic() + TIMEOUT_S
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return found


@pytest.fixture(scope="module")
def demo_llm() -> LLM:
    return LLM(device="cpu", prompt_cache=0)


@pytest.fixture
def gated(demo_llm: LLM) -> Iterator[tuple[Any, GatedWorker, ServerState, int]]:
    worker = GatedWorker()
    state = ServerState(DEMO_NAME, worker, demo_llm)  # type: ignore[arg-type]
    with serving(create_app(state)) as port:
        yield client_at(port), worker, state, port


def test_background_answer_is_the_chat_answer(rng: np.random.Generator) -> None:
    prompt = str(rng.choice(["Beautiful is better", "Flat is", "Simple is better than"]))
    max_tokens = int(rng.integers(5, 40))
    with engine_app() as (app, reference), serving(app) as port:
        client = client_at(port)
        queued = client.responses.create(model=DEMO_NAME, input=prompt, max_output_tokens=max_tokens, temperature=0,
                                         background=True)
        assert (queued.status, queued.background, queued.output) == ("queued", True, [])
        done = until(lambda: (r := client.responses.retrieve(queued.id)).status not in ("queued", "in_progress") and r,
                     "the background response to end")
        want = reference.chat([{"role": "user", "content": prompt}], max_tokens=max_tokens)
        assert done.output_text == want.text and done.background
        assert done.status == ("incomplete" if want.finish_reason == "length" else "completed")
        assert done.usage.output_tokens == len(want.token_ids)
        [item] = client.responses.input_items.list(queued.id).data
        assert item.role == "user" and item.content[0].text == prompt


def test_cancel_stops_the_generation_and_keeps_what_it_wrote(gated: tuple[Any, GatedWorker, ServerState, int]) -> None:
    client, worker, _, _ = gated
    queued = client.responses.create(model=DEMO_NAME, input="hi", background=True)
    written = 2
    worker.allowed = written
    so_far = "".join(PIECES[:written])
    running = until(lambda: (r := client.responses.retrieve(queued.id)).output and r.output[0].content[0].text == so_far
                    and r, "the first pieces")
    assert running.status == "in_progress" and running.output[0].status == "in_progress"
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.background
    [message] = cancelled.output
    assert message.status == "incomplete" and message.content[0].text == so_far
    assert (worker.started, worker.closed_early) == (1, 1), "the engine's generation was not closed"
    assert client.responses.retrieve(queued.id).status == "cancelled"
    assert client.responses.cancel(queued.id).model_dump() == cancelled.model_dump()  # again: as it is


def test_queued_until_the_engine_takes_it(gated: tuple[Any, GatedWorker, ServerState, int]) -> None:
    """Behind other work a background response stays queued (GET, and a stream's response.queued),
    goes in_progress when the engine takes it, and may be cancelled while still queued."""
    client, worker, _, _ = gated
    worker.taking = False
    stream = client.responses.create(model=DEMO_NAME, input="hi", background=True, stream=True)
    events = iter(stream)
    first = [next(events), next(events)]
    assert [e.type for e in first] == ["response.created", "response.queued"] and first[0].response.status == "queued"
    time.sleep(0.1)
    assert client.responses.retrieve(first[0].response.id).status == "queued"
    waiting = client.responses.create(model=DEMO_NAME, input="hi", background=True)
    worker.taking, worker.allowed = True, len(PIECES)
    rest = list(events)
    assert rest[0].type == "response.in_progress" and rest[-1].type == "response.completed"
    worker.taking = False
    queued = client.responses.create(model=DEMO_NAME, input="hi", background=True)
    assert client.responses.retrieve(queued.id).status == "queued"
    assert client.responses.cancel(queued.id).status == "cancelled"
    worker.taking = True
    assert until(lambda: client.responses.retrieve(waiting.id).status == "completed", "the second to end")


def test_a_background_stream_resumes_after_its_client_left(gated: tuple[Any, GatedWorker, ServerState, int]) -> None:
    client, worker, _, _ = gated
    worker.allowed = 1
    stream = client.responses.create(model=DEMO_NAME, input="hi", background=True, stream=True)
    seen = []
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta":
            break
    stream.close()  # the client leaves: the generation goes on
    response_id = seen[0].response.id
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    worker.allowed = len(PIECES)
    resumed = list(client.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number))
    assert [e.sequence_number for e in resumed] == list(range(len(seen), len(seen) + len(resumed)))
    deltas = [e.delta for e in [*seen, *resumed] if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "".join(PIECES) and resumed[-1].type == "response.completed"
    assert worker.closed_early == 0
    whole = list(client.responses.retrieve(response_id, stream=True))  # from the start, after the end
    assert [e.sequence_number for e in whole] == list(range(len(seen) + len(resumed)))
    assert client.responses.retrieve(response_id).output_text == "".join(PIECES)


def test_shutdown_stops_a_running_background_response(demo_llm: LLM) -> None:
    worker = GatedWorker()
    state = ServerState(DEMO_NAME, worker, demo_llm)  # type: ignore[arg-type]
    with serving(create_app(state)) as port:
        queued = client_at(port).responses.create(model=DEMO_NAME, input="hi", background=True)
        until(lambda: worker.started, "the generation to start")
    stored = state.responses.get(queued.id)
    assert stored is not None and stored.body["status"] == "cancelled"
    assert worker.closed_early == 1


def raw_request(port: int, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_misuses_are_one_line_each(gated: tuple[Any, GatedWorker, ServerState, int], demo_llm: LLM) -> None:
    client, worker, _, port = gated
    for body, param in (({"background": True, "store": False}, "background"), ({"background": "yes"}, "background")):
        status, answer = raw_request(port, "POST", "/v1/responses", {"model": DEMO_NAME, "input": "hi", **body})
        assert status == 400 and answer["error"]["param"] == param, answer
    running = client.responses.create(model=DEMO_NAME, input="hi", background=True)
    status, answer = raw_request(port, "POST", "/v1/responses",
                                 {"model": DEMO_NAME, "input": "more", "previous_response_id": running.id})
    assert status == 400 and "still in progress" in answer["error"]["message"], answer
    worker.allowed = len(PIECES)
    plain = client.responses.create(model=DEMO_NAME, input="hi")
    for method, path, code, param in (
        ("POST", f"/v1/responses/{plain.id}/cancel", 400, None),
        ("POST", "/v1/responses/resp_nope/cancel", 404, None),
        ("GET", f"/v1/responses/{plain.id}?stream=true", 400, "stream"),
        ("GET", f"/v1/responses/{running.id}?stream=true&starting_after=x", 400, "starting_after"),
        ("GET", f"/v1/responses/{running.id}?stream=true&starting_after=--1", 400, "starting_after"),
        ("GET", f"/v1/responses/{running.id}?stream=true", 400, "stream"),  # not streamed: no events kept
    ):
        status, answer = raw_request(port, method, path)
        assert (status, answer["error"]["param"]) == (code, param), (path, answer)
        assert "\n" not in answer["error"]["message"]
    storeless = ServerState(DEMO_NAME, GatedWorker(), demo_llm, responses=ResponseStore(0))  # type: ignore[arg-type]
    with serving(create_app(storeless)) as other:
        status, answer = raw_request(other, "POST", "/v1/responses", {"model": DEMO_NAME, "input": "hi", "background": True})
        assert status == 400 and "--response-store 0" in answer["error"]["message"], answer


def test_deleting_a_running_background_response_stops_it(gated: tuple[Any, GatedWorker, ServerState, int]) -> None:
    client, worker, _, port = gated
    queued = client.responses.create(model=DEMO_NAME, input="hi", background=True)
    until(lambda: worker.started, "the generation to start")
    status, answer = raw_request(port, "DELETE", f"/v1/responses/{queued.id}")
    assert (status, answer["deleted"]) == (200, True)
    assert worker.closed_early == 1
    assert raw_request(port, "GET", f"/v1/responses/{queued.id}")[0] == 404
    assert raw_request(port, "GET", f"/v1/responses/{queued.id}?stream=true")[0] == 404  # its events gone too


def test_a_response_stored_again_counts_once_and_becomes_the_newest() -> None:
    """A background response is stored queued, then final: the store's size and order follow the last."""
    store = ResponseStore(capacity=2)
    body = {"id": "a", "output": []}
    store.put("a", StoredResponse({**body, "status": "queued"}, ()))
    store.put("b", StoredResponse({"id": "b", "output": []}, ()))
    final = StoredResponse({**body, "status": "completed", "note": "x" * 100}, ())
    store.put("a", final)
    assert store.stored_bytes == final.size() + store.get("b").size()  # type: ignore[union-attr]
    store.put("c", StoredResponse({"id": "c", "output": []}, ()))
    assert store.get("b") is None and store.get("a") == final  # b was the oldest


def background_stream(worker: GatedWorker, kept: list[dict[str, Any]]) -> tuple[ResponseStream, Any]:
    meta = ResponseMeta(DEMO_NAME, {"input": "hi", "background": True}, keep=kept.append)
    return ResponseStream(meta, None), worker.events([1, 2], None)


def test_a_run_cancelled_before_its_first_step_is_stored_cancelled() -> None:
    async def scenario() -> list[dict[str, Any]]:
        kept: list[dict[str, Any]] = []
        run = BackgroundRuns().start(*background_stream(GatedWorker(), kept), keep_events=True)
        await run.cancel()  # no await before: its task has not run a step
        assert run.finished
        return kept

    [final] = asyncio.run(scenario())
    assert final["status"] == "cancelled" and final["background"]


def test_finished_streams_kept_by_count_and_bytes() -> None:
    async def scenario(capacity: int, max_bytes: int) -> list[bool]:
        runs, worker = BackgroundRuns(capacity, max_bytes), GatedWorker()
        worker.allowed = len(PIECES)
        started = []
        for streamed in (True, True, True, False, True):
            started.append(runs.start(*background_stream(worker, []), keep_events=streamed))
            while not started[-1].finished:
                await asyncio.sleep(0.005)
        runs.start(*background_stream(worker, []), keep_events=True)  # evicts on start
        return [runs.get(run.stream.meta.id) is not None for run in started]

    assert asyncio.run(scenario(2, 1 << 20)) == [False, False, True, False, True]  # the non-streamed one kept nothing
    assert asyncio.run(scenario(8, 1)) == [False, False, False, False, False]  # past max_bytes: all finished go
