"""atlas.serve's CORS (vLLM's --allowed-origins / --allowed-methods / --allowed-headers /
--allowed-credentials): a browser's preflight is answered without the API key, an allowed
origin's answers (a 401 too) carry the headers that let its page read them, another origin's do
not, and a bad flag is one line before the model loads."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from atlas import LLM  # noqa: E402
from atlas.demo import DEMO_NAME  # noqa: E402
from atlas.server.app import ServerState, create_app  # noqa: E402
from atlas.server.cors import CorsPolicy  # noqa: E402
from test_tools import CannedWorker  # noqa: E402

PAGE = "http://localhost:3000"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu")


def client(llm: LLM, cors: CorsPolicy | None, api_key: str | None = "s3cret") -> TestClient:
    return TestClient(create_app(ServerState(DEMO_NAME, CannedWorker(llm), llm, api_key=api_key, cors=cors)))  # type: ignore[arg-type]


def test_any_origin_by_default(llm: LLM) -> None:
    http = client(llm, CorsPolicy())
    preflight = http.options("/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    body = {"model": DEMO_NAME, "prompt": "Flat", "max_tokens": 2}
    answer = http.post("/v1/completions", json=body, headers={"Origin": PAGE, "Authorization": "Bearer s3cret"})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
    refused = http.post("/v1/completions", json=body, headers={"Origin": PAGE})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"


def test_listed_origins_only(llm: LLM) -> None:
    http = client(llm, CorsPolicy(origins=(PAGE,), credentials=True), api_key=None)
    preflight = http.options("/v1/models", headers=PREFLIGHT)
    assert preflight.headers["access-control-allow-origin"] == PAGE
    assert preflight.headers["access-control-allow-credentials"] == "true"
    assert http.get("/v1/models", headers={"Origin": PAGE}).headers["access-control-allow-origin"] == PAGE
    stranger = {**PREFLIGHT, "Origin": "https://elsewhere.example"}
    assert http.options("/v1/models", headers=stranger).status_code == 400
    answer = http.get("/v1/models", headers={"Origin": "https://elsewhere.example"})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_no_policy_no_headers(llm: LLM) -> None:
    http = client(llm, None, api_key=None)
    assert "access-control-allow-origin" not in http.get("/v1/models", headers={"Origin": PAGE}).headers
    assert http.options("/v1/models", headers=PREFLIGHT).status_code == 405


@pytest.mark.parametrize(("flags", "needle"), [
    (["--allowed-origins", "*"], "--allowed-origins is not JSON"),
    (["--allowed-origins", '"*"'], "--allowed-origins must be a JSON list of non-empty strings"),
    (["--allowed-methods", "[1]"], "--allowed-methods must be a JSON list"),
    (["--allowed-headers", '[""]'], "--allowed-headers must be a JSON list"),
])
def test_bad_flags_are_one_line(flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    from atlas.serve import main

    assert main([*flags, "--port", "0", "--device", "cpu"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"atlas.serve: error: {needle}"), lines
