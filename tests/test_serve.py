"""The OpenAI-compatible server on the demo model (CPU): a real uvicorn on a free loopback port,
driven by the official openai client and by raw HTTP. Every answer is checked against the
in-process LLM run sequentially; bad requests get 400 bodies and the server keeps answering."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the openai client is in the test extra: pip install '.[test]'")
uvicorn = pytest.importorskip("uvicorn", reason="uvicorn is an atlas dependency: pip install .")

from atlas import LLM  # noqa: E402
from atlas.demo import DEMO_NAME, zen_of_python  # noqa: E402
from atlas.sampling import is_int  # noqa: E402
from atlas.server.app import COMPLETION_MAX_TOKENS, ServerState, create_app  # noqa: E402
from atlas.server.worker import EngineWorker  # noqa: E402
from _engine_app import serving  # noqa: E402

HOST = "127.0.0.1"
TIMEOUT_S = 30.0
STARTUP_S = 120.0  # a subprocess importing atlas and loading the demo on a busy 2-core machine
REPO = Path(__file__).resolve().parent.parent


class CountingEngine:
    """The real engine, counting decode steps and optionally slowed (to catch a stream mid-way)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.decodes = 0
        self.delay_s = 0.0
        self.fail = False  # every decode step raises (an engine fault mid-generation)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.engine, name)
        if not name.startswith("decode"):  # decode, decode_tensor: one step each
            return method

        def step(*args: Any) -> Any:
            self.decodes += 1
            if self.fail:
                raise RuntimeError("injected engine fault")
            if self.delay_s:
                time.sleep(self.delay_s)
            return method(*args)

        return step


@dataclass
class Served:
    port: int
    engine: CountingEngine
    reference: LLM  # a second model in this process: the sequential answers
    llm: LLM  # the served one

    def client(self) -> Any:
        return openai.OpenAI(base_url=f"http://{HOST}:{self.port}/v1", api_key="none", timeout=TIMEOUT_S, max_retries=0)


def load_counting() -> LLM:
    llm = LLM(None, device="cpu")
    engine = CountingEngine(llm.parts.engine)
    return LLM.from_loaded(dataclasses.replace(llm.parts, engine=engine))


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    worker = EngineWorker(load_counting)
    llm = worker.start()
    try:
        with serving(create_app(ServerState(DEMO_NAME, worker, llm)), TIMEOUT_S) as port:
            yield Served(port, llm.parts.engine, LLM(None, device="cpu"), llm)  # type: ignore[arg-type]
    finally:
        worker.stop()


def random_prompt(rng: np.random.Generator) -> str:
    """The first words of a random line of the Zen (what the demo was trained on)."""
    lines = [line for line in zen_of_python().splitlines() if line.strip()]
    words = lines[int(rng.integers(len(lines)))].split()
    return " ".join(words[: int(rng.integers(1, len(words) + 1))])


def expected(served: Served, prompt: str, max_tokens: int, chat: bool = False, **kw: Any) -> tuple[str, str, int]:
    """(text, finish_reason, completion_tokens) of a sequential in-process run."""
    result = served.reference.generate(prompt, max_tokens=max_tokens, chat=chat, **kw)
    stopped = result.token_ids[-1] in served.reference.eos_ids()
    return result.text, "stop" if stopped else "length", len(result.token_ids)


def post(port: int, path: str, body: bytes | str) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection(HOST, port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def get_json(port: int, path: str) -> dict[str, Any]:
    conn = http.client.HTTPConnection(HOST, port, timeout=TIMEOUT_S)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        assert response.status == 200, response.status
        return json.loads(response.read())
    finally:
        conn.close()


def assert_still_serving(served: Served) -> None:
    status, body = post(served.port, "/v1/completions", json.dumps(
        {"model": DEMO_NAME, "prompt": "Beautiful is", "max_tokens": 3, "temperature": 0}
    ))
    assert status == 200, body
    assert body["choices"][0]["text"] == expected(served, "Beautiful is", 3)[0]


# --- happy paths with the official client ------------------------------------------------------
def test_models_and_health(served: Served) -> None:
    assert [m.id for m in served.client().models.list()] == [DEMO_NAME]
    [card] = get_json(served.port, "/v1/models")["data"]
    assert served.client().models.retrieve(DEMO_NAME).model_dump(exclude_unset=True) == card
    with pytest.raises(openai.NotFoundError) as missing:
        served.client().models.retrieve("gpt-4o")
    assert missing.value.body["code"] == "model_not_found" and "'gpt-4o' is not served here" in missing.value.body["message"]
    assert card["max_model_len"] == min(served.llm.parts.engine.max_seq_len, served.llm.parts.spec.context_length)
    health = get_json(served.port, "/health")
    assert health["status"] == "ok" and health["device"].startswith("cpu")
    assert health["speculation"] == served.llm.speculation and health["kv_cache"].startswith("bf16 on layers")


@pytest.mark.parametrize("named", [None, ""], ids=["left out", "empty"])
def test_a_request_naming_no_model_gets_the_served_one(served: Served, rng: np.random.Generator, named: str | None) -> None:
    """vLLM's reading (OpenAI requires the field; curl users leave it out)."""
    prompt, max_tokens = random_prompt(rng), int(rng.integers(1, 20))
    model = {} if named is None else {"model": named}
    text = expected(served, prompt, max_tokens)[0]
    status, completion = post(served.port, "/v1/completions", json.dumps(
        {**model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}))
    assert status == 200 and completion["model"] == DEMO_NAME and completion["choices"][0]["text"] == text
    chat = {**model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    for path in ("/v1/chat/completions", "/v1/messages"):
        status, answer = post(served.port, path, json.dumps(chat))
        assert status == 200 and answer["model"] == DEMO_NAME, (path, answer)
    status, answer = post(served.port, "/v1/responses", json.dumps({**model, "input": prompt, "max_output_tokens": 2}))
    assert status == 200 and answer["model"] == DEMO_NAME, answer
    status, tokens = post(served.port, "/tokenize", json.dumps({**model, "prompt": prompt}))
    assert status == 200 and tokens["tokens"] == served.llm.tokenizer.encode(prompt)
    status, back = post(served.port, "/detokenize", json.dumps({**model, "tokens": tokens["tokens"]}))
    assert status == 200 and back["prompt"] == served.llm.tokenizer.decode(tokens["tokens"])


def test_completion(served: Served, rng: np.random.Generator) -> None:
    prompt, max_tokens = random_prompt(rng), int(rng.integers(1, 200))
    text, finish, count = expected(served, prompt, max_tokens)
    answer = served.client().completions.create(model=DEMO_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
    assert answer.object == "text_completion" and answer.model == DEMO_NAME and answer.id
    assert answer.choices[0].text == text
    assert answer.choices[0].finish_reason == finish
    prompt_tokens = len(served.reference.tokenizer.encode(prompt))
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, count)
    assert answer.usage.total_tokens == prompt_tokens + count


def test_next_chat_turn_resumes_from_the_prompt_cache(served: Served, rng: np.random.Generator) -> None:
    """The second turn of a conversation reports the prompt tokens the prompt cache held: the first
    turn's prompt and answer when the template renders them unchanged (the live state), else the
    first prompt (its end checkpoint) or all but its last CHECKPOINT_TAIL tokens."""
    from atlas.prompt_cache import CHECKPOINT_TAIL

    zen = [line for line in zen_of_python().splitlines() if line.strip()]
    start = int(rng.integers(0, len(zen) - 16))
    messages = [{"role": "user", "content": "\n".join(zen[start : start + 16])}]
    client = served.client()
    first = client.chat.completions.create(model=DEMO_NAME, messages=messages, max_tokens=8, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": random_prompt(rng)}]
    second = client.chat.completions.create(model=DEMO_NAME, messages=messages, max_tokens=8, temperature=0)
    tokenizer = served.reference.tokenizer
    first_ids, second_ids = tokenizer.encode_chat(messages[:1]), tokenizer.encode_chat(messages)
    answer_ids = served.reference.generate(first_ids, max_tokens=8).token_ids
    held = [first_ids + answer_ids[:-1], first_ids, first_ids[:-CHECKPOINT_TAIL]]  # live, end, tail
    assert len(first_ids) >= 128, "the tail checkpoint needs a longer first turn"
    hit = next((len(ids) for ids in held if second_ids[: len(ids)] == ids), 0)
    assert hit >= len(first_ids) - CHECKPOINT_TAIL, "the template re-rendered the first turn too far back"
    assert second.usage.prompt_tokens == len(second_ids)
    assert second.usage.prompt_tokens_details.cached_tokens == hit
    assert second.choices[0].message.content == served.reference.generate(second_ids, max_tokens=8).text


def reference_logprobs(served: Served, prompt_ids: list[int], max_tokens: int, top: int, **kw: Any) -> list[Any]:
    result = served.reference.generate(prompt_ids, max_tokens=max_tokens, logprobs=top, **kw)
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    return result.logprobs


def token_text(served: Served, token: int) -> str:
    return served.reference.tokenizer.decode([token], skip_special_tokens=False)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(served: Served, rng: np.random.Generator, stream: bool) -> None:
    """Each generated token's entry: the reference's log-probability, its text and bytes, and the
    top_logprobs most likely tokens; streamed, the chunks' entries add up to the same list."""
    prompt, top = random_prompt(rng), int(rng.integers(0, 6))
    messages = [{"role": "user", "content": prompt}]
    temperature = float(rng.choice([0.0, 0.8]))
    want = reference_logprobs(served, served.reference.tokenizer.encode_chat(messages), 12, top, temperature=temperature, seed=5)
    answer = served.client().chat.completions.create(
        model=DEMO_NAME, messages=messages, max_tokens=12, temperature=temperature, seed=5, logprobs=True,
        top_logprobs=top, stream=stream,
    )
    chunks = list(answer) if stream else [answer]
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == len(want)
    for entry, expected_entry in zip(entries, want, strict=True):
        assert entry.token == token_text(served, expected_entry.token)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.logprob == pytest.approx(expected_entry.logprob, abs=1e-5)
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
            (token_text(served, t), pytest.approx(lp, abs=1e-5)) for t, lp in expected_entry.top
        ]
        assert entry.logprob <= 0 and all(t.logprob <= 0 for t in entry.top_logprobs)


def test_completion_logprobs(served: Served, rng: np.random.Generator) -> None:
    prompt, top = random_prompt(rng), int(rng.integers(1, 6))
    want = reference_logprobs(served, served.reference.tokenizer.encode(prompt), 10, top)
    answer = served.client().completions.create(model=DEMO_NAME, prompt=prompt, max_tokens=10, temperature=0, logprobs=top)
    logprobs = answer.choices[0].logprobs
    assert logprobs.tokens == [token_text(served, w.token) for w in want]
    assert logprobs.token_logprobs == [pytest.approx(w.logprob, abs=1e-5) for w in want]
    assert [len(t) for t in logprobs.top_logprobs] == [len({token_text(served, i) for i, _ in w.top}) for w in want]
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(want))]
    greedy_first = [max(t.values()) for t in logprobs.top_logprobs]
    assert logprobs.token_logprobs == [pytest.approx(g, abs=1e-6) for g in greedy_first]  # greedy: the top token


def test_penalties_and_min_p(served: Served, rng: np.random.Generator) -> None:
    """OpenAI's presence / frequency penalties and vLLM's repetition_penalty and min_p (extra_body)
    give what the in-process model gives with the same settings."""
    prompt = random_prompt(rng)
    settings = {"presence_penalty": 1.5, "frequency_penalty": float(rng.uniform(-1, 1))}
    extra = {"repetition_penalty": float(rng.uniform(1.0, 3.0)), "min_p": 0.1}
    temperature = float(rng.choice([0.0, 0.7]))
    answer = served.client().completions.create(model=DEMO_NAME, prompt=prompt, max_tokens=20, temperature=temperature,
                                                seed=11, extra_body=extra, **settings)
    want = served.reference.generate(prompt, max_tokens=20, temperature=temperature, seed=11, **settings, **extra)
    assert answer.choices[0].text == want.text


POINT_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "x", "tags", "ok"], "properties": {
    "name": {"type": "string", "maxLength": 6}, "x": {"type": "integer", "minimum": -100, "maximum": 100},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}, "ok": {"type": "boolean"}}}
CHOICES = ["better", "worse", "😀 now"]


def schema_check(schema: dict[str, Any]) -> Callable[[str], None]:
    def check(text: str) -> None:
        import jsonschema

        jsonschema.validate(json.loads(text), schema)

    return check


def choice_check(text: str) -> None:
    assert text in CHOICES


# words in nested parentheses: context-free, checked below without the matcher
PAREN_GRAMMAR = r"""
root ::= item ("," " "? item){0,3} "."   # up to four items
item ::= [a-z]{2,6} | "(" item ")"
"""


def paren_check(text: str) -> None:
    assert text.endswith("."), text
    items = re.split(r", ?", text[:-1])
    assert 1 <= len(items) <= 4, text
    for item in items:
        depth = len(item) - len(item.lstrip("("))
        core = item[depth : len(item) - depth]
        assert item == "(" * depth + core + ")" * depth and re.fullmatch(r"[a-z]{2,6}", core), text


OUTPUT_FORMATS = {  # kind -> (request fields, LLM.chat option, what a stopped answer meets)
    "json_object": ({"response_format": {"type": "json_object"}}, {"json_object": True}, schema_check({"type": "object"})),
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "point", "schema": POINT_SCHEMA, "strict": True}}}, {"json_schema": POINT_SCHEMA}, schema_check(POINT_SCHEMA)),
    "guided_json": ({"extra_body": {"guided_json": json.dumps(POINT_SCHEMA)}}, {"json_schema": POINT_SCHEMA},
                    schema_check(POINT_SCHEMA)),
    "guided_choice": ({"extra_body": {"guided_choice": CHOICES}}, {"choice": CHOICES}, choice_check),
    "structured_outputs_regex": ({"extra_body": {"structured_outputs": {"regex": r"[a-z]{2,6}( [a-z]{2,6}){0,3}\."}}},
                                 {"regex": r"[a-z]{2,6}( [a-z]{2,6}){0,3}\."},
                                 lambda text: re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){0,3}\.", text) or pytest.fail(text)),
    "guided_grammar": ({"extra_body": {"guided_grammar": PAREN_GRAMMAR}}, {"grammar": PAREN_GRAMMAR}, paren_check),
    "llama_cpp_grammar": ({"extra_body": {"grammar": PAREN_GRAMMAR}}, {"grammar": PAREN_GRAMMAR}, paren_check),
    "llama_cpp_json_schema": ({"extra_body": {"json_schema": POINT_SCHEMA}}, {"json_schema": POINT_SCHEMA},
                              schema_check(POINT_SCHEMA)),
    "llama_cpp_json_object_schema": ({"response_format": {"type": "json_object", "schema": POINT_SCHEMA}},
                                     {"json_schema": POINT_SCHEMA}, schema_check(POINT_SCHEMA)),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", sorted(OUTPUT_FORMATS))
def test_structured_output(served: Served, rng: np.random.Generator, stream: bool, kind: str) -> None:
    """OpenAI's response_format and vLLM's guided_* / structured_outputs: the chat answer is the
    in-process model's answer under the same format, and meets it when it ends with "stop"."""
    fields, option, check = OUTPUT_FORMATS[kind]
    messages = [{"role": "user", "content": random_prompt(rng)}]
    temperature = float(rng.choice([0.0, 0.8]))
    answer = served.client().chat.completions.create(model=DEMO_NAME, messages=messages, max_tokens=60, seed=4,
                                                     temperature=temperature, stream=stream, **fields)
    chunks = list(answer) if stream else [answer]
    text = "".join((c.choices[0].delta.content if stream else c.choices[0].message.content) or ""
                   for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    want = served.reference.chat(messages, max_tokens=60, seed=4, temperature=temperature, **option)
    assert (text, finish) == (want.text, want.finish_reason)
    if finish == "stop":
        check(text)


def test_output_formats_compile_off_the_event_loop(served: Served, monkeypatch: pytest.MonkeyPatch,
                                                   rng: np.random.Generator) -> None:
    """A large schema or grammar compiles for up to a second: on the event loop that would stall
    every other stream, so the request's format is compiled in a worker thread."""
    import asyncio

    from atlas.structured import OutputFormat

    on_loop: list[bool] = []
    compile_shape = OutputFormat.shape

    def recording(self: OutputFormat) -> Any:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # no loop runs in this thread
            on_loop.append(False)
        return compile_shape(self)

    monkeypatch.setattr(OutputFormat, "shape", recording)
    fields = OUTPUT_FORMATS[sorted(OUTPUT_FORMATS)[int(rng.integers(len(OUTPUT_FORMATS)))]][0]
    served.client().chat.completions.create(model=DEMO_NAME, messages=[{"role": "user", "content": random_prompt(rng)}],
                                            max_tokens=4, temperature=0, **fields)
    assert on_loop and not any(on_loop), on_loop


def test_json_schema_from_a_pydantic_model(served: Served, rng: np.random.Generator) -> None:
    """The openai client's parse() sends a pydantic model's strict schema (a date field: format
    "date") and reads the answer back into the model."""
    import datetime
    from typing import Literal

    from pydantic import BaseModel, Field

    class Point(BaseModel):
        name: str = Field(max_length=6)
        x: int = Field(ge=-100, le=100)
        tags: list[Literal["a", "b"]] = Field(max_length=3)
        ok: bool
        day: datetime.date

    messages = [{"role": "user", "content": random_prompt(rng)}]
    completion = served.client().chat.completions.parse(model=DEMO_NAME, messages=messages, max_tokens=120,
                                                        temperature=0, response_format=Point)
    point = completion.choices[0].message.parsed
    assert isinstance(point, Point) and -100 <= point.x <= 100 and len(point.name) <= 6
    assert isinstance(point.day, datetime.date)


def test_sampling_defaults_from_the_generation_config(rng: np.random.Generator) -> None:
    """--generation-config auto: fields a request leaves out (or sends as null) take the model's
    recommended values; fields it sends win."""
    from starlette.testclient import TestClient

    defaults = {"temperature": 0.7, "top_k": 3.0, "top_p": 0.9}
    worker = EngineWorker(lambda: LLM(None, device="cpu", prompt_cache=0))
    llm = worker.start()
    try:
        http = TestClient(create_app(ServerState(DEMO_NAME, worker, llm, sampling_defaults=defaults)))
        reference = LLM(None, device="cpu", prompt_cache=0)
        prompt = random_prompt(rng)
        for sent, want in [({"seed": 3}, {"temperature": 0.7, "top_k": 3, "top_p": 0.9, "seed": 3}),
                           ({"seed": 3, "top_k": None}, {"temperature": 0.7, "top_k": 3, "top_p": 0.9, "seed": 3}),
                           ({"temperature": 0}, {}),
                           ({"seed": 5, "top_p": 1.0, "top_k": 0}, {"temperature": 0.7, "seed": 5})]:
            answer = http.post("/v1/completions", json={"model": DEMO_NAME, "prompt": prompt, "max_tokens": 12, **sent})
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == reference.generate(prompt, max_tokens=12, **want).text, sent
    finally:
        worker.stop()


def test_a_full_queue_turns_requests_away(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    """--max-waiting: a generation request finding that many waiting gets a 503 with Retry-After
    (the openai client retries it) and counts as rejected; below the limit it runs."""
    from starlette.testclient import TestClient

    limit = int(rng.integers(1, 100))
    worker = EngineWorker(lambda: LLM(None, device="cpu", prompt_cache=0))
    llm = worker.start()
    try:
        http = TestClient(create_app(ServerState(DEMO_NAME, worker, llm, max_waiting=limit)))
        request = {"model": DEMO_NAME, "prompt": random_prompt(rng), "max_tokens": 4}
        monkeypatch.setattr(EngineWorker, "waiting", property(lambda self: limit))
        for route, body in (("/v1/completions", request), ("/v1/chat/completions", chat_request(request))):
            busy = http.post(route, json=body)
            assert busy.status_code == 503 and busy.headers["Retry-After"] == "1", busy.text
            error = busy.json()["error"]
            assert error["type"] == "server_error" and error["code"] == "server_busy"
            assert f"{limit} requests are waiting (--max-waiting {limit})" in error["message"]
        assert "atlas_requests_rejected_total 2" in http.get("/metrics").text.splitlines()
        monkeypatch.setattr(EngineWorker, "waiting", property(lambda self: limit - 1))
        assert http.post("/v1/completions", json=request).status_code == 200
    finally:
        worker.stop()


def chat_request(completion: dict[str, Any]) -> dict[str, Any]:
    prompt = completion["prompt"]
    return {k: v for k, v in completion.items() if k != "prompt"} | {"messages": [{"role": "user", "content": prompt}]}


def test_logit_bias(served: Served, rng: np.random.Generator) -> None:
    """OpenAI's logit_bias ({"token id": bias}) gives what the in-process model gives with it."""
    prompt = random_prompt(rng)
    plain = served.reference.generate(prompt, max_tokens=10)
    bias = {str(t): -100 for t in set(plain.token_ids)} | {str(int(rng.integers(0, 512))): float(rng.uniform(1, 8))}
    temperature = float(rng.choice([0.0, 0.7]))
    answer = served.client().completions.create(model=DEMO_NAME, prompt=prompt, max_tokens=10, temperature=temperature,
                                                seed=3, logit_bias=bias)
    want = served.reference.generate(prompt, max_tokens=10, temperature=temperature, seed=3,
                                     logit_bias={int(k): v for k, v in bias.items()})
    assert answer.choices[0].text == want.text != plain.text


@pytest.mark.parametrize(("max_tokens", "stream"), [(0, False), (1, False), (3, True)])
def test_echo_scores_the_prompt(served: Served, rng: np.random.Generator, max_tokens: int, stream: bool) -> None:
    """lm-evaluation-harness's loglikelihood request: echo + logprobs (max_tokens 0 or 1): the
    prompt comes back in front, its tokens scored (the first with none) as the model scores them."""
    prompt = random_prompt(rng) + " " + random_prompt(rng)
    prompt_ids = served.reference.tokenizer.encode(prompt)
    want = served.reference.generate(prompt_ids, max_tokens=max_tokens, logprobs=2, prompt_logprobs=2)
    assert want.prompt_logprobs is not None and want.logprobs is not None
    answer = served.client().completions.create(model=DEMO_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                logprobs=2, echo=True, stream=stream)
    choices = [c.choices[0] for c in (answer if stream else [answer])]
    assert "".join(c.text for c in choices) == prompt + want.text
    tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
    values = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs]
    tops = [t for c in choices if c.logprobs for t in c.logprobs.top_logprobs]
    expected = [*want.prompt_logprobs, *want.logprobs]
    assert tokens == [token_text(served, t) for t in prompt_ids + want.token_ids]
    assert values[0] is None and tops[0] is None
    assert values[1:] == [pytest.approx(e.logprob, abs=1e-5) for e in expected[1:]]
    assert [len(t) for t in tops[1:]] == [len({token_text(served, i) for i, _ in e.top}) for e in expected[1:]]


def test_stop_token_ids_and_ignore_eos(served: Served, rng: np.random.Generator) -> None:
    """A stop token id ends the completion on it (its text kept, as vLLM keeps it); ignore_eos runs
    to max_tokens past the model's eos."""
    eos = served.reference.eos_ids()
    for _ in range(20):  # an eos named as a stop id ends as an eos (stop_reason None, as vLLM): not drawn
        prompt = random_prompt(rng)
        full = served.reference.generate(prompt, max_tokens=60)
        if cuts := [i for i, token in enumerate(full.token_ids) if token not in eos]:
            break
    assert cuts, "20 random prompts answered with an eos alone"
    stop_id = full.token_ids[int(rng.choice(cuts))]
    first = full.token_ids.index(stop_id)
    answer = served.client().completions.create(model=DEMO_NAME, prompt=prompt, max_tokens=60, temperature=0,
                                                extra_body={"stop_token_ids": [stop_id]})
    assert answer.usage.completion_tokens == first + 1 and answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].model_dump()["stop_reason"] == stop_id  # vLLM's: which stop token
    assert answer.choices[0].text == served.reference.tokenizer.decode(full.token_ids[: first + 1])
    zen = served.reference.generate("Namespaces are one honking great", max_tokens=60)
    assert zen.token_ids[-1] in served.reference.eos_ids(), "the demo ends its text with eos"
    long = served.client().completions.create(model=DEMO_NAME, prompt="Namespaces are one honking great", max_tokens=60,
                                              temperature=0, extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 60 and long.choices[0].finish_reason == "length"
    assert long.choices[0].model_dump()["stop_reason"] is None
    held = served.client().completions.create(model=DEMO_NAME, prompt="Namespaces are one honking great", max_tokens=60,
                                              temperature=0, extra_body={"min_tokens": 30})
    assert held.usage.completion_tokens >= 30
    beyond = COMPLETION_MAX_TOKENS + int(rng.integers(1, 40))  # no max_tokens: the length stretches to min_tokens
    held = served.client().completions.create(model=DEMO_NAME, prompt="Namespaces are one honking great",
                                              temperature=0, extra_body={"min_tokens": beyond})
    assert held.usage.completion_tokens >= beyond


def test_request_ids_name_the_answers(served: Served, rng: np.random.Generator) -> None:
    """vLLM's: an X-Request-Id header (else the body's request_id) names the answer, streamed too;
    --enable-request-id-headers sends the id back on every response, a new one where the client
    gave none (the same one that names the answer)."""
    from starlette.testclient import TestClient

    chat = {"model": DEMO_NAME, "messages": [{"role": "user", "content": random_prompt(rng)}], "max_tokens": 2}
    given = f"trace-{int(rng.integers(1 << 30))}"
    for extra, headers, want in (({}, {"X-Request-Id": given}, f"chatcmpl-{given}"),
                                 ({"request_id": "mine"}, {}, "chatcmpl-mine"),
                                 ({"request_id": "mine"}, {"X-Request-Id": given}, f"chatcmpl-{given}")):
        answer = served.client().chat.completions.create(**chat, extra_body=extra, extra_headers=headers)
        assert answer.id == want
    stream = served.client().completions.create(model=DEMO_NAME, prompt="Flat is", max_tokens=3, stream=True,
                                                extra_headers={"X-Request-Id": given})
    assert {chunk.id for chunk in stream} == {f"cmpl-{given}"}
    status, refused = post(served.port, "/v1/chat/completions", json.dumps({**chat, "request_id": 5}))
    assert status == 400 and refused["error"]["param"] == "request_id"
    worker = EngineWorker(lambda: LLM(device="cpu", prompt_cache=0))
    llm = worker.start()
    try:
        http = TestClient(create_app(ServerState(DEMO_NAME, worker, llm, request_id_headers=True, api_key="k")))
        answer = http.post("/v1/chat/completions", json=chat, headers={"Authorization": "Bearer k"})
        fresh = answer.headers["x-request-id"]
        assert re.fullmatch("[0-9a-f]{32}", fresh) and answer.json()["id"] == f"chatcmpl-{fresh}"
        for path, status in (("/health", 200), ("/v1/models", 401)):
            response = http.get(path, headers={"X-Request-Id": given})
            assert response.status_code == status and response.headers["x-request-id"] == given
    finally:
        worker.stop()


def test_max_tokens_left_out_is_vllms_default(rng: np.random.Generator) -> None:
    """A chat (and a Responses request) without max_tokens may fill the rest of the context, as
    vLLM's; a completion gets OpenAI's 16 (ignore_eos: the length is the default's alone)."""
    from starlette.testclient import TestClient

    capacity = int(rng.integers(96, 160))
    worker = EngineWorker(lambda: LLM(device="cpu", prompt_cache=0, max_seq_len=capacity))
    llm = worker.start()
    try:
        http = TestClient(create_app(ServerState(DEMO_NAME, worker, llm)))
        messages = [{"role": "user", "content": random_prompt(rng)}]
        room = capacity - len(llm.tokenizer.encode_chat(messages)) + 1  # the last token needs no position
        chat = http.post("/v1/chat/completions", json={"model": DEMO_NAME, "messages": messages, "ignore_eos": True,
                                                       "temperature": 0}).json()
        assert chat["usage"]["completion_tokens"] == room and chat["choices"][0]["finish_reason"] == "length", chat
        answer = http.post("/v1/responses", json={"model": DEMO_NAME, "input": messages, "ignore_eos": True,
                                                  "temperature": 0}).json()
        assert answer["usage"]["output_tokens"] == room and answer["status"] == "incomplete", answer
        text = http.post("/v1/completions", json={"model": DEMO_NAME, "prompt": messages[0]["content"],
                                                  "ignore_eos": True, "temperature": 0}).json()
        assert text["usage"]["completion_tokens"] == COMPLETION_MAX_TOKENS, text
    finally:
        worker.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices(served: Served, rng: np.random.Generator, stream: bool) -> None:
    """n choices one after another: choice i samples with seed + i, each tagged with its index;
    usage counts the prompt once and every choice's tokens."""
    prompt, n, seed = random_prompt(rng), int(rng.integers(2, 5)), int(rng.integers(0, 1000))
    kw: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream else {}
    answer = served.client().chat.completions.create(
        model=DEMO_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0.9, seed=seed, n=n,
        stream=stream, **kw)
    if stream:
        chunks = list(answer)
        texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                 for i in range(n)]
        usage = chunks[-1].usage
    else:
        assert [c.index for c in answer.choices] == list(range(n))
        texts, usage = [c.message.content for c in answer.choices], answer.usage
    chat_want = [served.reference.generate(served.reference.tokenizer.encode_chat([{"role": "user", "content": prompt}]),
                                           max_tokens=12, temperature=0.9, seed=seed + i) for i in range(n)]
    assert texts == [w.text for w in chat_want]
    assert usage.completion_tokens == sum(len(w.token_ids) for w in chat_want)
    assert usage.prompt_tokens == chat_want[0].prompt_tokens


def read_metrics(port: int) -> dict[str, float]:
    """GET /metrics parsed: every sample line "name{labels} value" -> {name{labels}: value}."""
    conn = http.client.HTTPConnection(HOST, port, timeout=TIMEOUT_S)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("Content-Type", "").startswith("text/plain")
        text = response.read().decode()
    finally:
        conn.close()
    samples = [line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")]
    return {name: float(value) for name, value in samples}


def test_metrics_count_requests_and_tokens(served: Served, rng: np.random.Generator) -> None:
    before = read_metrics(served.port)
    usages, reasons = [], []
    for _ in range(2):
        answer = served.client().completions.create(model=DEMO_NAME, prompt=random_prompt(rng),
                                                    max_tokens=int(rng.integers(1, 20)), temperature=0)
        usages.append(answer.usage)
        reasons.append(answer.choices[0].finish_reason)
    after = read_metrics(served.port)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta['atlas_requests_total{outcome="finished"}'] == 2
    assert delta["atlas_prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    assert delta["atlas_generated_tokens_total"] == sum(u.completion_tokens for u in usages)
    assert delta["atlas_cached_tokens_total"] == sum(u.prompt_tokens_details.cached_tokens for u in usages)
    for histogram in ("atlas_queue_seconds", "atlas_time_to_first_token_seconds", "atlas_request_run_seconds"):
        assert delta[f"{histogram}_count"] == 2 and delta[f'{histogram}_bucket{{le="+Inf"}}'] == 2
    assert after["atlas_requests_running"] == 0 and after["atlas_requests_waiting"] == 0
    for counter in ("atlas_spec_verify_passes_total", "atlas_spec_draft_tokens_total", "atlas_spec_accepted_tokens_total"):
        assert delta[counter] == 0  # the demo has no MTP head
    assert_vllm_metrics(delta, after, usages, reasons)


def assert_vllm_metrics(delta: dict[str, float], after: dict[str, float], usages: list[Any], reasons: list[str]) -> None:
    """The same requests under vLLM's names (labelled with the served model): its counters, its
    latencies counted from arrival, a token-time histogram only for answers of 2+ tokens."""
    label = f'model_name="{DEMO_NAME}"'
    for reason in ("stop", "length", "abort", "error"):
        assert delta[f'vllm:request_success_total{{{label},finished_reason="{reason}"}}'] == reasons.count(reason)
    prompt, generated = sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages)
    assert delta[f"vllm:prompt_tokens_total{{{label}}}"] == delta[f"vllm:prefix_cache_queries_total{{{label}}}"] == prompt
    assert delta[f"vllm:generation_tokens_total{{{label}}}"] == generated
    assert delta[f"vllm:prefix_cache_hits_total{{{label}}}"] == sum(u.prompt_tokens_details.cached_tokens for u in usages)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_inference_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert delta[f"vllm:{name}_count{{{label}}}"] == 2 and delta[f'vllm:{name}_bucket{{{label},le="+Inf"}}'] == 2
    assert delta[f"vllm:request_generation_tokens_sum{{{label}}}"] == generated
    multi = sum(u.completion_tokens > 1 for u in usages)
    assert delta[f"vllm:request_time_per_output_token_seconds_count{{{label}}}"] == multi
    ttft, queued = (delta[f"vllm:{name}_sum{{{label}}}"] for name in ("time_to_first_token_seconds", "request_queue_time_seconds"))
    assert ttft == pytest.approx(queued + delta["atlas_time_to_first_token_seconds_sum"])  # from arrival
    assert after[f"vllm:num_requests_running{{{label}}}"] == after[f"vllm:num_requests_waiting{{{label}}}"] == 0


def test_metrics_sum_the_speculation_of_each_request() -> None:
    from atlas.server.metrics import Metrics, RequestRecord, SpecCounts

    metrics = Metrics()
    for counts in (SpecCounts(3, 6, 2), SpecCounts(), SpecCounts(1, 2, 2)):
        metrics.started()
        metrics.record(RequestRecord("finished", spec=counts))
    lines = set(metrics.render(0, "m").splitlines())
    assert {"atlas_spec_verify_passes_total 4", "atlas_spec_draft_tokens_total 8",
            "atlas_spec_accepted_tokens_total 4"} <= lines
    assert {'vllm:spec_decode_num_drafts_total{model_name="m"} 4', 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 8',
            'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 4'} <= lines


def test_vllm_metrics_name_each_ending_and_escape_the_model_name() -> None:
    """A cancelled request is vLLM's "abort", a failed one "error"; the served name is a label
    value escaped as Prometheus' text format wants; every sample line parses."""
    from atlas.server.metrics import Metrics, RequestRecord

    metrics = Metrics()
    for record in (RequestRecord("cancelled", "abort", 5, 0, 2, first_token_s=0.1, run_s=0.3), RequestRecord("failed"),
                   RequestRecord("finished", "stop", 7, 4, 1, first_token_s=0.2, run_s=0.2)):
        metrics.started()
        metrics.record(record)
    text = metrics.render(3, 'my "model"\\x')
    label = 'model_name="my \\"model\\"\\\\x"'
    lines = set(text.splitlines())
    for reason, count in (("stop", 1), ("length", 0), ("abort", 1), ("error", 1)):
        assert f'vllm:request_success_total{{{label},finished_reason="{reason}"}} {count}' in lines
    assert {f"vllm:num_requests_waiting{{{label}}} 3", f"vllm:prompt_tokens_total{{{label}}} 12",
            f"vllm:prefix_cache_hits_total{{{label}}} 4", f"vllm:request_time_per_output_token_seconds_count{{{label}}} 1",
            f"vllm:request_prompt_tokens_count{{{label}}} 2", f"vllm:e2e_request_latency_seconds_count{{{label}}} 3"} <= lines
    sample = re.compile(r'[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-z_]+="([^"\\]|\\.)*",?)+\})? [0-9.e+-]+')
    assert all(sample.fullmatch(line) for line in text.splitlines() if not line.startswith("#")), text


def test_kv_cache_usage_is_the_running_requests_share(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    """vllm:kv_cache_usage_perc: the positions the running request holds over the context's, 0
    when no request runs; generate counts the prompt and each token as it comes."""
    from starlette.testclient import TestClient

    import atlas.server.worker as worker_module
    from atlas.llm import GenerateOptions, context_capacity
    from atlas.server.worker import Finished, Job, TextPiece

    generate = worker_module.generate
    worker = EngineWorker(lambda: LLM(None, device="cpu", prompt_cache=0))
    llm = worker.start()
    capacity = context_capacity(llm.parts.spec, llm.parts.engine)
    held, entered, release = int(rng.integers(1, capacity)), threading.Event(), threading.Event()

    def holding(llm: LLM, job: Job) -> Finished:
        job.held_positions = held
        entered.set()
        release.wait(10)
        return Finished("length", held, 0)

    def usage(http: TestClient) -> float:
        line = next(line for line in http.get("/metrics").text.splitlines() if line.startswith("vllm:kv_cache_usage_perc{"))
        return float(line.rsplit(" ", 1)[1])

    try:
        http = TestClient(create_app(ServerState(DEMO_NAME, worker, llm)))
        assert usage(http) == 0
        monkeypatch.setattr(worker_module, "generate", holding)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(http.post, "/v1/completions", json={"prompt": "Flat", "max_tokens": 1})
            assert entered.wait(10)
            assert usage(http) == pytest.approx(held / capacity)
            release.set()
            assert answer.result(10).status_code == 200
        assert usage(http) == 0
    finally:
        release.set()
        worker.stop()
    prompt_ids = llm.tokenizer.encode(random_prompt(rng))
    seen: list[tuple[int, int]] = []  # (tokens so far, positions held) at each piece

    def emit(event: object) -> None:
        if isinstance(event, TextPiece):
            seen.append((event.tokens + (seen[-1][0] if seen else 0), job.held_positions))

    job = Job(prompt_ids, GenerateOptions(max_tokens=12, ignore_eos=True), emit)
    finished = generate(llm, job)
    # Tokens whose text is empty (a special token skipped) ride with the next piece; after the
    # last piece only the end counts them.
    assert finished.completion_tokens == 12 and job.held_positions == len(prompt_ids) + 12
    assert seen and seen[-1][0] <= 12 and all(held == len(prompt_ids) + count for count, held in seen), seen


def test_batch_of_prompts(served: Served, rng: np.random.Generator) -> None:
    """A completions batch (text and token ids) with n choices each: choice p * n + j answers
    prompt p with seed + that index; usage counts every prompt once."""
    texts = [random_prompt(rng) for _ in range(2)]
    prompts: list[Any] = [texts[0], served.reference.tokenizer.encode(texts[1])]
    n, seed = 2, int(rng.integers(0, 1000))
    answer = served.client().completions.create(model=DEMO_NAME, prompt=prompts, n=n, max_tokens=10, temperature=0.8,
                                                seed=seed)
    assert [c.index for c in answer.choices] == list(range(4))
    want = [served.reference.generate(prompts[i // n], max_tokens=10, temperature=0.8, seed=seed + i) for i in range(4)]
    assert [c.text for c in answer.choices] == [w.text for w in want]
    assert answer.usage.prompt_tokens == want[0].prompt_tokens + want[2].prompt_tokens
    assert answer.usage.completion_tokens == sum(len(w.token_ids) for w in want)


def test_no_logprobs_unless_asked(served: Served) -> None:
    answer = served.client().chat.completions.create(
        model=DEMO_NAME, messages=[{"role": "user", "content": "Flat"}], max_tokens=4, temperature=0)
    assert answer.choices[0].logprobs is None


def test_completion_stream(served: Served, rng: np.random.Generator) -> None:
    prompt, max_tokens = random_prompt(rng), int(rng.integers(1, 200))
    text, finish, count = expected(served, prompt, max_tokens)
    stream = served.client().completions.create(
        model=DEMO_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == count and not chunks[-1].choices
    choices = [c.choices[0] for c in chunks[:-1]]
    assert "".join(c.text for c in choices) == text
    assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + [finish]


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats(served: Served, rng: np.random.Generator, chat: bool) -> None:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far, the
    completion count rising by the tokens each piece holds, to the final usage chunk's."""
    prompt, max_tokens = random_prompt(rng), int(rng.integers(2, 60))
    text, _, count = expected(served, prompt, max_tokens, chat=chat)
    options = {"include_usage": True, "continuous_usage_stats": True}
    client = served.client()
    if chat:
        stream = client.chat.completions.create(model=DEMO_NAME, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True, stream_options=options)
    else:
        stream = client.completions.create(model=DEMO_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options=options)
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == count and counts[-2] == count
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    pieces = [(c.choices[0].delta.content if chat else c.choices[0].text) or "" for c in chunks if c.choices]
    assert "".join(pieces) == text
    plain = list(client.completions.create(model=DEMO_NAME, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1])  # without the flag: the last chunk alone


def test_chat(served: Served, rng: np.random.Generator) -> None:
    prompt, max_tokens = random_prompt(rng), int(rng.integers(1, 200))
    text, finish, count = expected(served, prompt, max_tokens, chat=True)
    answer = served.client().chat.completions.create(
        model=DEMO_NAME, messages=[{"role": "user", "content": prompt}], max_completion_tokens=max_tokens, temperature=0
    )
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == text
    assert answer.choices[0].finish_reason == finish
    chat_ids = served.reference.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(chat_ids), count)


def test_chat_stream(served: Served, rng: np.random.Generator) -> None:
    prompt, max_tokens = random_prompt(rng), int(rng.integers(1, 200))
    text, finish, _ = expected(served, prompt, max_tokens, chat=True)
    stream = served.client().chat.completions.create(
        model=DEMO_NAME, messages=[{"role": "user", "content": [{"type": "text", "text": prompt}]}],
        max_tokens=max_tokens, temperature=0, stream=True,
    )
    chunks = [c.choices[0] for c in stream]
    assert chunks[0].delta.role == "assistant"
    assert "".join(c.delta.content or "" for c in chunks) == text
    assert chunks[-1].finish_reason == finish
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_raw_stream_is_openai_sse(served: Served) -> None:
    conn = http.client.HTTPConnection(HOST, served.port, timeout=TIMEOUT_S)
    body = {"model": DEMO_NAME, "prompt": "Flat is", "max_tokens": 4, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body))
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
    events = response.read().decode().split("\n\n")
    conn.close()
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(served: Served, rng: np.random.Generator, stream: bool) -> None:
    for _ in range(20):  # a prompt near the end of the Zen can finish in one word
        prompt = random_prompt(rng)
        full, _, _ = expected(served, prompt, 40)
        words = full.split()
        if len(words) >= 2:
            break
    stop = words[int(rng.integers(1, len(words)))]  # a word the run reaches (not the first)
    cut = full[: full.index(stop)]
    answer = served.client().completions.create(
        model=DEMO_NAME, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "\x00never"], stream=stream
    )
    chunks = list(answer) if stream else [answer]
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].model_dump()["stop_reason"] == stop  # vLLM's: which stop string


def test_seeded_sampling(served: Served, rng: np.random.Generator) -> None:
    prompt, seed = random_prompt(rng), int(rng.integers(1 << 31))
    text, _, _ = expected(served, prompt, 30, temperature=1.5, top_k=50, top_p=0.95, seed=seed)
    for _ in range(2):
        answer = served.client().completions.create(
            model=DEMO_NAME, prompt=prompt, max_tokens=30, temperature=1.5, top_p=0.95, seed=seed,
            extra_body={"top_k": 50},
        )
        assert answer.choices[0].text == text


def test_token_id_prompt(served: Served, rng: np.random.Generator) -> None:
    prompt = random_prompt(rng)
    ids = served.reference.tokenizer.encode(prompt)
    answer = served.client().completions.create(model=DEMO_NAME, prompt=ids, max_tokens=12, temperature=0)
    assert answer.choices[0].text == expected(served, prompt, 12)[0]


# --- vLLM's prompt and text fields ----------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(served: Served, rng: np.random.Generator, stream: bool) -> None:
    """The stop string stays at the text's end. (A prompt whose greedy text is empty, the model's
    eos first, has no stop string to find: CI drew one, seed 3912564874, and failed on stop "".)"""
    for _ in range(50):
        prompt = random_prompt(rng)
        whole = expected(served, prompt, 40)[0]
        if len(whole) >= 2:
            break
    words = whole.split()[1:]
    stop = str(rng.choice(words)) if words else whole[-2:]  # a word the greedy text holds, or its end
    answer = served.client().completions.create(model=DEMO_NAME, prompt=prompt, max_tokens=40, temperature=0,
                                                stop=[stop], stream=stream, extra_body={"include_stop_str_in_output": True})
    chunks = list(answer) if stream else [answer]
    text = "".join(c.choices[0].text for c in chunks)
    assert text == whole[: whole.index(stop) + len(stop)] and text.endswith(stop)
    assert text == served.reference.generate(prompt, max_tokens=40, stop=stop, include_stop_str_in_output=True).text


@pytest.mark.parametrize("stream", [False, True])
def test_skip_special_tokens(served: Served, rng: np.random.Generator, stream: bool) -> None:
    """logit_bias forces a special token (<|im_start|>): its text is written only with
    skip_special_tokens false; a forced end-of-sequence token ends the text without being written."""
    tokenizer = served.reference.tokenizer
    special = next(t for t, added in tokenizer.backend.get_added_tokens_decoder().items()
                   if added.special and t not in served.reference.eos_ids())
    count = int(rng.integers(1, 5))
    for skip, want in ((False, tokenizer.decode([special], skip_special_tokens=False) * count), (True, "")):
        answer = served.client().completions.create(
            model=DEMO_NAME, prompt=random_prompt(rng), max_tokens=count, temperature=0, stream=stream,
            logit_bias={str(special): 100}, extra_body={"skip_special_tokens": skip})
        chunks = list(answer) if stream else [answer]
        assert "".join(c.choices[0].text for c in chunks) == want
    eos = min(served.reference.eos_ids())
    answer = served.client().completions.create(model=DEMO_NAME, prompt=random_prompt(rng), max_tokens=4,
                                                temperature=0, logit_bias={str(eos): 100},
                                                extra_body={"skip_special_tokens": False})
    assert answer.choices[0].text == "" and answer.choices[0].finish_reason == "stop"
    answer = served.client().completions.create(model=DEMO_NAME, prompt=random_prompt(rng), max_tokens=4,
                                                temperature=0, logit_bias={str(eos): 100}, extra_body={
                                                    "skip_special_tokens": False, "include_stop_str_in_output": True})
    assert answer.choices[0].text == tokenizer.decode([eos], skip_special_tokens=False)  # as vLLM: kept when asked


def test_continue_final_message(served: Served, rng: np.random.Generator) -> None:
    """The answer goes on from a started assistant message: the same tokens as the rendered chat
    cut right after that message's text, run as a completion."""
    words = random_prompt(rng)
    messages = [{"role": "user", "content": "Recite the Zen of Python."}, {"role": "assistant", "content": words}]
    answer = served.client().chat.completions.create(
        model=DEMO_NAME, messages=messages, max_tokens=12, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    tokenizer = served.reference.tokenizer
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    cut = rendered[: rendered.rindex(words) + len(words)]
    assert not rendered.endswith(words)  # the template closes the turn: the cut is what the field changes
    want = served.reference.generate(tokenizer.encode(cut, add_special_tokens=False), max_tokens=12)
    assert answer.choices[0].message.content == want.text
    assert answer.usage.prompt_tokens == len(tokenizer.encode(cut, add_special_tokens=False))


@pytest.mark.parametrize("stream", [False, True])
def test_allowed_token_ids_and_bad_words(served: Served, rng: np.random.Generator, stream: bool) -> None:
    """vLLM's allowed_token_ids: every token one of them; bad_words: the greedy text's own words
    never come back as their tokens; both the in-process model's answer, greedy or sampled."""
    prompt, tokenizer = random_prompt(rng), served.reference.tokenizer
    whole = served.reference.generate(prompt, max_tokens=30)
    allowed = sorted({int(t) for t in rng.choice(whole.token_ids, 3)} | {int(t) for t in rng.integers(3, 400, 3)})
    banned = [w for w in dict.fromkeys(whole.text.split()) if len(w) > 3][:2] or ["better"]
    sampling = {"temperature": float(rng.choice([0.0, 0.9])), "seed": int(rng.integers(1000))}
    for fields in ({"allowed_token_ids": allowed}, {"bad_words": banned}):
        want = served.reference.generate(prompt, max_tokens=30, **sampling, **fields)
        answer = served.client().completions.create(model=DEMO_NAME, prompt=prompt, max_tokens=30, stream=stream,
                                                    logprobs=0, extra_body=fields, **sampling)
        chunks = list(answer) if stream else [answer]
        text = "".join(c.choices[0].text for c in chunks)
        assert text == want.text
        if "allowed_token_ids" in fields:
            assert set(want.token_ids) <= set(allowed)
        else:  # as vLLM: the words' own tokenizations (alone, after a space) never come; others may
            from atlas.token_rules import bad_word_sequences

            ids = want.token_ids
            for seq in bad_word_sequences(banned, lambda text: tokenizer.encode(text, add_special_tokens=False)):
                assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids))), (banned, want.text)


@pytest.mark.parametrize("keep", [1, 3, -1])
def test_truncate_prompt_tokens(served: Served, rng: np.random.Generator, keep: int) -> None:
    """The prompt's last k tokens run (-1: all that fit, here the whole prompt); echo sends back
    what ran."""
    prompt = " ".join(random_prompt(rng) for _ in range(3))
    ids = served.reference.tokenizer.encode(prompt)
    kept = ids if keep == -1 else ids[-keep:]
    answer = served.client().completions.create(model=DEMO_NAME, prompt=prompt, max_tokens=8, temperature=0, echo=True,
                                                extra_body={"truncate_prompt_tokens": keep})
    want = served.reference.generate(kept, max_tokens=8).text
    assert answer.usage.prompt_tokens == len(kept)
    assert answer.choices[0].text == served.reference.tokenizer.decode(kept) + want
    assert served.reference.generate(prompt, max_tokens=8, truncate_prompt_tokens=keep).text == want


# --- bad requests ------------------------------------------------------------------------------
GOOD = {"model": DEMO_NAME, "prompt": "Beautiful", "max_tokens": 4}
BAD_COMPLETIONS: list[tuple[str, Any, str | None]] = [
    ("malformed json", '{"model": "atlas-demo", "prompt": ', None),
    ("not an object", "[1, 2]", None),
    ("missing prompt", {"model": DEMO_NAME}, "prompt"),
    ("prompt wrong type", {**GOOD, "prompt": 42}, "prompt"),
    ("empty prompt", {**GOOD, "prompt": ""}, "prompt"),
    ("batch with an empty prompt", {**GOOD, "prompt": ["Flat is", ""]}, "prompt"),
    ("batch of 17", {**GOOD, "prompt": ["Flat is"] * 17}, "prompt"),
    ("token id outside vocab", {**GOOD, "prompt": [1, 10**6]}, "prompt"),
    ("model not a string", {**GOOD, "model": ["atlas-demo"]}, "model"),
    ("max_tokens string", {**GOOD, "max_tokens": "ten"}, "max_tokens"),
    ("max_tokens bool", {**GOOD, "max_tokens": True}, "max_tokens"),
    ("max_tokens zero", {**GOOD, "max_tokens": 0}, "max_tokens"),
    ("max_tokens beyond context", {**GOOD, "max_tokens": 10**6}, "max_tokens"),
    ("temperature negative", {**GOOD, "temperature": -0.5}, "temperature"),
    ("temperature string", {**GOOD, "temperature": "hot"}, "temperature"),
    ("top_p zero", {**GOOD, "top_p": 0}, "top_p"),
    ("top_k float", {**GOOD, "top_k": 1.5}, "top_k"),
    ("seed string", {**GOOD, "seed": "x"}, "seed"),
    ("seed negative", {**GOOD, "seed": -3, "temperature": 0.7}, "seed"),
    ("stop wrong type", {**GOOD, "stop": 7}, "stop"),
    ("stop empty string", {**GOOD, "stop": [""]}, "stop"),
    ("n above 16", {**GOOD, "n": 17}, "n"),
    ("n zero", {**GOOD, "n": 0}, "n"),
    ("stream not bool", {**GOOD, "stream": "yes"}, "stream"),
    ("logprobs beyond 20", {**GOOD, "logprobs": 21}, "logprobs"),
    ("logprobs as in chat", {**GOOD, "logprobs": True}, "logprobs"),
    ("echo not bool", {**GOOD, "echo": "yes"}, "echo"),
    ("stop_token_ids not a list", {**GOOD, "stop_token_ids": 5}, "stop_token_ids"),
    ("stop_token_ids beyond the vocabulary", {**GOOD, "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("ignore_eos not bool", {**GOOD, "ignore_eos": 1}, "ignore_eos"),
    ("min_tokens negative", {**GOOD, "min_tokens": -1}, "min_tokens"),
    ("min_tokens above max_tokens", {**GOOD, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("min_tokens beyond context", {"model": DEMO_NAME, "prompt": "Beautiful", "min_tokens": 10**6}, "min_tokens"),
    ("json schema with lookaround", {**GOOD, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "^(?!a)"}}}}, "response_format"),
    ("json schema not a schema", {**GOOD, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": [1]}}}, "response_format"),
    ("json_schema missing", {**GOOD, "response_format": {"type": "json_schema"}}, "response_format"),
    ("guided_grammar single-quoted", {**GOOD, "guided_grammar": "root ::= 'a'"}, "guided_grammar"),
    ("grammar left-recursive", {**GOOD, "grammar": 'root ::= root "a" | "b"'}, "grammar"),
    ("grammar not a string", {**GOOD, "grammar": {"root": "a"}}, "grammar"),
    ("grammar nested too deeply", {**GOOD, "grammar": "root ::= " + "(" * 3000 + '"a"' + ")" * 3000}, "grammar"),
    ("guided_regex nested too deeply", {**GOOD, "guided_regex": "(" * 3000 + "a" + ")" * 3000}, "guided_regex"),
    ("guided_regex with lookaround", {**GOOD, "guided_regex": "(?=a)"}, "guided_regex"),
    ("guided_choice empty", {**GOOD, "guided_choice": []}, "guided_choice"),
    ("guided_json not JSON", {**GOOD, "guided_json": "{oops"}, "guided_json"),
    ("guided_json the text null", {**GOOD, "guided_json": "null"}, "guided_json"),
    ("json_schema the text null", {**GOOD, "json_schema": "null"}, "json_schema"),
    ("structured_outputs grammar undefined rule", {**GOOD, "structured_outputs": {"grammar": "root ::= a"}},
     "structured_outputs"),
    ("structured_outputs not an object", {**GOOD, "structured_outputs": "json"}, "structured_outputs"),
    ("two output formats", {**GOOD, "response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
    ("json schema name not a string", {**GOOD, "response_format": {"type": "json_schema", "json_schema": {
        "name": 5, "schema": {}}}}, "response_format"),
    ("response_format unknown", {**GOOD, "response_format": {"type": "xml"}}, "response_format"),
    ("response_format not an object", {**GOOD, "response_format": "json"}, "response_format"),
    ("json mode with ignore_eos", {**GOOD, "response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ("logit_bias not an object", {**GOOD, "logit_bias": [1, 2]}, "logit_bias"),
    ("logit_bias key not an id", {**GOOD, "logit_bias": {"hello": 1}}, "logit_bias"),
    ("logit_bias beyond 100", {**GOOD, "logit_bias": {"5": 150}}, "logit_bias"),
    ("logit_bias string value", {**GOOD, "logit_bias": {"5": "1"}}, "logit_bias"),
    ("logit_bias beyond the vocabulary", {**GOOD, "logit_bias": {"1000000": 1}}, "logit_bias"),
    ("audio out", {**GOOD, "modalities": ["text", "audio"]}, "modalities"),
    ("presence_penalty beyond 2", {**GOOD, "presence_penalty": 2.5}, "presence_penalty"),
    ("frequency_penalty string", {**GOOD, "frequency_penalty": "high"}, "frequency_penalty"),
    ("repetition_penalty zero", {**GOOD, "repetition_penalty": 0}, "repetition_penalty"),
    ("min_p above one", {**GOOD, "min_p": 1.5}, "min_p"),
    ("top_k beyond int32", {**GOOD, "top_k": 2**40, "temperature": 0.7}, "top_k"),
    ("prompt lone surrogate", {**GOOD, "prompt": "Flat \ud800 is"}, "prompt"),
    ("lone surrogate in a stop string", {**GOOD, "stop": ["a", "\ud800"]}, "stop[1]"),
    ("NaN temperature", '{"model": "atlas-demo", "prompt": "Flat", "temperature": NaN}', None),
    ("Infinity max_tokens", '{"model": "atlas-demo", "prompt": "Flat", "max_tokens": -Infinity}', None),
    ("number past the float range", '{"model": "atlas-demo", "prompt": "Flat", "temperature": 1e400}', None),
    ("integer of 5000 digits", '{"model": "atlas-demo", "prompt": "Flat", "max_tokens": ' + "7" * 5000 + "}", None),
    ("UTF-16 body", json.dumps(GOOD).encode("utf-16").decode("latin-1"), None),
    ("nested too deeply", "[" * 100_000 + "]" * 100_000, None),
    ("stream_options wrong type", {**GOOD, "stream_options": 5}, "stream_options"),
    ("include_usage wrong type", {**GOOD, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ("continuous_usage_stats wrong type", {**GOOD, "stream_options": {"include_usage": True, "continuous_usage_stats": 1}},
     "stream_options.continuous_usage_stats"),
    ("beam search with top_p", {**GOOD, "use_beam_search": True, "top_p": 0.9}, "top_p"),
    ("bad_words not strings", {**GOOD, "bad_words": [5]}, "bad_words"),
    ("bad_words empty word", {**GOOD, "bad_words": [" "]}, "bad_words"),
    ("allowed_token_ids empty", {**GOOD, "allowed_token_ids": []}, "allowed_token_ids"),
    ("allowed_token_ids beyond the vocabulary", {**GOOD, "allowed_token_ids": [5, 10**6]}, "allowed_token_ids"),
    ("truncate_prompt_tokens zero", {**GOOD, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("truncate_prompt_tokens float", {**GOOD, "truncate_prompt_tokens": 2.5}, "truncate_prompt_tokens"),
    ("truncate_prompt_tokens past the context", {**GOOD, "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
    ("beam search as 0", {**GOOD, "use_beam_search": 0}, "use_beam_search"),
    ("length_penalty true", {**GOOD, "length_penalty": True}, "length_penalty"),
    ("skip_special_tokens not bool", {**GOOD, "skip_special_tokens": "no"}, "skip_special_tokens"),
    ("include_stop_str_in_output not bool", {**GOOD, "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ("prompt_logprobs streamed", {**GOOD, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("prompt_logprobs -1 (the whole vocabulary)", {**GOOD, "prompt_logprobs": -1}, "prompt_logprobs"),
    ("prompt_logprobs beyond 20", {**GOOD, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("prompt_logprobs true", {**GOOD, "prompt_logprobs": True}, "prompt_logprobs"),
]
CHAT_HI = {"model": DEMO_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
BAD_CHAT: list[tuple[str, Any, str | None]] = [
    ("missing messages", {"model": DEMO_NAME}, "messages"),
    ("messages not a list", {"model": DEMO_NAME, "messages": "hi"}, "messages"),
    ("message without role", {"model": DEMO_NAME, "messages": [{"content": "hi"}]}, "messages[0].role"),
    ("image content", {"model": DEMO_NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ("chat lone surrogate", {"model": DEMO_NAME, "messages": [{"role": "user", "content": "\udcff"}]},
     "messages[0].content"),
    ("top_logprobs without logprobs", {"model": DEMO_NAME, "messages": [{"role": "user", "content": "hi"}],
                                       "top_logprobs": 3}, "top_logprobs"),
    ("echo in chat", {"model": DEMO_NAME, "messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ("top_logprobs beyond 20", {"model": DEMO_NAME, "messages": [{"role": "user", "content": "hi"}],
                                "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("logprobs as in completions", {"model": DEMO_NAME, "messages": [{"role": "user", "content": "hi"}],
                                    "logprobs": 2}, "logprobs"),
    ("continue_final_message with a generation prompt",
     {"model": DEMO_NAME, "messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
     "continue_final_message"),
    ("continue_final_message of an empty message",
     {"model": DEMO_NAME, "messages": [{"role": "assistant", "content": ""}], "continue_final_message": True,
      "add_generation_prompt": False}, "messages"),
    ("add_generation_prompt not bool", {"model": DEMO_NAME, "messages": [{"role": "user", "content": "hi"}],
                                        "add_generation_prompt": "no"}, "add_generation_prompt"),
    ("chat prompt_logprobs streamed", {"model": DEMO_NAME, "messages": [{"role": "user", "content": "hi"}],
                                       "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ("chat max_completion_tokens beyond context",
     {"model": DEMO_NAME, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000}, "max_tokens"),
    # found by an audit: each was a 500
    ("schema bound a string", {**CHAT_HI, "guided_json": {"type": "integer", "minimum": "0"}}, "guided_json"),
    ("schema type list in a list", {**CHAT_HI, "guided_json": {"type": [["string"]]}}, "guided_json"),
    ("regex bound of 5000 digits", {**CHAT_HI, "guided_regex": "a{" + "1" * 5000 + "}"}, "guided_regex"),
    ("grammar token id of 5000 digits", {**CHAT_HI, "guided_grammar": "root ::= <[" + "1" * 5000 + "]>"}, "guided_grammar"),
    ("logit_bias id of 5000 digits", {**CHAT_HI, "logit_bias": {"1" * 5000: 1}}, "logit_bias"),
    ("tool arguments with 5000 digits", {**CHAT_HI, "messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
     "function": {"name": "f", "arguments": '{"a": ' + "1" * 5000 + "}"}}]}, {"role": "user", "content": "hi"}]},
     "messages[0].tool_calls[0].function.arguments"),
    ("regex nothing matches", {**CHAT_HI, "guided_regex": "a[^\\s\\S]"}, "guided_regex"),
    ("schema of 1025 properties", {**CHAT_HI, "guided_json": {"type": "object", "properties": {
        f"k{i}": {"type": "integer"} for i in range(1025)}}}, "guided_json"),
]


@pytest.mark.parametrize(("path", "body", "param"), [
    *[pytest.param("/v1/completions", b, p, id=name) for name, b, p in BAD_COMPLETIONS],
    *[pytest.param("/v1/chat/completions", b, p, id=name) for name, b, p in BAD_CHAT],
])
def test_bad_request(served: Served, path: str, body: Any, param: str | None) -> None:
    status, answer = post(served.port, path, body if isinstance(body, str) else json.dumps(body))
    assert status == 400, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    assert_still_serving(served)


def test_client_sees_bad_requests(served: Served) -> None:
    client = served.client()
    with pytest.raises(openai.NotFoundError) as unknown:  # OpenAI's and vLLM's status
        client.completions.create(model="no-such-model", prompt="Flat", max_tokens=2)
    assert unknown.value.code == "model_not_found" and unknown.value.param == "model"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as several:
        client.chat.completions.create(model=DEMO_NAME, messages=[{"role": "user", "content": "x"}], n=17)
    assert several.value.param == "n"
    with pytest.raises(openai.NotFoundError):  # a route this server has not
        client.images.generate(model=DEMO_NAME, prompt="x")
    assert_still_serving(served)


# --- random bodies -------------------------------------------------------------------------------
FUZZ_VALUES: tuple[Any, ...] = (
    None, True, -1, 0, 3, 2**63, 1e308, -0.5, "", "x" * 600, "\ud800", "a\x00b", [], {}, [1, "a"], [[[[]]]], {"a": 1},
    {"type": "json_object"}, {"type": "json_schema"}, [{"role": "user"}], [{"role": "user", "content": [{"type": "text"}]}],
    {"include_usage": True}, [{"type": "function", "function": {"name": "f"}}], "required", {"5": 2}, {"-1": 1},
    {"type": "enabled", "budget_tokens": 2}, {"type": "enabled", "budget_tokens": -2},
)
FUZZ_FIELDS = ("model", "prompt", "messages", "input", "text", "metadata", "instructions", "max_tokens",
               "max_completion_tokens", "max_output_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream",
               "stream_options", "stop", "seed", "logprobs", "top_logprobs", "echo", "logit_bias", "presence_penalty",
               "response_format", "tools", "tool_choice", "guided_regex", "guided_choice", "structured_outputs",
               "min_tokens", "stop_token_ids", "chat_template_kwargs", "prompt_logprobs", "tokens", "add_special_tokens",
               "system", "stop_sequences", "thinking", "output_config", "return_token_ids", "background", "store",
               "thinking_token_budget", "n_predict", "n_probs", "repeat_penalty", "repeat_last_n", "mirostat",
               "return_tokens", "use_beam_search", "length_penalty", "encoding_format", "dimensions", "normalize",
               "content", "embd_normalize", "truncate_prompt_tokens")
FUZZ_BASES = {
    "/v1/completions": {"model": DEMO_NAME, "prompt": "Beautiful is", "max_tokens": 3},
    "/v1/chat/completions": {"model": DEMO_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    "/v1/responses": {"model": DEMO_NAME, "input": "Hi", "max_output_tokens": 3},
    "/v1/messages": {"model": DEMO_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    "/v1/messages/count_tokens": {"model": DEMO_NAME, "messages": [{"role": "user", "content": "Hi"}]},
    "/tokenize": {"model": DEMO_NAME, "prompt": "Hi"},
    "/detokenize": {"model": DEMO_NAME, "tokens": [1, 2, 3]},
    "/apply-template": {"model": DEMO_NAME, "messages": [{"role": "user", "content": "Hi"}]},
    "/invocations": {"model": DEMO_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    "/completion": {"prompt": "Beautiful is", "n_predict": 3, "n_probs": 2},  # llama.cpp's
    "/v1/embeddings": {"model": DEMO_NAME, "input": ["Beautiful is", "Hi"], "encoding_format": "base64"},
    "/embedding": {"content": "Beautiful is", "embd_normalize": 2},  # llama.cpp's
}


def test_the_first_unpaired_surrogate_is_named_by_its_path() -> None:
    from atlas.json_text import unpaired_surrogate_path

    body = {"model": "m", "messages": [{"role": "user", "content": ["ok", "\udc00"]}], "metadata": {"b": "\ud800"}}
    assert unpaired_surrogate_path(body) == "messages[0].content[1]"
    assert unpaired_surrogate_path({"a\nb": {"c\ud800": 1}, "z": "\ud800"}) == '"a\\nb"'  # the object with the key
    assert unpaired_surrogate_path(["\ud800"]) == "[0]" and unpaired_surrogate_path("\ud800") == ""
    assert unpaired_surrogate_path(json.loads('{"e": "\\ud83d\\ude00", "n": [1, 2.5, null]}')) is None  # a pair


def test_minus_infinity_logprobs_go_out_as_vllm_sends_them() -> None:
    from types import SimpleNamespace

    from atlas.sampling import TokenLogprob
    from atlas.server.worker import MIN_WIRE_LOGPROB, scored

    llm = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: f"<{ids[0]}>"))
    [entry] = scored(llm, [TokenLogprob(3, -float("inf"), ((3, -float("inf")), (4, float("nan")), (5, -1.5)))])
    assert (entry.text, entry.logprob) == ("<3>", MIN_WIRE_LOGPROB)
    assert entry.top == (("<3>", MIN_WIRE_LOGPROB), ("<4>", MIN_WIRE_LOGPROB), ("<5>", -1.5))


def fuzzed_body(rng: np.random.Generator) -> tuple[str, str]:
    """(path, raw JSON): a good body with one to three fields set to values of the wrong kind (or
    of the right kind, out of range), and now and then a NaN."""
    path = str(rng.choice(list(FUZZ_BASES)))
    body = dict(FUZZ_BASES[path])
    for _ in range(int(rng.integers(1, 4))):
        body[str(rng.choice(FUZZ_FIELDS))] = FUZZ_VALUES[int(rng.integers(len(FUZZ_VALUES)))]
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n", "n_predict"):  # keep each answer short
        if is_int(body.get(name)) and 8 < body[name] < 10**6:
            body[name] = 3
    if path == "/completion" and body.get("n_predict") == -1:  # llama.cpp's: until the context is full
        body["n_predict"] = 3
    if "ignore_eos" in body or "min_tokens" in body:  # with no length, a chat may fill the context without an eos
        body.update({name: 3 for name, value in body.items() if value is None and name.startswith("max_")})
    raw = json.dumps(body)
    return path, raw.replace('"temperature": 3', '"temperature": NaN') if rng.random() < 0.2 else raw


def post_raw(port: int, path: str, body: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", path, body=body.encode("utf-8", "surrogatepass"), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_random_bodies_get_answers_or_one_400(served: Served, rng: np.random.Generator) -> None:
    """Every body is answered (200) or refused with a 4xx error body (OpenAI's, or Anthropic's on
    /v1/messages); none is a 500, and the server answers a good request afterwards."""
    for _ in range(150):
        path, raw = fuzzed_body(rng)
        status, data = post_raw(served.port, path, raw)
        assert status == 200 or 400 <= status < 500, (path, raw[:300], status, data[:300])
        if status != 200:
            error = json.loads(data)["error"]
            assert error["message"] and "\n" not in error["message"], (path, raw[:300], error)
    assert_still_serving(served)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_past_the_limit_is_a_413(served: Served, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator,
                                        chunked: bool) -> None:
    """Past MAX_BODY_BYTES the body is refused as it arrives (declared or streamed), never held."""
    import atlas.server.app as app

    limit = int(rng.integers(1000, 5000))
    monkeypatch.setattr(app, "MAX_BODY_BYTES", limit)
    body = json.dumps({**GOOD, "prompt": "x" * limit}).encode()
    conn = http.client.HTTPConnection(HOST, served.port, timeout=TIMEOUT_S)
    try:
        if chunked:  # no Content-Length: the size shows only while the body streams in
            pieces = (body[i : i + 512] for i in range(0, len(body), 512))
            conn.request("POST", "/v1/completions", body=pieces, encode_chunked=True,
                         headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        else:
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        status, answer = response.status, json.loads(response.read())
    finally:
        conn.close()
    assert status == 413 and answer["error"]["code"] == "request_too_large", answer
    assert f"exceeds {limit / 2**20:g} MiB" in answer["error"]["message"]
    under = json.dumps({**GOOD, "prompt": " ".join(["Beautiful"] * (limit // 40))})  # ~limit / 4 bytes, few tokens
    assert len(under) < limit and post(served.port, "/v1/completions", under)[0] == 200
    assert_still_serving(served)


def test_engine_fault_is_a_500_and_the_server_survives(served: Served) -> None:
    body = {"model": DEMO_NAME, "prompt": "Flat is", "max_tokens": 8, "temperature": 0}
    served.engine.fail = True
    try:
        status, answer = post(served.port, "/v1/completions", json.dumps(body))
        conn = http.client.HTTPConnection(HOST, served.port, timeout=TIMEOUT_S)
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}))
        events = conn.getresponse().read().decode().split("\n\n")
        conn.close()
    finally:
        served.engine.fail = False
    assert status == 500 and answer["error"]["type"] == "server_error"
    assert "injected engine fault" in answer["error"]["message"]
    assert events[-2:] == ["data: [DONE]", ""]
    assert "injected engine fault" in json.loads(events[-3].removeprefix("data: "))["error"]["message"]
    assert_still_serving(served)



@pytest.mark.parametrize(("template", "needle"), [
    ("{% for m in messages %}{{ m.content | int + [] }}{% endfor %}", "TypeError"),
    ("{% for m in messages %}{{ m.content }}", "not valid jinja"),
    ("{{ messages[0].content.strip() + messages[4].content }}", "UndefinedError"),
])
def test_failing_chat_template_is_a_400(served: Served, tmp_path: Path, template: str, needle: str) -> None:
    tokenizer = served.llm.tokenizer
    saved = tokenizer.chat_template, tokenizer.chat_template_source
    tokenizer.chat_template, tokenizer.chat_template_source = template, tmp_path / "chat_template.jinja"
    try:
        body = {"model": DEMO_NAME, "messages": [{"role": "user", "content": "Flat"}], "max_tokens": 3}
        for stream in (False, True):
            status, answer = post(served.port, "/v1/chat/completions", json.dumps({**body, "stream": stream}))
            assert status == 400, answer
            error = answer["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == "messages"
            assert "chat_template.jinja" in error["message"] and needle in error["message"], error
    finally:
        tokenizer.chat_template, tokenizer.chat_template_source = saved
    assert_still_serving(served)


def test_stopped_engine_answers_instead_of_hanging() -> None:
    import asyncio

    from atlas.llm import GenerateOptions
    from atlas.server.worker import Failed

    worker = EngineWorker(lambda: object())  # type: ignore[arg-type, return-value]
    worker.start()
    worker.stop()
    assert not worker.alive

    async def first_event() -> object:
        events = worker.events([1, 2], GenerateOptions(max_tokens=2))
        return await asyncio.wait_for(events.__anext__(), timeout=5)

    event = asyncio.run(first_event())
    assert isinstance(event, Failed) and "engine thread has stopped" in event.message

def test_a_lost_cuda_context_makes_the_server_unhealthy(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    """A kernel fault loses the GPU's context for good: the request that met it fails, /health
    turns 503 naming it (an orchestrator restarts the server), and later requests fail at once with
    a 503 instead of each meeting the same error on the device."""
    from starlette.testclient import TestClient

    import atlas.server.worker as worker_module
    from atlas.backends.cuda.driver import CudaError

    calls = []

    def faulting(llm: LLM, job: object) -> None:
        calls.append(job)
        raise CudaError("cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)")

    worker = EngineWorker(lambda: LLM(None, device="cpu", prompt_cache=0))
    llm = worker.start()
    try:
        http = TestClient(create_app(ServerState(DEMO_NAME, worker, llm)))
        request = {"model": DEMO_NAME, "prompt": random_prompt(rng), "max_tokens": 4}
        assert http.get("/health").status_code == 200
        monkeypatch.setattr(worker_module, "generate", faulting)
        first = http.post("/v1/completions", json=request)
        assert first.status_code == 500 and "CUDA_ERROR_ILLEGAL_ADDRESS" in first.json()["error"]["message"]
        for health in (http.get("/health"), http.get("/ping"), http.post("/ping")):  # /ping: vLLM's probe
            assert health.status_code == 503 and "CUDA context is lost" in health.json()["status"], health.text
        for route, body in (("/v1/completions", request), ("/v1/chat/completions", chat_request(request))):
            later = http.post(route, json=body)
            assert later.status_code == 503 and "restart the server" in later.json()["error"]["message"], later.text
        assert len(calls) == 1
    finally:
        worker.stop()


def test_an_ordinary_cuda_error_fails_only_its_request(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    from starlette.testclient import TestClient

    import atlas.server.worker as worker_module
    from atlas.backends.cuda.driver import CudaError

    real = worker_module.generate
    failures = iter([CudaError("cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)")])

    def once(llm: LLM, job: object) -> object:
        if (err := next(failures, None)) is not None:
            raise err
        return real(llm, job)  # type: ignore[arg-type]

    worker = EngineWorker(lambda: LLM(None, device="cpu", prompt_cache=0))
    llm = worker.start()
    try:
        http = TestClient(create_app(ServerState(DEMO_NAME, worker, llm)))
        monkeypatch.setattr(worker_module, "generate", once)
        request = {"model": DEMO_NAME, "prompt": random_prompt(rng), "max_tokens": 4}
        assert http.post("/v1/completions", json=request).status_code == 500
        assert http.get("/health").status_code == 200
        assert http.post("/v1/completions", json=request).status_code == 200
    finally:
        worker.stop()


# --- concurrency and disconnects ---------------------------------------------------------------
def test_eight_concurrent_clients(served: Served, rng: np.random.Generator) -> None:
    jobs = [(random_prompt(rng), int(rng.integers(20, 120)), i % 2 == 1, i % 4 >= 2) for i in range(8)]
    wanted = [expected(served, p, n, chat=chat)[0] for p, n, chat, _ in jobs]

    def ask(job: tuple[str, int, bool, bool]) -> str:
        prompt, max_tokens, chat, stream = job
        client = served.client()
        if chat:
            answer = client.chat.completions.create(
                model=DEMO_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                temperature=0, stream=stream,
            )
            if stream:
                return "".join(c.choices[0].delta.content or "" for c in answer)
            return answer.choices[0].message.content
        answer = client.completions.create(model=DEMO_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=stream)
        return "".join(c.choices[0].text for c in answer) if stream else answer.choices[0].text

    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(ask, jobs, timeout=TIMEOUT_S * 2))
    assert answers == wanted


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_the_engine(served: Served, stream: bool) -> None:
    prompt = "Beautiful is better than"
    _, _, full_run = expected(served, prompt, 1000)  # decode steps an uninterrupted run would take
    served.engine.delay_s = 0.02
    try:
        start = served.engine.decodes
        if stream:
            leave_mid_stream(served, prompt)
        else:
            leave_while_waiting(served, prompt)
        settled = wait_until_settled(served.engine)
        assert settled - start >= 2, "the request ran without decode steps: the counter is not wired"
        assert settled - start < full_run // 4, f"{settled - start} decodes after the disconnect"
        began = time.monotonic()
        answer = served.client().completions.create(model=DEMO_NAME, prompt="Flat is", max_tokens=5, temperature=0)
        assert time.monotonic() - began < 2.0
        assert answer.choices[0].text == expected(served, "Flat is", 5)[0]
    finally:
        served.engine.delay_s = 0.0


def leave_mid_stream(served: Served, prompt: str) -> None:
    stream = served.client().completions.create(
        model=DEMO_NAME, prompt=prompt, max_tokens=1000, temperature=0, stream=True
    )
    for _, _ in zip(range(3), stream):
        pass
    stream.close()


def leave_while_waiting(served: Served, prompt: str, **fields: Any) -> None:
    """A non-streaming request (a completion, with `fields` over the defaults) whose client gives
    up (times out) before the answer."""
    body = {"model": DEMO_NAME, "prompt": prompt, "max_tokens": 1000, "temperature": 0, **fields}
    conn = http.client.HTTPConnection(HOST, served.port, timeout=0.3)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body))
        with pytest.raises(TimeoutError):
            conn.getresponse()
    finally:
        conn.close()


def wait_until_settled(engine: CountingEngine) -> int:
    """The decode count once it stops moving for 0.3 s (bounded)."""
    last, deadline = -1, time.monotonic() + 10
    while time.monotonic() < deadline:
        count = engine.decodes
        if count == last:
            return count
        last = count
        time.sleep(0.3)
    raise AssertionError("the engine kept decoding after the client disconnected")


# --- the command line --------------------------------------------------------------------------
def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "atlas.serve", "--device", "cpu", "--log-level", "warning", *args]


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    if env.get("ATLAS_TEST_INSTALLED") != "1":
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), env.get("PYTHONPATH", "")])
    return env


@contextlib.contextmanager
def cli_server(*args: str) -> Iterator[tuple[int, list[str]]]:
    """`python -m atlas.serve` on a free port: (port, its output lines, stderr and stdout (uvicorn's
    access log): those until it listened, and the rest once it stopped); stopped with Ctrl-C,
    which must exit 0."""
    process = subprocess.Popen(serve_command("--host", HOST, "--port", "0", *args), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=cli_env())
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True)  # type: ignore[union-attr]
    reader.start()
    seen: list[str] = []
    try:
        yield listening_port(lines, seen), seen
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        reader.join(TIMEOUT_S)
        seen.extend(iter(lambda: lines.get() if not lines.empty() else "", ""))
    assert process.returncode == 0


def test_cli_serves_and_stops(tmp_path: Path) -> None:
    """Behind a proxy that strips --root-path (uvicorn puts it back before each path), the routes,
    the key's open paths and the Anthropic error shape read the path without it; --slot-save-path
    (made when missing) takes the slot's saves."""
    slots = tmp_path / "slots"
    with cli_server("--root-path", "/proxy/", "--api-key", "k", "--slot-save-path", str(slots)) as (port, _):
        client = openai.OpenAI(base_url=f"http://{HOST}:{port}/v1", api_key="k", timeout=TIMEOUT_S, max_retries=0)
        answer = client.chat.completions.create(
            model=DEMO_NAME, messages=[{"role": "user", "content": "Flat"}], max_tokens=6, temperature=0
        )
        assert answer.choices[0].message.content
        assert get_json(port, "/health")["status"] == "ok"  # open without the key
        status, refused = post(port, "/v1/messages", "{}")
        assert status == 401 and refused["type"] == "error", refused  # Anthropic's shape on its route
        conn = http.client.HTTPConnection(HOST, port, timeout=TIMEOUT_S)
        conn.request("POST", "/slots/0?action=save", body=json.dumps({"filename": "chat.bin"}),
                     headers={"Authorization": "Bearer k"})
        save = json.loads(conn.getresponse().read())
        conn.close()
        assert save["n_saved"] > 0 and (slots / "chat.bin").stat().st_size == save["n_written"]


def test_a_vllm_command_line_serves(rng: np.random.Generator) -> None:
    """`vllm serve MODEL` flags: the positional model, --enable-auto-tool-choice beside the tool
    parser, --speculative-config as --spec-k, several --served-model-name names, and the flags
    with nothing to do here (said once)."""
    k = int(rng.integers(1, 4))
    config = {"method": "qwen3_next_mtp", "num_speculative_tokens": k, "disable_padded_drafter_batch": False}
    args = (DEMO_NAME, "--enable-auto-tool-choice", "--served-model-name", "qwen-a", "gpt-x",
            "--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3",
            "--speculative-config", json.dumps(config), "--gpu-memory-utilization", "0.9", "-tp", "1", "-dp", "1",
            "--trust-remote-code", "--dtype", "auto", "--max-model-len", "1024", "--kv-cache-dtype", "fp8_e4m3", "--kv-high-precision-layers", "0",
            "--no-enable-prefix-caching", "--language-model-only", "--max-num-seqs", "256", "--disable-log-requests",
            "--uvicorn-log-level", "warning", "--enforce-eager", "--seed", "0", "--disable-uvicorn-access-log",
            "--max-num-batched-tokens", "8192", "--enable-chunked-prefill", "--enable-expert-parallel", "--async-scheduling",
            "--mm-encoder-tp-mode", "data", "--mm-processor-cache-type", "shm", "--enable-request-id-headers")
    with cli_server(*args) as (port, stderr):
        health = get_json(port, "/health")
        cards = get_json(port, "/v1/models")["data"]
        status, answer = post(port, "/v1/completions", json.dumps({"model": "gpt-x", "prompt": "Flat", "max_tokens": 2}))
    assert f"--spec-k {k} is ignored" in health["speculation"], health  # the demo has no MTP head
    assert [(card["id"], card["max_model_len"]) for card in cards] == [("qwen-a", 1024), ("gpt-x", 1024)]
    assert status == 200 and answer["model"] == "qwen-a", answer
    assert health["tool_call_parser"] == "qwen3_coder" and health["prompt_cache"] == "off", health
    assert health["kv_cache"].startswith("fp8 on layers"), health
    assert health["prefill_pass_tokens"] == "4096", health  # --max-num-batched-tokens, capped
    for said in ("--gpu-memory-utilization 0.9 is not used", "--max-num-seqs 256 is not used",
                 "disable_padded_drafter_batch not used", "--max-num-batched-tokens 8192: prompts run in passes of at most 4096",
                 "--enable-chunked-prefill: prompts always run in passes of 4096", "--enable-expert-parallel changes nothing",
                 "--async-scheduling changes nothing", "--mm-encoder-tp-mode data is not used",
                 "--mm-processor-cache-type shm is not used"):
        assert any(said in line for line in stderr), (said, stderr)


def test_cli_seed_and_access_log(rng: np.random.Generator) -> None:
    """vLLM's --seed: two servers given it answer the same seedless sampled requests alike, and the
    two requests of one server differ (each draws its seed); --disable-uvicorn-access-log leaves
    out the line per request that the other server's log has."""
    body = {"model": DEMO_NAME, "prompt": random_prompt(rng), "max_tokens": 24, "temperature": 2.0, "top_p": 1.0}
    seed = str(int(rng.integers(1 << 30)))
    texts, logs = [], []
    for quiet in ((), ("--disable-uvicorn-access-log",)):
        with cli_server("--seed", seed, "--log-level", "info", *quiet) as (port, stderr):
            texts.append([post(port, "/v1/completions", json.dumps(body))[1]["choices"][0]["text"] for _ in range(2)])
            assert get_json(port, "/health")["status"] == "ok"
        logs.append("".join(stderr))
    assert texts[0] == texts[1] and texts[0][0] != texts[0][1], texts
    assert '"POST /v1/completions HTTP/1.1" 200' in logs[0] and "POST /v1/completions" not in logs[1], logs


@pytest.mark.parametrize(("args", "words"), [
    (("--enable-auto-tool-choice",), "needs --tool-call-parser"),
    (("--tensor-parallel-size", "2"), "one GPU"),
    (("--speculative-config", '{"method": "eagle", "model": "x"}'), "only the checkpoint's MTP head"),
    (("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 4}'), "num_speculative_tokens must be 1..3"),
    (("--speculative-config", "{mtp"), "is not JSON"),
    (("--speculative-config", '{"method": "mtp"}', "--spec-k", "1"), "give one of them"),
    (("some-model", "--model", "other"), "given twice"),
    (("--dtype", "float16"), "--dtype"),
    (("-dp", "2"), "one GPU"),
])
def test_vllm_flags_atlas_cannot_honour_are_one_line(capsys: pytest.CaptureFixture[str], args: tuple[str, ...],
                                                     words: str) -> None:
    from atlas.serve import main

    assert main(list(args)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


def test_cli_engine_flags_reach_the_engine(rng: np.random.Generator) -> None:
    from atlas.config import load_spec
    from atlas.demo import DEMO_DIR

    level = str(rng.choice(["fp8", "nvfp4", "turbo8", "turbo4", "turbo3"]))
    k = int(rng.integers(1, 4))
    full = [i for i, kind in enumerate(load_spec(DEMO_DIR).layer_types) if kind == "full_attention"]
    checkpoints, passes = int(rng.integers(0, 9)), int(rng.integers(1, 4097))
    args = ("--kv-cache-dtype", level, "--kv-high-precision-layers", "0", "--spec-k", str(k), "--prompt-cache", str(checkpoints),
            "--reasoning-parser", "qwen3", "--max-num-batched-tokens", str(passes))
    with cli_server(*args) as (port, stderr):
        health = get_json(port, "/health")
        answer = openai.OpenAI(base_url=f"http://{HOST}:{port}/v1", api_key="none", timeout=TIMEOUT_S, max_retries=0) \
            .completions.create(model=DEMO_NAME, prompt="Flat is", max_tokens=4, temperature=0)
    assert health["kv_cache"] == f"{level} on layers {', '.join(map(str, full))}", health
    assert f"--spec-k {k} is ignored" in health["speculation"], health  # the demo has no MTP head
    assert health["prompt_cache"] == (f"{checkpoints} checkpoints" if checkpoints else "off"), health
    assert health["reasoning_parser"] == "qwen3" and health["prefill_pass_tokens"] == str(passes), health
    assert any(f"kv cache {level} on layers" in line for line in stderr), stderr
    assert answer.choices[0].text


def listening_port(lines: queue.Queue[str], seen: list[str]) -> int:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        seen.append(line)
        if "listening on http://" in line:
            return int(line.rsplit(":", 1)[1].split("/")[0])
    raise AssertionError("atlas.serve did not report its address: " + "".join(seen))


@pytest.mark.parametrize(("args", "needle"), [
    (["--port", "70000"], "--port"),
    (["--model", "/no/such/model/dir"], "/no/such/model/dir"),
    (["--log-level", "loud"], "--log-level"),
    (["--spec-k", "4"], "--spec-k"),
    (["--spec-k", "0"], "--spec-k"),
    (["--spec-k", "2", "--no-spec"], "--no-spec"),
    (["--kv-cache-dtype", "int3"], "--kv-cache-dtype"),
    (["--kv-high-precision-layers", "-1"], "--kv-high-precision-layers"),
    (["--kv-high-precision-layers", "some"], "--kv-high-precision-layers"),
    (["--served-model-name", " "], "--served-model-name"),
    (["--prompt-cache", "-1"], "--prompt-cache"),
    (["--reasoning-parser", "deepthink"], "--reasoning-parser"),
    (["--api-key", " "], "--api-key"),
    (["--prompt-cache", "65"], "--prompt-cache"),
    (["--ctx-checkpoints", "65"], "'--ctx-checkpoints': 65 is not in the range"),  # llama-server's name for it
    (["--root-path", "atlas"], "--root-path"),
    (["--root-path", "/a?b"], "--root-path"),
    (["--slot-save-path", "/dev/null/slots"], "--slot-save-path"),
])
def test_cli_bad_input_is_one_line(args: list[str], needle: str) -> None:
    done = subprocess.run(serve_command(*args), capture_output=True, text=True, env=cli_env(), timeout=TIMEOUT_S)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atlas.serve: error:") and needle in lines[0], done.stderr


def test_cli_port_in_use() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        done = subprocess.run(serve_command("--host", HOST, "--port", port), capture_output=True, text=True,
                              env=cli_env(), timeout=TIMEOUT_S)
    assert done.returncode == 2
    assert done.stderr.strip().startswith(f"atlas.serve: error: cannot listen on {HOST}:{port}"), done.stderr


def test_tokenize_and_detokenize(served: Served, rng: np.random.Generator) -> None:
    """vLLM's /tokenize (a prompt, or messages through the chat template) and /detokenize."""
    prompt = random_prompt(rng)
    tokenizer = served.reference.tokenizer
    status, body = post(served.port, "/tokenize", json.dumps({"model": DEMO_NAME, "prompt": prompt}))
    assert status == 200 and body["tokens"] == tokenizer.encode(prompt) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == get_json(served.port, "/v1/models")["data"][0]["max_model_len"]
    messages = [{"role": "user", "content": prompt}]
    status, body = post(served.port, "/tokenize", json.dumps({"model": DEMO_NAME, "messages": messages}))
    assert status == 200 and body["tokens"] == tokenizer.encode_chat(messages)
    started = [*messages, {"role": "assistant", "content": "Beautiful"}]
    status, body = post(served.port, "/tokenize", json.dumps({"model": DEMO_NAME, "messages": started,
                                                              "add_generation_prompt": False, "continue_final_message": True}))
    assert status == 200 and body["tokens"] == tokenizer.encode_chat(started, False, None, continue_final=True)
    status, body = post(served.port, "/detokenize", json.dumps({"model": DEMO_NAME, "tokens": tokenizer.encode(prompt)}))
    assert status == 200 and body["prompt"] == tokenizer.decode(tokenizer.encode(prompt))
    for path, bad, param in (("/tokenize", {"model": DEMO_NAME}, "prompt"),
                             ("/tokenize", {"model": DEMO_NAME, "prompt": 5}, "prompt"),
                             ("/detokenize", {"model": DEMO_NAME, "tokens": [10**9]}, "tokens"),
                             ("/detokenize", {"model": "gpt-4o", "tokens": [1]}, "model")):
        status, body = post(served.port, path, json.dumps(bad))
        assert status == (404 if param == "model" else 400) and body["error"]["param"] == param, body


def test_apply_template_renders_what_tokenize_encodes(served: Served, rng: np.random.Generator) -> None:
    """llama.cpp's /apply-template: the chat's prompt text, whose ids are /tokenize's for the messages."""
    tokenizer = served.reference.tokenizer
    messages = [{"role": "user", "content": random_prompt(rng)}, {"role": "assistant", "content": random_prompt(rng)}]
    for extra in ({}, {"add_generation_prompt": False, "continue_final_message": True}):
        status, body = post(served.port, "/apply-template", json.dumps({"messages": messages, **extra}))
        assert status == 200, body
        _, tokenized = post(served.port, "/tokenize", json.dumps({"messages": messages, **extra}))
        assert tokenizer.encode(body["prompt"], add_special_tokens=False) == tokenized["tokens"]
        assert body["prompt"].endswith(messages[-1]["content"]) == bool(extra)
    for bad, param in (({"prompt": "Flat"}, "messages"), ({"messages": "Flat"}, "messages"), ({"model": "gpt-4o",
                       "messages": messages}, "model")):
        status, body = post(served.port, "/apply-template", json.dumps(bad))
        assert status == (404 if param == "model" else 400) and body["error"]["param"] == param, body


def test_invocations_answers_as_the_route_its_body_names(served: Served, rng: np.random.Generator) -> None:
    """vLLM's /invocations (SageMaker): a body with messages is a chat completion, one with a
    prompt a text completion, each the same answer as its own route's."""
    prompt, max_tokens = random_prompt(rng), int(rng.integers(2, 9))
    chat = {"model": DEMO_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    text = {"model": DEMO_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    for body, route, kind in ((chat, "/v1/chat/completions", "chat.completion"), (text, "/v1/completions", "text_completion")):
        status, answer = post(served.port, "/invocations", json.dumps(body))
        assert status == 200 and answer["object"] == kind, answer
        _, direct = post(served.port, route, json.dumps(body))
        assert answer["choices"] == direct["choices"]
        counts = ("prompt_tokens", "completion_tokens")  # the second run finds its prompt cached
        assert [answer["usage"][k] for k in counts] == [direct["usage"][k] for k in counts]
    for bad in ({"model": DEMO_NAME}, {**chat, "prompt": prompt}, [chat]):
        status, answer = post(served.port, "/invocations", json.dumps(bad))
        assert status == 400 and "'messages'" in answer["error"]["message"], answer


@pytest.mark.parametrize(("argv", "spread"), [
    (["M", "--served-model-name", "a", "b", "--port", "1"], ["M", "--served-model-name", "a", "--served-model-name", "b", "--port", "1"]),
    (["--served-model-name", "a"], ["--served-model-name", "a"]),
    (["--served-model-name", "a", "b", "c"], ["--served-model-name", "a", "--served-model-name", "b", "--served-model-name", "c"]),
    (["--served-model-name=a", "b"], ["--served-model-name=a", "b"]),  # the joined form takes one name; b is MODEL
    (["--served-model-name"], ["--served-model-name"]),  # click says it needs a value
])  # fmt: skip
def test_several_served_model_names_as_vllm_reads_them(argv: list[str], spread: list[str]) -> None:
    from atlas.serve import spread_names

    assert spread_names(argv) == spread
