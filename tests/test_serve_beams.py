"""vLLM's use_beam_search on /v1/completions and /v1/chat/completions: the n choices are the n best
beams of atlas.beam_search on the same prompt, whole or streamed, with the usage they make up."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from typing import Any

import numpy as np
import pytest

from atlas.demo import DEMO_NAME
from atlas.sampling_params import BeamSearchParams
from test_serve import Served, leave_while_waiting, post, random_prompt
from test_serve import served as served  # noqa: F401  (the module-scoped server)


def searched(served: Served, prompt: str | list[int], width: int, max_tokens: int, penalty: float = 1.0) -> list[Any]:
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=penalty)
    return served.reference.beam_search(prompt, params)[0].sequences


def test_completion_choices_are_the_best_beams(served: Served, rng: np.random.Generator) -> None:
    prompt, width, max_tokens = random_prompt(rng), int(rng.integers(2, 5)), int(rng.integers(2, 10))
    penalty = float(rng.choice([0.5, 1.0, 2.0]))
    answer = served.client().completions.create(
        model=DEMO_NAME, prompt=prompt, n=width, max_tokens=max_tokens, temperature=0,
        extra_body={"use_beam_search": True, "length_penalty": penalty})
    beams = searched(served, prompt, width, max_tokens, penalty)
    assert [c.text for c in answer.choices] == [b.text for b in beams]
    assert [c.finish_reason for c in answer.choices] == [b.finish_reason for b in beams]
    start = len(served.reference.tokenizer.encode(prompt))
    assert answer.usage.completion_tokens == sum(len(b.tokens) - start for b in beams)


def test_streamed_chat_choices_are_the_best_beams(served: Served, rng: np.random.Generator) -> None:
    messages = [{"role": "user", "content": random_prompt(rng)}]
    width, max_tokens = int(rng.integers(2, 4)), int(rng.integers(2, 10))
    stream = served.client().chat.completions.create(
        model=DEMO_NAME, messages=messages, n=width, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"use_beam_search": True})
    texts: dict[int, str] = defaultdict(str)
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    beams = searched(served, served.reference.tokenizer.encode_chat(messages), width, max_tokens)
    assert [texts[i] for i in range(width)] == [b.text for b in beams]


@pytest.mark.parametrize("extra, param", [
    ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
    ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
    ({"use_beam_search": True, "stop": ["is"]}, "stop"),
    ({"use_beam_search": True, "n": 11}, "n"),
    ({"use_beam_search": "yes"}, "use_beam_search"),
    ({"length_penalty": 2.0}, "length_penalty"),
    ({"use_beam_search": True, "max_tokens": 513}, "max_tokens"),
])  # fmt: skip
def test_what_beam_search_would_ignore_is_refused(served: Served, extra: dict[str, Any], param: str) -> None:
    status, body = post(served.port, "/v1/completions", json.dumps({"model": DEMO_NAME, "prompt": "Flat is", **extra}))
    assert status == 400 and body["error"]["param"] == param, body


def test_a_chat_beam_search_needs_its_length(served: Served) -> None:
    """A chat's default length is the rest of the context: a search that long would hold the engine."""
    chat = {"model": DEMO_NAME, "messages": [{"role": "user", "content": "Flat"}], "use_beam_search": True}
    status, body = post(served.port, "/v1/chat/completions", json.dumps(chat))
    assert status == 400 and body["error"]["param"] == "max_tokens" and "at most 512" in body["error"]["message"], body


def test_a_client_that_leaves_stops_its_search(served: Served) -> None:
    """A 512-token search of 4 beams runs for minutes here; the client giving up stops it between
    steps, so the next request is answered at once."""
    leave_while_waiting(served, "Beautiful is", n=4, max_tokens=512, use_beam_search=True, ignore_eos=True)
    began = time.monotonic()
    answer = served.client().completions.create(model=DEMO_NAME, prompt="Flat is", max_tokens=3, temperature=0)
    assert answer.choices[0].text and time.monotonic() - began < 10.0
