"""llama.cpp's own API (/completion, /props): llama-server's request fields answered with what
atlas's in-process model generates for the same settings, in llama-server's shape."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("starlette", reason="the server's stack is an atlas dependency: pip install .")

from atlas import LLM
from atlas.demo import DEMO_NAME
from atlas.server.app import ServerState, create_app
from atlas.server.worker import EngineWorker
from test_serve import HOST, TIMEOUT_S, Served, get_json, post, random_prompt
from test_serve import served as served  # noqa: F401  (the module-scoped server)


def events(port: int, body: dict[str, Any], path: str = "/completion") -> list[dict[str, Any]]:
    """A streamed /completion's (or /infill's) `data:` events, in order."""
    conn = http.client.HTTPConnection(HOST, port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("content-type", "").startswith("text/event-stream")
        lines = response.read().decode().split("\n\n")
    finally:
        conn.close()
    assert lines[-1] == "" and all(line.startswith("data: ") for line in lines[:-1]), lines
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_a_completion_is_the_models_own(served: Served, rng: np.random.Generator) -> None:
    """Greedy or seeded sampling (llama.cpp's names: n_predict, repeat_penalty), the generated
    ids (return_tokens), per-token probabilities (n_probs) and the stop, as generate() has them."""
    prompt, n_predict, n_probs = random_prompt(rng), int(rng.integers(1, 24)), int(rng.integers(1, 4))
    sampled = {"temperature": float(rng.choice([0.0, 0.8])), "seed": int(rng.integers(1000)), "top_k": int(rng.integers(0, 8)),
               "repetition_penalty": float(rng.choice([1.0, 1.3]))}
    want = served.reference.generate(prompt, max_tokens=n_predict, logprobs=n_probs, **sampled)
    llama = {k: v for k, v in sampled.items() if k != "repetition_penalty"} | {"repeat_penalty": sampled["repetition_penalty"]}
    status, answer = post(served.port, "/completion", json.dumps({"prompt": prompt, "n_predict": n_predict, "n_probs": n_probs,
                                                                  "return_tokens": True, "cache_prompt": True, **llama}))
    assert status == 200, answer
    assert (answer["content"], answer["tokens"]) == (want.text, want.token_ids)
    assert answer["stop"] is True and answer["stop_type"] == ("eos" if want.finish_reason == "stop" else "limit")
    assert answer["tokens_predicted"] == len(want.token_ids) == answer["timings"]["predicted_n"]
    prompt_ids = served.reference.tokenizer.encode(prompt)
    assert answer["tokens_evaluated"] == len(prompt_ids) == answer["timings"]["prompt_n"] + answer["timings"]["cache_n"]
    assert answer["prompt"] == served.reference.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    probabilities = answer["completion_probabilities"]
    assert [p["id"] for p in probabilities] == want.token_ids
    for listed, scored in zip(probabilities, want.logprobs or [], strict=True):
        assert listed["logprob"] == pytest.approx(scored.logprob, abs=1e-6)
        assert [t["id"] for t in listed["top_logprobs"]] == [t for t, _ in scored.top[:n_probs]]


def test_a_stream_is_the_whole_answer_in_pieces(served: Served, rng: np.random.Generator) -> None:
    body = {"prompt": random_prompt(rng), "n_predict": int(rng.integers(2, 20)), "temperature": 0, "stream": True}
    streamed = events(served.port, body)
    _, whole = post(served.port, "/completion", json.dumps(body | {"stream": False}))
    assert [e["stop"] for e in streamed] == [False] * (len(streamed) - 1) + [True]
    assert "".join(e["content"] for e in streamed) == whole["content"]
    counts = [e["tokens_predicted"] for e in streamed]
    assert counts == sorted(counts) and counts[-1] == whole["tokens_predicted"]
    assert {k: v for k, v in streamed[-1].items() if k not in ("content", "timings", "tokens")} == \
        {k: v for k, v in whole.items() if k not in ("content", "timings", "tokens", "has_new_line")}


def test_stop_words_and_banned_tokens(served: Served, rng: np.random.Generator) -> None:
    """A stop string ends it (stop_type word, the word named); logit_bias [[id, false]] bans an id."""
    prompt = random_prompt(rng)
    free = served.reference.generate(prompt, max_tokens=12, temperature=0)
    word = free.text.split()[int(rng.integers(len(free.text.split())))] if free.text.split() else "is"
    _, answer = post(served.port, "/completion", json.dumps({"prompt": prompt, "n_predict": 12, "temperature": 0,
                                                             "stop": [word]}))
    want = served.reference.generate(prompt, max_tokens=12, temperature=0, stop=[word])
    assert answer["content"] == want.text
    assert (answer["stop_type"], answer["stopping_word"]) == (("word", word) if want.stop_reason == word else
                                                              ("eos" if want.finish_reason == "stop" else "limit", ""))
    _, banned = post(served.port, "/completion", json.dumps({"prompt": prompt, "n_predict": 1, "temperature": 0,
                                                             "return_tokens": True,
                                                             "logit_bias": [[free.token_ids[0], False]]}))
    assert banned["tokens"] and banned["tokens"][0] != free.token_ids[0]


def seed_the_filters_change(reference: Any, prompt: str, filters: dict[str, Any], rng: np.random.Generator,
                            required: bool, tries: int = 8) -> tuple[int, Any]:
    """(seed, generate()'s answer with `filters` at temperature 1.5) for a seed on which the answer
    differs from the one without them, so a server that dropped them is caught. The demo model is
    sure of most tokens, so on some seeds a filter changes no draw (seen: mirostat, CI)."""
    for _ in range(tries):
        seed = int(rng.integers(1 << 20))
        run = dict(max_tokens=16, temperature=1.5, seed=seed, ignore_eos=True)
        want = reference.generate(prompt, **run, **filters)
        if not required or want.token_ids != reference.generate(prompt, **run).token_ids:
            return seed, want
    raise AssertionError(f"{filters} changed no answer in {tries} seeds: not applied?")


def test_llama_cpps_samplers_pick_as_generate_does(served: Served, rng: np.random.Generator) -> None:
    """typical_p, top_n_sigma, XTC, mirostat and dynatemp on /completion and /v1/completions (atlas.sampling_filters):
    the seeded answer is generate()'s with the same settings; XTC at threshold 0 (the least likely
    token each step) shows they are applied, as the demo model is sure of most tokens."""
    prompt = random_prompt(rng)
    least_likely = {"xtc_probability": 1.0, "xtc_threshold": 0.0}
    mixed = {"typical_p": float(rng.uniform(0.2, 0.9)), "top_n_sigma": float(rng.uniform(0.5, 4)),
             "xtc_probability": 0.5, "xtc_threshold": float(rng.uniform(0.05, 0.3))}
    mirostat = {"mirostat": int(rng.integers(1, 3)), "mirostat_tau": float(rng.uniform(1, 5)), "mirostat_eta": 0.2}
    dynatemp = {"dynatemp_range": float(rng.uniform(0.2, 1.2)), "dynatemp_exponent": float(rng.uniform(0.5, 2))}
    for filters in (least_likely, mixed, mirostat, dynatemp):
        seed, want = seed_the_filters_change(served.reference, prompt, filters, rng, required=filters is not mixed)
        body = {"prompt": prompt, "temperature": 1.5, "seed": seed, "ignore_eos": True, "return_tokens": True, **filters}
        status, answer = post(served.port, "/completion", json.dumps(body | {"n_predict": 16}))
        assert status == 200 and answer["tokens"] == want.token_ids, answer
        completion = served.client().completions.create(model=DEMO_NAME, prompt=prompt, max_tokens=16, temperature=1.5,
                                                        seed=seed, extra_body={"ignore_eos": True, **filters})
        assert completion.choices[0].text == want.text
    params = get_json(served.port, "/props")["default_generation_settings"]["params"]
    assert (params["typical_p"], params["top_n_sigma"], params["xtc_probability"]) == (1.0, -1.0, 0.0)
    assert (params["dry_multiplier"], params["dry_sequence_breakers"]) == (0.0, ["\n", ":", '"', "*"])
    assert (params["mirostat"], params["mirostat_tau"], params["mirostat_eta"]) == (0, 5.0, 0.1)


def test_dry_on_completion_is_generates(served: Served, rng: np.random.Generator) -> None:
    """llama.cpp's DRY fields on /completion (greedy: DRY applies there too) and on /v1/completions."""
    from test_sampling_filters import ZEN_TWICE

    dry = {"dry_multiplier": float(rng.uniform(1, 4)), "dry_base": float(rng.uniform(1.2, 2)),
           "dry_allowed_length": int(rng.integers(1, 4)), "dry_penalty_last_n": int(rng.choice([-1, 64])),
           "dry_sequence_breakers": [":", "*"]}
    want = served.reference.generate(ZEN_TWICE, max_tokens=12, ignore_eos=True, **dry)
    assert want.token_ids != served.reference.generate(ZEN_TWICE, max_tokens=12, ignore_eos=True).token_ids
    body = {"prompt": ZEN_TWICE, "n_predict": 12, "temperature": 0, "ignore_eos": True, "return_tokens": True, **dry}
    status, answer = post(served.port, "/completion", json.dumps(body))
    assert status == 200 and answer["tokens"] == want.token_ids, answer
    completion = served.client().completions.create(model=DEMO_NAME, prompt=ZEN_TWICE, max_tokens=12, temperature=0,
                                                    extra_body={"ignore_eos": True, **dry})
    assert completion.choices[0].text == want.text


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Flat", "mirostat": 3}, "mirostat"),
    ({"prompt": "Flat", "mirostat": 2, "mirostat_tau": -1}, "mirostat_tau"),
    ({"prompt": "Flat", "mirostat_eta": "fast"}, "mirostat_eta"),
    ({"prompt": "Flat", "dry_multiplier": -0.8}, "dry_multiplier"),
    ({"prompt": "Flat", "dry_base": 0.5}, "dry_base"),
    ({"prompt": "Flat", "dry_allowed_length": 1.5}, "dry_allowed_length"),
    ({"prompt": "Flat", "dry_penalty_last_n": -2}, "dry_penalty_last_n"),
    ({"prompt": "Flat", "dry_sequence_breakers": "\n"}, "dry_sequence_breakers"),
    ({"prompt": "Flat", "dry_sequence_breakers": [""]}, "dry_sequence_breakers"),
    ({"prompt": "Flat", "dynatemp_range": -0.5}, "dynatemp_range"),
    ({"prompt": "Flat", "tfs_z": 0.5}, "tfs_z"),
    ({"prompt": "Flat", "typical_p": 0}, "typical_p"),
    ({"prompt": "Flat", "top_n_sigma": "2"}, "top_n_sigma"),
    ({"prompt": "Flat", "xtc_probability": 1.5}, "xtc_probability"),
    ({"prompt": "Flat", "xtc_threshold": -0.1}, "xtc_threshold"),
    ({"prompt": "Flat", "n_predict": 0}, "n_predict"),
    ({"prompt": "Flat", "n_predict": "8"}, "n_predict"),
    ({"prompt": "Flat", "n_probs": 50}, "n_probs"),
    ({"prompt": ["Flat", "Sparse"]}, "prompt"),
    ({"prompt": "Flat", "logit_bias": [["Flat", 1.0]]}, "logit_bias"),
    ({"prompt": "Flat", "repeat_penalty": 1.1, "repeat_last_n": 64}, "repeat_last_n"),
    ({"prompt": "Flat", "return_tokens": "yes"}, "return_tokens"),
    ({"prompt": "Flat", "temperature": -1}, "temperature"),
    ({"n_predict": 4}, "prompt"),
    ({"prompt": "Flat", "n_predict": 10**6}, "n_predict"),
    ({"prompt": "Flat", "repeat_penalty": 0}, "repeat_penalty"),
])  # fmt: skip
def test_bad_requests_are_one_400(served: Served, body: dict[str, Any], param: str) -> None:
    status, answer = post(served.port, "/completion", json.dumps(body))
    assert status == 400 and answer["error"]["param"] == param and "\n" not in answer["error"]["message"], answer


def test_tokenize_and_detokenize_as_llama_cpp_names_them(served: Served, rng: np.random.Generator) -> None:
    """llama.cpp's /tokenize body (`content`, `with_pieces`, `add_special`) and /detokenize's `content`."""
    tokenizer = served.reference.tokenizer
    text = random_prompt(rng) + " <|im_end|>"  # a special token's text is read as the token
    status, body = post(served.port, "/tokenize", json.dumps({"content": text}))
    assert status == 200 and body["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    _, pieces = post(served.port, "/tokenize", json.dumps({"content": text, "with_pieces": True, "add_special": True}))
    assert [p["id"] for p in pieces["tokens"]] == tokenizer.encode(text)
    assert "".join(p["piece"] for p in pieces["tokens"]) == tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False)
    _, back = post(served.port, "/detokenize", json.dumps({"tokens": body["tokens"]}))
    assert back["content"] == back["prompt"] == tokenizer.decode(body["tokens"])
    for bad, param in (({"content": 5}, "content"), ({"content": "x", "with_pieces": "yes"}, "with_pieces"),
                       ({"content": "x", "parse_special": False}, "parse_special")):
        status, answer = post(served.port, "/tokenize", json.dumps(bad))
        assert status == 400 and answer["error"]["param"] == param, answer


@pytest.fixture(scope="module")
def short_context() -> Iterator[tuple[Any, LLM]]:
    from starlette.testclient import TestClient

    worker = EngineWorker(lambda: LLM(None, device="cpu", max_seq_len=40))
    llm = worker.start()
    try:
        defaults = {"temperature": 0.6, "top_k": 20}  # as a model's generation_config gives them
        yield TestClient(create_app(ServerState(DEMO_NAME, worker, llm, sampling_defaults=defaults))), llm
    finally:
        worker.stop()


def test_no_n_predict_runs_to_the_end_of_the_context(short_context: tuple[Any, LLM], rng: np.random.Generator) -> None:
    http, llm = short_context
    prompt = random_prompt(rng)
    answer = http.post("/completion", json={"prompt": prompt, "ignore_eos": True, "seed": int(rng.integers(100))}).json()
    room = 40 - len(llm.tokenizer.encode(prompt)) + 1
    assert (answer["tokens_predicted"], answer["stop_type"]) == (room, "limit"), answer


def test_props_names_the_servers_defaults(short_context: tuple[Any, LLM]) -> None:
    http, llm = short_context
    props = http.get("/props").json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 40 == http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert (settings["params"]["temperature"], settings["params"]["top_k"], settings["params"]["n_predict"]) == (0.6, 20, -1)
    assert props["chat_template"] == llm.tokenizer.chat_template and props["total_slots"] == 1


def test_the_served_server_answers_props(served: Served) -> None:
    assert get_json(served.port, "/props")["default_generation_settings"]["n_ctx"] > 0


def test_slots_show_the_one_slot_idle_then_processing(served: Served) -> None:
    """llama.cpp's GET /slots: one slot with the context and /props' default params; while a stream
    runs it is processing, its decoded tokens counted, and ?fail_on_no_slot=1 is a 503."""
    idle = get_json(served.port, "/slots")
    props = get_json(served.port, "/props")["default_generation_settings"]
    assert len(idle) == 1 and idle[0]["id"] == 0 and not idle[0]["is_processing"]
    assert idle[0]["n_ctx"] == props["n_ctx"] and idle[0]["params"] == props["params"]
    served.engine.delay_s = 0.05
    try:
        stream = served.client().completions.create(model=DEMO_NAME, prompt="Beautiful is", max_tokens=200,
                                                     temperature=0, stream=True)
        for _, _ in zip(range(3), stream):  # the job is on the engine now
            pass
        busy = get_json(served.port, "/slots")[0]
        assert busy["is_processing"] and busy["next_token"]["n_decoded"] >= 2, busy
        conn = http.client.HTTPConnection(HOST, served.port, timeout=TIMEOUT_S)
        conn.request("GET", "/slots?fail_on_no_slot=1")
        answer = conn.getresponse()
        assert answer.status == 503 and json.loads(answer.read())["error"]["code"] == "unavailable"
        conn.close()
        stream.close()
    finally:
        served.engine.delay_s = 0.0
