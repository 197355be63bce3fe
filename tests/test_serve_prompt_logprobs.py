"""vLLM's prompt_logprobs on /v1/completions (per choice) and /v1/chat/completions (beside the
choices): per prompt token after the first, the token's own entry (its log-probability and its
rank among the row's logits) and the N most likely (ranks 1..N), as the in-process model scores
them; the answer itself unchanged."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from atlas.demo import DEMO_NAME
from test_logprobs import log_softmax
from test_serve import Served, random_prompt, token_text
from test_serve import served as served  # noqa: F401  (the module-scoped server)


def check_prompt_logprobs(served: Served, listed: list[dict[str, Any] | None], prompt_ids: list[int], top: int) -> None:
    """listed against the reference's scores of prompt_ids, and each rank against a log-softmax of
    the teacher-forced logits (near ties either way)."""
    want = served.reference.generate(prompt_ids, max_tokens=1, temperature=0, prompt_logprobs=top).prompt_logprobs
    assert want is not None and listed[0] is None and len(listed) == len(prompt_ids)
    forced = log_softmax(np.asarray(served.reference.parts.engine.logits(prompt_ids)))  # [P, V]
    for p, (token, row, w) in enumerate(zip(prompt_ids[1:], listed[1:], want[1:], strict=True)):
        assert row is not None
        tops = [t for t, _ in w.top]
        assert list(row) == list(dict.fromkeys(str(t) for t in [token, *tops]))  # the token first, then the top ones
        for rank, (t, logprob) in enumerate(w.top, start=1):
            assert row[str(t)] == {"logprob": pytest.approx(logprob, abs=1e-5), "rank": rank,
                                   "decoded_token": token_text(served, t)}
        entry = row[str(token)]
        assert entry["logprob"] == pytest.approx(forced[p, token], abs=1e-4)
        assert entry["decoded_token"] == token_text(served, token)
        if token not in tops:
            near = forced[p] - forced[p, token]  # [V]
            assert entry["rank"] == w.rank and 1 + (near > 1e-4).sum() <= entry["rank"] <= (near >= -1e-4).sum()


def test_completions_carry_each_prompts_logprobs(served: Served, rng: np.random.Generator) -> None:
    """A batch of two prompts, two choices each: every choice has its own prompt's list (scored
    once per prompt: the second choice takes the first's), and the texts are what the model writes
    without them."""
    prompts = [random_prompt(rng) + " " + random_prompt(rng) for _ in range(2)]
    top = int(rng.integers(0, 6))
    answer = served.client().completions.create(model=DEMO_NAME, prompt=prompts, max_tokens=4, temperature=0, n=2,
                                                extra_body={"prompt_logprobs": top}).model_dump()
    assert len(answer["choices"]) == 4
    for choice in answer["choices"]:
        prompt = prompts[choice["index"] // 2]
        assert choice["text"] == served.reference.generate(prompt, max_tokens=4).text
        check_prompt_logprobs(served, choice["prompt_logprobs"], served.reference.tokenizer.encode(prompt), top)


def test_chat_carries_the_prompts_logprobs(served: Served, rng: np.random.Generator) -> None:
    messages = [{"role": "user", "content": random_prompt(rng)}]
    top = int(rng.integers(1, 6))
    answer = served.client().chat.completions.create(model=DEMO_NAME, messages=messages, max_tokens=3, temperature=0,
                                                     extra_body={"prompt_logprobs": top}).model_dump()
    check_prompt_logprobs(served, answer["prompt_logprobs"], served.reference.tokenizer.encode_chat(messages), top)
    assert "prompt_logprobs" not in answer["choices"][0]


def test_echo_keeps_its_own_alternatives(served: Served, rng: np.random.Generator) -> None:
    """echo + logprobs 1 beside prompt_logprobs 4: the echoed prompt's entries list one alternative,
    prompt_logprobs four."""
    prompt = random_prompt(rng) + " " + random_prompt(rng)
    answer = served.client().completions.create(model=DEMO_NAME, prompt=prompt, max_tokens=2, temperature=0, echo=True,
                                                logprobs=1, extra_body={"prompt_logprobs": 4}).model_dump()
    choice = answer["choices"][0]
    prompt_ids = served.reference.tokenizer.encode(prompt)
    assert all(len(t) <= 1 for t in choice["logprobs"]["top_logprobs"][1:])
    assert choice["logprobs"]["token_logprobs"][1 : len(prompt_ids)] == [
        pytest.approx(row[str(t)]["logprob"]) for t, row in zip(prompt_ids[1:], choice["prompt_logprobs"][1:], strict=True)
    ]
    check_prompt_logprobs(served, choice["prompt_logprobs"], prompt_ids, 4)


def test_no_prompt_logprobs_unless_asked(served: Served) -> None:
    """Not asked, or asked for 0 in a stream (vLLM's "nothing" there): none come back."""
    answer = served.client().completions.create(model=DEMO_NAME, prompt="Flat is", max_tokens=2).model_dump()
    assert "prompt_logprobs" not in answer["choices"][0]
    chunks = served.client().completions.create(model=DEMO_NAME, prompt="Flat is", max_tokens=2, stream=True,
                                                extra_body={"prompt_logprobs": 0})
    assert all("prompt_logprobs" not in c.model_dump()["choices"][0] for c in chunks)
    chat = served.client().chat.completions.create(model=DEMO_NAME, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=2).model_dump()
    assert "prompt_logprobs" not in chat
