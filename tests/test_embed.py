"""Embeddings (atlas.embed): LLM.embed's vectors are the engine's pooled final hidden state
(transformers' last_hidden_state: tests/test_oracle.py), normalised; the same prompt gives the same
vector fresh or resumed from the prompt cache; and the server's /v1/embeddings (the openai client,
float and base64) and llama.cpp's /embedding send those vectors, with one 400 line per bad field."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from atlas import LLM, PoolingParams
from atlas.demo import DEMO_NAME
from atlas.errors import AtlasError
from test_serve import Served, post, random_prompt
from test_serve import served as served  # noqa: F401  (the module-scoped server)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, device="cpu")


def raw_vector(llm: LLM, prompt: str, pooling: str = "last") -> np.ndarray:
    """The pooled vector from a fresh engine state (the prompt cache forgotten first)."""
    llm.reset_prefix_cache()
    return llm.parts.engine.pooled(llm.tokenizer.encode(prompt), pooling).astype(np.float64)  # [H]


def test_embed_is_the_normalised_pooled_state(llm: LLM, rng: np.random.Generator) -> None:
    prompts = [random_prompt(rng) for _ in range(3)]
    pooling = str(rng.choice(["last", "mean"]))
    outputs = llm.embed(prompts, PoolingParams(pooling=pooling))
    assert [o.prompt_token_ids for o in outputs] == [llm.tokenizer.encode(p) for p in prompts]
    for prompt, output in zip(prompts, outputs, strict=True):
        raw = raw_vector(llm, prompt, pooling)
        assert output.outputs.hidden_size == llm.parts.spec.hidden_size and output.finished
        np.testing.assert_allclose(output.outputs.embedding, raw / np.linalg.norm(raw), rtol=1e-5, atol=1e-7)
    unnormalised = llm.embed({"prompt": prompts[0]}, PoolingParams(pooling=pooling, normalize=False))[0]
    np.testing.assert_allclose(unnormalised.outputs.embedding, raw_vector(llm, prompts[0], pooling), rtol=1e-6)


def test_last_pooling_resumes_from_the_prompt_cache_unchanged(llm: LLM, rng: np.random.Generator) -> None:
    """A generation on the prompt leaves a checkpoint; the embedding resumes there (a full hit)
    and gives the fresh state's vector; mean pooling starts fresh and differs from last."""
    prompt = random_prompt(rng)
    fresh = raw_vector(llm, prompt)
    llm.generate(prompt, max_tokens=int(rng.integers(1, 6)))
    resumed = llm.embed(prompt, PoolingParams(normalize=False))[0].outputs.embedding
    np.testing.assert_allclose(resumed, fresh, rtol=1e-6)
    assert llm.parts.engine.prompt_cache.last_hit == len(llm.tokenizer.encode(prompt))
    assert not np.allclose(raw_vector(llm, prompt + " better", "mean"), raw_vector(llm, prompt + " better"))


def test_truncation_and_token_id_prompts(llm: LLM, rng: np.random.Generator) -> None:
    ids = llm.tokenizer.encode(random_prompt(rng) + " " + random_prompt(rng))
    keep = int(rng.integers(1, len(ids) + 1))
    cut = llm.embed({"prompt_token_ids": ids}, truncate_prompt_tokens=keep)[0]
    assert cut.prompt_token_ids == ids[-keep:]
    assert cut.outputs.embedding == llm.embed([ids[-keep:]])[0].outputs.embedding


@pytest.mark.parametrize("params, match", [
    (PoolingParams(pooling="cls"), "pooling must be one of last, mean"),
    (PoolingParams(dimensions=3), "dimensions 3: this model embeds in its hidden size"),
    (PoolingParams(normalize="yes"), "normalize must be True or False"),  # type: ignore[arg-type]
    ({"normalize": True}, "pooling_params must be an atlas.PoolingParams"),
])  # fmt: skip
def test_bad_pooling_params_are_one_line(llm: LLM, params: Any, match: str) -> None:
    with pytest.raises(AtlasError, match=match) as err:
        llm.embed("Flat is", params)
    assert "\n" not in str(err.value)


def test_a_prompt_past_the_context_is_refused(llm: LLM) -> None:
    with pytest.raises(AtlasError, match="exceed") as err:
        llm.embed([[1] * (llm.parts.engine.max_seq_len + 1)])
    assert "\n" not in str(err.value)


# --- the server -------------------------------------------------------------------------------
def expected_vectors(served: Served, prompts: list[str], normalize: bool = True) -> np.ndarray:
    outputs = served.reference.embed(prompts, PoolingParams(normalize=normalize))
    return np.array([o.outputs.embedding for o in outputs])  # [N, H]


def test_openai_client_gets_the_vectors(served: Served, rng: np.random.Generator) -> None:
    """The openai client asks for base64 unless told otherwise; both encodings carry LLM.embed's vectors."""
    prompts = [random_prompt(rng) for _ in range(int(rng.integers(1, 4)))]
    want = expected_vectors(served, prompts)
    for encoding in ({}, {"encoding_format": "float"}):  # the default: the client asks for base64 and decodes it
        answer = served.client().embeddings.create(model=DEMO_NAME, input=prompts, **encoding)
        got = np.array([d.embedding for d in answer.data])  # [N, H]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        assert [d.index for d in answer.data] == list(range(len(prompts)))
        assert answer.usage.prompt_tokens == sum(len(served.reference.tokenizer.encode(p)) for p in prompts)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_embedding_renders_the_template(served: Served, rng: np.random.Generator, add_generation_prompt: bool) -> None:
    """vLLM's chat form: the conversation's template text (no generation prompt unless asked) embedded."""
    messages = [{"role": "user", "content": random_prompt(rng)}, {"role": "assistant", "content": random_prompt(rng)}]
    status, body = post(served.port, "/v1/embeddings", json.dumps({"messages": messages,
                                                                   "add_generation_prompt": add_generation_prompt}))
    assert status == 200, body
    ids = served.reference.tokenizer.encode_chat(messages, add_generation_prompt)
    want = served.reference.embed([ids])[0].outputs.embedding
    np.testing.assert_allclose(body["data"][0]["embedding"], want, rtol=1e-6, atol=1e-7)
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_base64_is_little_endian_float32(served: Served, rng: np.random.Generator) -> None:
    prompt = random_prompt(rng)
    status, body = post(served.port, "/v1/embeddings", f'{{"input": "{prompt}", "encoding_format": "base64", '
                                                        f'"normalize": false}}')
    assert status == 200, body
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(decoded, expected_vectors(served, [prompt], normalize=False)[0], rtol=1e-6)


@pytest.mark.parametrize("embd_normalize", [-1, 0, 1, 2, 3])
def test_llama_embedding_normalises_as_asked(served: Served, rng: np.random.Generator, embd_normalize: int) -> None:
    prompt = random_prompt(rng)
    status, body = post(served.port, "/embedding", f'{{"content": "{prompt}", "embd_normalize": {embd_normalize}}}')
    assert status == 200, body
    assert [item["index"] for item in body] == [0] and len(body[0]["embedding"]) == 1
    got, raw = np.array(body[0]["embedding"][0]), expected_vectors(served, [prompt], normalize=False)[0]
    if embd_normalize == -1:
        want = raw
    elif embd_normalize == 0:
        want = raw * 32760 / np.abs(raw).max()
    else:
        want = raw / (np.abs(raw) ** embd_normalize).sum() ** (1 / embd_normalize)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_a_large_p_norm_is_the_norm_not_an_overflow(rng: np.random.Generator) -> None:
    """|v| ** p overflows float64 for p = 400 at |v| ~ 10 (llama.cpp's sum then divides the vector
    to zeros); the norm itself, near max |v| for a large p, is finite."""
    from atlas.embed import p_norm

    vector = np.clip(rng.standard_normal(64) * 10.0, -29.0, 29.0)  # 30 below is the largest
    vector[int(rng.integers(64))] = 30.0
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # underflow to 0 is harmless
        got = p_norm(400)(vector)
    logs = np.log(np.abs(vector))
    exact = np.exp(logs.max() + np.log(np.exp(400 * (logs - logs.max())).sum()) / 400)  # in logs: no overflow
    assert 30.0 <= exact < 30.0 * 64 ** (1 / 400)
    np.testing.assert_allclose(got, vector / exact, rtol=1e-12)
    np.testing.assert_array_equal(p_norm(400)(np.zeros(8)), np.zeros(8))
    for p in (1, 2, 3):  # the small p as before
        np.testing.assert_allclose(p_norm(p)(vector), vector / (np.abs(vector) ** p).sum() ** (1 / p), rtol=1e-13)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": "Hi", "dimensions": 3}, "dimensions"),
    ("/v1/embeddings", {"input": "Hi", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {}, "input"),
    ("/v1/embeddings", {"input": ["Hi"] * 257}, "input"),
    ("/v1/embeddings", {"input": [[1] * 5000]}, "input"),
    ("/v1/embeddings", {"input": "Hi", "normalize": "no"}, "normalize"),
    ("/v1/embeddings", {"input": "Hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": "Hi", "messages": [{"role": "user", "content": "Hi"}]}, "input"),
    ("/v1/embeddings", {"messages": []}, "messages"),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True,
                        "continue_final_message": True}, "continue_final_message"),
    ("/v1/embeddings", {"input": "Hi", "add_special_tokens": False}, "add_special_tokens"),
    ("/embedding", {"content": "Hi", "embd_normalize": -2}, "embd_normalize"),
    ("/embedding", {"content": 3}, "content"),
])  # fmt: skip
def test_bad_fields_are_one_400(served: Served, path: str, body: dict[str, Any], param: str) -> None:
    status, answer = post(served.port, path, json.dumps(body))
    assert status == 400, answer
    assert answer["error"]["param"] == param and "\n" not in answer["error"]["message"]


def test_another_model_is_a_404(served: Served) -> None:
    status, answer = post(served.port, "/v1/embeddings", '{"input": "Hi", "model": "gpt-4"}')
    assert status == 404 and answer["error"]["param"] == "model"


def test_serve_pooling_mean(llm: LLM, rng: np.random.Generator) -> None:
    """`atlas serve --pooling mean`: /v1/embeddings averages the prompt's rows."""
    from starlette.testclient import TestClient

    from atlas.server.app import ServerState, create_app
    from atlas.server.worker import EngineWorker

    worker = EngineWorker(lambda: LLM(None, device="cpu"))
    served = worker.start()
    try:
        client = TestClient(create_app(ServerState(DEMO_NAME, worker, served, pooling="mean")))
        prompt = random_prompt(rng)
        answer = client.post("/v1/embeddings", json={"input": prompt, "normalize": False})
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(answer.json()["data"][0]["embedding"], raw_vector(llm, prompt, "mean"), rtol=1e-6)
        metrics = client.get("/metrics")  # the job is counted as a finished request with no generated tokens
        assert metrics.status_code == 200 and 'finished_reason="stop"' in metrics.text, metrics.text[:400]
    finally:
        worker.stop()


def test_serve_pooling_flag_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from atlas.serve import main

    assert main(["--pooling", "cls"]) == 2
    assert "'cls' is not one of 'last', 'mean'" in capsys.readouterr().err


# --- atlas embed ------------------------------------------------------------------------------
def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from atlas.embed import main

    capsys.readouterr()
    code = main([*args, "--device", "cpu"])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_array_is_llm_embed(llm: LLM, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = [random_prompt(rng) for _ in range(int(rng.integers(1, 4)))]
    pooling = str(rng.choice(["last", "mean"]))
    code, out, _ = cli(capsys, "-p", "<#sep#>".join(prompts), "--embd-separator", "<#sep#>", "--pooling", pooling,
                       "--embd-output-format", "array")
    assert code == 0
    want = [o.outputs.embedding for o in llm.embed(prompts, PoolingParams(pooling=pooling))]
    np.testing.assert_allclose(json.loads(out), want, rtol=1e-5, atol=1e-7)


def test_cli_text_and_json_formats(llm: LLM, rng: np.random.Generator, capsys: pytest.CaptureFixture[str],
                                   tmp_path: Any) -> None:
    """'': a line per prompt (a file's lines, the default separator); json+: OpenAI's shape and the
    cosine similarities; --embd-normalize -1: the raw vectors."""
    prompts = [random_prompt(rng) for _ in range(3)]
    (tmp_path / "texts.txt").write_text("\n".join(prompts) + "\n\n", encoding="utf-8")
    raw = np.array([o.outputs.embedding for o in llm.embed(prompts, PoolingParams(normalize=False))])  # [3, H]
    code, out, _ = cli(capsys, "-f", str(tmp_path / "texts.txt"), "--embd-normalize", "-1")
    lines = out.splitlines()
    assert code == 0 and [line.split(":")[0] for line in lines] == ["embedding 0", "embedding 1", "embedding 2"]
    np.testing.assert_allclose([[float(v) for v in line.split(":")[1].split()] for line in lines], raw, atol=1e-6)
    code, out, _ = cli(capsys, "-f", str(tmp_path / "texts.txt"), "--embd-output-format", "json+")
    answer = json.loads(out)
    unit = raw / np.linalg.norm(raw, axis=1, keepdims=True)  # [3, H]
    np.testing.assert_allclose([d["embedding"] for d in answer["data"]], unit, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(answer["cosineSimilarity"], unit @ unit.T, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("args, message", [
    ((), "give the text to embed with --prompt or --file"),
    (("-p", "x", "-f", "y"), "give the text to embed with --prompt or --file"),
    (("-p", "\n \n"), "the text to embed is empty"),
    (("-f", "/no/such/file"), "--file /no/such/file cannot be read"),
    (("-p", "x", "--embd-separator", ""), "--embd-separator is empty"),
    (("-p", "x", "--embd-output-format", "csv"), "'csv' is not one of"),
])  # fmt: skip
def test_cli_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str) -> None:
    code, out, err = cli(capsys, *args)
    assert code == 2 and not out and message in err and err.count("\n") == 1, err
