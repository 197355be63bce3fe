"""atlas.serve --api-key (ATLAS_API_KEY, VLLM_API_KEY): /v1/* answers 401 with an OpenAI error body without
the bearer key, the official client works with it, /health stays open."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from atlas import LLM  # noqa: E402
from atlas.demo import DEMO_NAME  # noqa: E402
from atlas.server.app import ServerState, create_app  # noqa: E402
from test_tools import CannedWorker  # noqa: E402


def test_api_key_gates_the_v1_routes() -> None:
    llm = LLM(device="cpu")
    http = TestClient(create_app(ServerState(DEMO_NAME, CannedWorker(llm), llm, api_key="s3cret")))  # type: ignore[arg-type]
    body = {"model": DEMO_NAME, "prompt": "Flat", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
        answer = http.post("/v1/completions", json=body, headers=headers)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    assert http.get("/v1/models").status_code == 401
    assert http.post("/tokenize", json={"model": DEMO_NAME, "prompt": "Flat"}).status_code == 401
    assert http.post("/invocations", json=body).status_code == 401  # it generates, as /v1/completions
    assert http.post("/completion", json={"prompt": "Flat"}).status_code == 401 and http.get("/props").status_code == 401
    assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200  # vLLM's probe, open too
    import atlas

    assert http.get("/version").json() == {"version": atlas.__version__}  # vLLM's, open as its /health
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="s3cret", http_client=http, max_retries=0)
    assert client.completions.create(model=DEMO_NAME, prompt="Flat", max_tokens=2).choices[0].text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url="http://testserver/v1", api_key="nope", http_client=http, max_retries=0).models.list()


def test_api_key_as_anthropic_sends_it() -> None:
    """The anthropic client sends the key as x-api-key: accepted, a wrong one is a 401."""
    anthropic = pytest.importorskip("anthropic")
    llm = LLM(device="cpu")
    http = TestClient(create_app(ServerState(DEMO_NAME, CannedWorker(llm), llm, api_key="s3cret")))  # type: ignore[arg-type]
    request = {"model": DEMO_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    good = anthropic.Anthropic(base_url="http://testserver", api_key="s3cret", http_client=http, max_retries=0)
    assert good.messages.create(**request).content[0].text
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url="http://testserver", api_key="nope", http_client=http, max_retries=0).messages.create(**request)
    refused = http.post("/v1/messages", json=request).json()  # in Anthropic's error shape there
    assert refused["type"] == "error" and refused["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(("flags", "env", "name"), [(["--api-key", " "], None, ""), ([], "", "ATLAS_API_KEY"),
                                                    ([], "  ", "ATLAS_API_KEY"), ([], "", "VLLM_API_KEY")])
def test_an_empty_key_is_refused(flags: list[str], env: str | None, name: str, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """An empty ATLAS_API_KEY (`ATLAS_API_KEY=$UNSET`) had started a server open to anyone: click
    reads an empty variable as unset."""
    from atlas.serve import main

    for variable in ("ATLAS_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(variable, raising=False)
    if env is not None:
        monkeypatch.setenv(name, env)
    assert main([*flags, "--port", "0", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == \
        "atlas.serve: error: --api-key (or ATLAS_API_KEY / VLLM_API_KEY) is empty; give a key or leave it out"


@pytest.mark.parametrize(("atlas_key", "vllm_key", "taken"), [(None, "v", "v"), ("a", "v", "a"), ("", "v", "v"),
                                                              (None, None, None)])
def test_vllms_key_variable_guards_the_server(atlas_key: str | None, vllm_key: str | None, taken: str | None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM deployment's VLLM_API_KEY keeps its server guarded here (ATLAS_API_KEY first)."""
    from atlas.serve import command

    for variable, value in (("ATLAS_API_KEY", atlas_key), ("VLLM_API_KEY", vllm_key)):
        if value is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, value)
    assert command.make_context("atlas.serve", ["--device", "cpu"]).params["api_key"] == taken
