"""The reasoning split (atlas.serve --reasoning-parser qwen3): whole answers, streamed answers cut
anywhere (their pieces join to the whole answer's split), prompts that open the block, and the
server's message.reasoning_content / delta.reasoning_content on canned engine output."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from atlas.server.answer import AnswerShaper
from atlas.server.reasoning import END, START, ReasoningSplitter, prompt_opens_reasoning
from atlas.stop_strings import partial_suffix

WORDS = ["a", "bc", " ", "\n", "\n\n", START, END, "<", "</", "<th", "think>", "é", "🙂", "</think", "x>"]


def split(text: str, opened: bool) -> tuple[str | None, str | None]:
    fields, _ = AnswerShaper(ReasoningSplitter(opened)).whole(text)
    return fields["reasoning_content"], fields["content"]


@pytest.mark.parametrize(("text", "opened", "want"), [
    ("plan it</think>\n\nThe answer.", True, ("plan it", "The answer.")),
    ("<think>\nplan</think>\n\nAnswer", False, ("\nplan", "Answer")),
    ("  <think>x</think>y", False, ("x", "y")),
    ("Just an answer.", False, (None, "Just an answer.")),
    ("Just an answer.", True, ("Just an answer.", None)),  # cut before the block closed
    ("no <think> here</think>", False, (None, "no <think> here</think>")),
    ("</think>\n\n", True, (None, None)),
    ("<thin", False, (None, "<thin")),
])
def test_whole_answers(text: str, opened: bool, want: tuple[str | None, str | None]) -> None:
    assert split(text, opened) == want


def test_streamed_pieces_join_to_the_whole_split(rng: np.random.Generator) -> None:
    for _ in range(300):
        text = "".join(rng.choice(WORDS, size=int(rng.integers(0, 12))))
        opened = bool(rng.integers(0, 2))
        splitter = ReasoningSplitter(opened)
        cuts = sorted(rng.integers(0, len(text) + 1, size=int(rng.integers(0, 6))).tolist())
        parts = []
        for start, stop in zip([0, *cuts], [*cuts, len(text)], strict=True):
            parts += splitter.push(text[start:stop])
        parts += splitter.flush()
        got = tuple("".join(t for f, t in parts if f == field) or None for field in ("reasoning_content", "content"))
        assert got == split(text, opened), (text, opened, cuts)
        assert all(t for _, t in parts)


def test_prompt_and_suffix_helpers() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<think>a</think>\n<|im_start|>assistant\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert [partial_suffix(t, END) for t in ("ab</", "ab</think", "ab", "</think>")] == [2, 7, 0, 0]


# --- through the HTTP app, on canned engine output ----------------------------------------------------
starlette = pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from atlas import LLM  # noqa: E402
from atlas.demo import DEMO_NAME  # noqa: E402
from atlas.server.app import ServerState, create_app  # noqa: E402
from atlas.server.worker import Finished, TextPiece  # noqa: E402

ANSWER = ["plan", " it</th", "ink>", "\n\n", "The", " answer."]


class CannedWorker:
    """Answers every request with ANSWER's pieces (the engine's text as the worker emits it)."""

    alive = True

    async def events(self, prompt_ids: list[int], opts: Any, returns: Any = None) -> AsyncIterator[Any]:
        for piece in ANSWER:
            yield TextPiece(piece)
        yield Finished("stop", len(prompt_ids), len(ANSWER))


THINKING_TEMPLATE = (  # the demo's ChatML with Qwen3's generation prompt: a <think> block opened unless disabled
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is not defined or enable_thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    from _demo_copy import demo_copy

    llm = LLM(str(demo_copy(tmp_path_factory.mktemp("thinking") / "demo", THINKING_TEMPLATE)), device="cpu")
    return TestClient(create_app(ServerState(DEMO_NAME, CannedWorker(), llm, reasoning_parser="qwen3")))  # type: ignore[arg-type]


def ask(client: TestClient, stream: bool, **extra: Any) -> Any:
    body = {"model": DEMO_NAME, "messages": [{"role": "user", "content": "hi <think>"}], "max_tokens": 8,
            "stream": stream, **extra}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def test_server_splits_a_whole_answer(client: TestClient) -> None:
    """The template's generation prompt opens a block: the answer up to </think> is reasoning.
    With enable_thinking false it opens none (a <think> in the user's text does not count), and
    an answer that opens none is all content."""
    message = ask(client, stream=False).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("plan it", "The answer.")
    message = ask(client, stream=False, **NO_THINKING).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (None, "".join(ANSWER))


@pytest.mark.parametrize("thinking", [True, False])
def test_server_streams_reasoning_deltas(client: TestClient, thinking: bool) -> None:
    import json

    lines = ask(client, stream=True, **({} if thinking else NO_THINKING)).text.splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert (reasoning, content) == (("plan it", "The answer.") if thinking else ("", "".join(ANSWER)))
    assert all(len(d) <= 1 for d in deltas[1:])  # no chunk carries both fields


@pytest.mark.parametrize(("started", "want"), [
    ("<think>\nLet me", ("plan it", "The answer.")),  # the continued message's block is still open
    ("<think>x</think>\n\nThe", (None, "".join(ANSWER))),  # closed: the rest is content
])
def test_continuing_a_message_inside_its_reasoning_block(client: TestClient, started: str, want: tuple) -> None:
    """continue_final_message: the answer goes on inside the block the final message opened, so
    it is reasoning up to </think>, whatever the generation prompt would have done."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": started}]
    answer = client.post("/v1/chat/completions", json={
        "model": DEMO_NAME, "messages": messages, "max_tokens": 8, "continue_final_message": True,
        "add_generation_prompt": False, **NO_THINKING})
    assert answer.status_code == 200, answer.text
    message = answer.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == want


@pytest.mark.parametrize("kwargs", [5, {"messages": []}, {"add_generation_prompt": False}, {"self": 1}, {"tools": []}])
def test_bad_template_kwargs(client: TestClient, kwargs: Any) -> None:
    body = {"model": DEMO_NAME, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "chat_template_kwargs"
