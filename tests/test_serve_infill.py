"""llama.cpp's POST /infill on a tiny random checkpoint whose vocabulary has Qwen's FIM tokens:
the prompt is the repo-level fill-in-the-middle pattern (checked token by token), the answer is
what the in-process model generates after those ids, whole or streamed; a prompt too long for
the room the answer needs is cut nearest the cursor and says so; bad fields are one 400, and a
model without FIM tokens (the demo) a 501."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("starlette", reason="the server's stack is an atlas dependency: pip install .")

from atlas import LLM
from atlas.llm import context_capacity
from atlas.server.app import ServerState, create_app
from atlas.server.infill import fim_tokens
from atlas.server.worker import EngineWorker
from _engine_app import serving
from runtime_checkpoint import FIM_TOKENS, make_tiny_checkpoint
from test_serve import TIMEOUT_S, Served, post
from test_serve import served as served  # noqa: F401  (the demo, which has no FIM tokens)
from test_serve_llama import events

WORDS = ["def", "return", "x", "+", "1", "(", ")", ":", "\n", "    ", "print", "value", "import", "os"]


@pytest.fixture(scope="module")
def fim_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, LLM]]:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"tiny checkpoint seed: {seed}")
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("fim"), seed, extra_special=tuple(FIM_TOKENS))
    worker = EngineWorker(lambda: LLM(str(model_dir), device="cpu"))
    llm = worker.start()
    try:
        with serving(create_app(ServerState("tiny-fim", worker, llm)), TIMEOUT_S) as port:
            yield port, LLM(str(model_dir), device="cpu")
    finally:
        worker.stop()


def code(rng: np.random.Generator, words: int) -> str:
    return "".join(rng.choice(WORDS, size=words))


def fim_ids(reference: LLM, request: dict[str, Any]) -> list[int]:
    """The repo-level FIM prompt of a request, built here from its parts."""
    vocab = reference.tokenizer.backend.token_to_id
    encode = lambda text: reference.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    ids = [vocab("<|repo_name|>"), *encode("myproject\n")]
    for chunk in request.get("input_extra", []):
        ids += [vocab("<|file_sep|>"), *encode(chunk["filename"] + "\n"), *encode(chunk["text"])]
    return [*ids, vocab("<|file_sep|>"), *encode("filename\n"), vocab("<|fim_prefix|>"), *encode(request["input_prefix"]),
            vocab("<|fim_suffix|>"), *encode(request["input_suffix"]), vocab("<|fim_middle|>"), *encode(request["prompt"])]


def random_request(rng: np.random.Generator) -> dict[str, Any]:
    extra = [{"filename": f"m{i}.py", "text": code(rng, int(rng.integers(1, 12)))} for i in range(int(rng.integers(0, 3)))]
    return {"input_prefix": code(rng, int(rng.integers(1, 16))), "input_suffix": code(rng, int(rng.integers(0, 16))),
            "prompt": code(rng, int(rng.integers(0, 3))), "input_extra": extra, "n_predict": int(rng.integers(1, 12)),
            "return_tokens": True, "temperature": 0}


def test_the_infill_prompt_is_the_repo_level_fim_pattern(fim_served: tuple[int, LLM], rng: np.random.Generator) -> None:
    port, reference = fim_served
    request = random_request(rng)
    ids = fim_ids(reference, request)
    want = reference.generate(ids, max_tokens=request["n_predict"], temperature=0)
    status, answer = post(port, "/infill", json.dumps(request))
    assert status == 200, answer
    assert (answer["content"], answer["tokens"]) == (want.text, want.token_ids)
    assert answer["tokens_evaluated"] == len(ids) and answer["truncated"] is False
    assert answer["prompt"] == reference.tokenizer.decode(ids, skip_special_tokens=False)
    streamed = events_at(port, request)
    assert "".join(e["content"] for e in streamed) == want.text and streamed[-1]["stop"] is True


def events_at(port: int, request: dict[str, Any]) -> list[dict[str, Any]]:
    return events(port, request | {"stream": True}, "/infill")


def test_a_long_infill_is_cut_nearest_the_cursor(fim_served: tuple[int, LLM], rng: np.random.Generator) -> None:
    port, reference = fim_served
    capacity = context_capacity(reference.parts.spec, reference.parts.engine)
    n_predict = capacity - int(rng.integers(40, 80))  # leaves the prompt 40..79 tokens
    request = {"input_prefix": code(rng, 300), "input_suffix": code(rng, 300), "prompt": "",
               "input_extra": [{"filename": "big.py", "text": code(rng, 300)}], "n_predict": n_predict, "temperature": 0}
    status, answer = post(port, "/infill", json.dumps(request))
    assert status == 200, answer
    assert answer["truncated"] is True and answer["tokens_evaluated"] <= capacity - n_predict
    kept = re.fullmatch(r"(.*)<\|fim_prefix\|>(.*)<\|fim_suffix\|>(.*)<\|fim_middle\|>", answer["prompt"], re.DOTALL)
    assert kept, answer["prompt"]
    extra, prefix, suffix = kept.groups()
    assert prefix and request["input_prefix"].endswith(prefix) and request["input_suffix"].startswith(suffix)
    assert extra.endswith("<|file_sep|>filename\n")  # the cut extra files (if any is left) come before it
    assert len(reference.tokenizer.encode(prefix, add_special_tokens=False)) >= 3 * len(
        reference.tokenizer.encode(suffix, add_special_tokens=False)) - 3  # the prefix has 3/4 of the room


@pytest.mark.parametrize("field, value, named", [
    ("input_prefix", 7, "input_prefix"), ("input_suffix", ["x"], "input_suffix"), ("prompt", {"a": 1}, "prompt"),
    ("input_extra", "x", "input_extra"), ("input_extra", [{"filename": "a.py"}], "input_extra"),
    ("input_extra", [{"text": "x", "filename": 3}], "input_extra"), ("n_predict", 0, "n_predict"),
    ("mirostat", 3, "mirostat"), ("tfs_z", 0.5, "tfs_z"),
])
def test_a_bad_infill_field_is_one_400(fim_served: tuple[int, LLM], field: str, value: Any, named: str) -> None:
    port, _ = fim_served
    status, answer = post(port, "/infill", json.dumps({"input_prefix": "def f(", "input_suffix": "", field: value}))
    assert status == 400 and answer["error"]["param"] == named, answer
    assert post(port, "/infill", json.dumps({"input_prefix": "x", "n_predict": 2}))[0] == 200  # the server goes on


def test_a_model_without_fim_tokens_refuses_infill(served: Served) -> None:  # noqa: F811
    assert fim_tokens(served.reference.tokenizer) is None
    status, answer = post(served.port, "/infill", json.dumps({"input_prefix": "Beautiful is", "input_suffix": ""}))
    assert status == 501 and "no fill-in-the-middle tokens" in answer["error"]["message"], answer
    assert answer["error"]["code"] == "not_supported_error"


@pytest.mark.parametrize("batch", [False, True])
def test_openai_completions_suffix_is_the_fim_prompt(fim_served: tuple[int, LLM], rng: np.random.Generator,
                                                     batch: bool) -> None:
    """OpenAI's /v1/completions `suffix`: each text prompt before the insertion point, the suffix
    after it, the answer the middle (/infill's prompt with no other files)."""
    port, reference = fim_served
    prompts = [code(rng, int(rng.integers(1, 16))) for _ in range(2 if batch else 1)]
    suffix, max_tokens = code(rng, int(rng.integers(1, 16))), int(rng.integers(1, 10))
    request = {"prompt": prompts if batch else prompts[0], "suffix": suffix, "max_tokens": max_tokens, "temperature": 0}
    status, answer = post(port, "/v1/completions", json.dumps(request))
    assert status == 200, answer
    wants = [reference.generate(fim_ids(reference, {"input_prefix": p, "input_suffix": suffix, "prompt": ""}),
                                max_tokens=max_tokens, temperature=0) for p in prompts]
    assert [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])] == [w.text for w in wants]
    assert answer["usage"]["completion_tokens"] == sum(len(w.token_ids) for w in wants)


@pytest.mark.parametrize("change, named, status", [
    ({"suffix": 3}, "suffix", 400), ({"prompt": [5, 6, 7]}, "prompt", 400), ({"echo": True}, "echo", 400),
])
def test_a_bad_completions_suffix_is_one_line(fim_served: tuple[int, LLM], change: dict[str, Any], named: str,
                                              status: int) -> None:
    port, _ = fim_served
    got, answer = post(port, "/v1/completions", json.dumps({"prompt": "def f(", "suffix": "):", "max_tokens": 2} | change))
    assert got == status and answer["error"]["param"] == named and "\n" not in answer["error"]["message"], answer


def test_a_model_without_fim_tokens_refuses_a_completions_suffix(served: Served) -> None:  # noqa: F811
    status, answer = post(served.port, "/v1/completions", json.dumps({"prompt": "Beautiful is", "suffix": "ugly."}))
    assert status == 501 and "no fill-in-the-middle tokens" in answer["error"]["message"], answer
    status, answer = post(served.port, "/v1/completions", json.dumps({"prompt": "Beautiful is", "suffix": "", "max_tokens": 2}))
    assert status == 200, answer  # an empty suffix asks for nothing


def test_fim_tokens_need_prefix_suffix_and_middle(tmp_path: Path) -> None:
    from atlas.tokenizer import Tokenizer
    from runtime_checkpoint import train_tokenizer

    train_tokenizer(tmp_path, extra_special=("<|fim_prefix|>", "<|fim_suffix|>"))
    assert fim_tokens(Tokenizer.open(tmp_path)) is None
    train_tokenizer(tmp_path, extra_special=("<fim_prefix>", "<fim_middle>", "<fim_suffix>"))  # StarCoder's: no repo tokens
    found = fim_tokens(Tokenizer.open(tmp_path))
    assert found is not None and found.repo is None and found.file_sep is None
