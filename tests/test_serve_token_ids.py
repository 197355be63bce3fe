"""vLLM's return_token_ids (the prompt's ids and each choice's generated ids beside the text, in
the first chunk and per chunk when streamed) and return_tokens_as_token_ids (logprobs name each
token "token_id:<id>"), against the in-process model's ids."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from atlas.demo import DEMO_NAME
from test_serve import Served, post, random_prompt
from test_serve import served as served  # noqa: F401  (the module-scoped server)


def sampled(rng: np.random.Generator) -> dict[str, Any]:
    """Random settings: greedy or seeded sampling, sometimes a stop string."""
    settings: dict[str, Any] = {"max_tokens": int(rng.integers(1, 40)), "temperature": float(rng.choice([0.0, 0.8])),
                                "seed": int(rng.integers(0, 1000))}
    if rng.random() < 0.5:
        settings["stop"] = [str(rng.choice(["is", "e", " better"]))]
    return settings


@pytest.mark.parametrize("stream", [False, True])
def test_completion_token_ids(served: Served, rng: np.random.Generator, stream: bool) -> None:
    prompt, settings = random_prompt(rng), sampled(rng)
    want = served.reference.generate(prompt, **settings)
    answer = served.client().completions.create(model=DEMO_NAME, prompt=prompt, stream=stream,
                                                extra_body={"return_token_ids": True}, **settings)
    choices = [c.model_dump()["choices"][0] for c in (answer if stream else [answer])]
    assert "".join(c["text"] for c in choices) == want.text
    assert [t for c in choices for t in c["token_ids"]] == want.token_ids  # the one that completes a stop too
    assert choices[0]["prompt_token_ids"] == served.reference.tokenizer.encode(prompt)
    assert all("prompt_token_ids" not in c for c in choices[1:])  # streamed: the first chunk alone


@pytest.mark.parametrize("stream", [False, True])
def test_chat_token_ids(served: Served, rng: np.random.Generator, stream: bool) -> None:
    messages, settings = [{"role": "user", "content": random_prompt(rng)}], sampled(rng)
    prompt_ids = served.reference.tokenizer.encode_chat(messages)
    want = served.reference.generate(prompt_ids, **settings)
    answer = served.client().chat.completions.create(model=DEMO_NAME, messages=messages, stream=stream,
                                                     extra_body={"return_token_ids": True}, **settings)
    bodies = [c.model_dump() for c in (answer if stream else [answer])]
    choices = [b["choices"][0] for b in bodies]
    if stream:
        assert "".join(c["delta"]["content"] or "" for c in choices) == want.text
    else:
        assert choices[0]["message"]["content"] == want.text
    assert [t for c in choices for t in c.get("token_ids") or []] == want.token_ids
    assert bodies[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in b for b in bodies[1:])


def test_tokens_as_token_ids(served: Served, rng: np.random.Generator) -> None:
    """Logprobs with return_tokens_as_token_ids: the same entries, each token (and each top one)
    written "token_id:<id>"; completions' text_offset still counts the text."""
    prompt, top = random_prompt(rng), int(rng.integers(1, 5))
    client = served.client()
    named = client.completions.create(model=DEMO_NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=top,
                                      extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    plain = client.completions.create(model=DEMO_NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=top)
    ids = named.choices[0].model_dump()["token_ids"]
    assert named.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert named.choices[0].logprobs.token_logprobs == plain.choices[0].logprobs.token_logprobs
    assert named.choices[0].logprobs.text_offset == plain.choices[0].logprobs.text_offset
    for named_top, plain_top in zip(named.choices[0].logprobs.top_logprobs, plain.choices[0].logprobs.top_logprobs):
        assert all(key.startswith("token_id:") for key in named_top)
        assert sorted(named_top.values()) == sorted(plain_top.values())  # distinct ids, where texts may coincide
    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(model=DEMO_NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=top, extra_body={"return_tokens_as_token_ids": True})
    want = served.reference.generate(served.reference.tokenizer.encode_chat(messages), max_tokens=6, logprobs=top)
    entries = chat.choices[0].logprobs.content
    assert [e.token for e in entries] == [f"token_id:{t}" for t in want.token_ids]
    assert all(e.bytes == list(e.token.encode()) for e in entries)
    assert [[t.token for t in e.top_logprobs] for e in entries] == [[f"token_id:{i}" for i, _ in w.top] for w in want.logprobs]


def test_no_token_ids_unless_asked(served: Served) -> None:
    answer = served.client().completions.create(model=DEMO_NAME, prompt="Flat is", max_tokens=2).model_dump()
    assert not {"token_ids", "prompt_token_ids"} & set(answer["choices"][0])
    for field in ("return_token_ids", "return_tokens_as_token_ids"):
        status, body = post(served.port, "/v1/completions",
                            f'{{"model": "{DEMO_NAME}", "prompt": "Flat", "max_tokens": 2, "{field}": "yes"}}')
        assert status == 400 and body["error"]["param"] == field
