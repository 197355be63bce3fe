"""atlas.batch: an OpenAI batch file through the server's app in-process. Answers are the server's
(the text the model gives the same request), refusals keep their status and error body, lines that
are not requests get an error entry and the batch goes on, the output keeps the input's order, and
bad files, flags and interruptions are one line with no partial output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("starlette")

from atlas import LLM  # noqa: E402
from atlas.batch import main  # noqa: E402
from atlas.demo import DEMO_NAME  # noqa: E402
from test_serve import random_prompt  # noqa: E402


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(device="cpu", prompt_cache=0)


def request(custom_id: str, url: str, **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": DEMO_NAME, **body}})


def run_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str], *flags: str) -> tuple[int, list[dict], str]:
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    capsys.readouterr()
    code = main(["-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--device", "cpu", *flags])
    err = capsys.readouterr().err
    results = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] if out.exists() else []
    return code, results, err


def test_answers_are_the_servers(tmp_path: Path, capsys: pytest.CaptureFixture[str], rng: np.random.Generator,
                                 reference: LLM) -> None:
    prompts = [random_prompt(rng) for _ in range(3)]
    tokens = [int(t) for t in rng.integers(1, 12, size=3)]
    lines = [request("chat", "/v1/chat/completions", messages=[{"role": "user", "content": prompts[0]}], max_tokens=tokens[0], temperature=0),
             request("text", "/v1/completions", prompt=prompts[1], max_tokens=tokens[1], temperature=0),
             request("resp", "/v1/responses", input=prompts[2], max_output_tokens=tokens[2], temperature=0)]
    code, results, err = run_batch(tmp_path, capsys, lines)
    assert code == 0, err
    assert [r["custom_id"] for r in results] == ["chat", "text", "resp"]
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in results)
    chat, text, resp = (r["response"]["body"] for r in results)
    assert chat["choices"][0]["message"]["content"] == reference.chat([{"role": "user", "content": prompts[0]}], max_tokens=tokens[0]).text
    assert text["choices"][0]["text"] == reference.generate(prompts[1], max_tokens=tokens[1]).text
    want = reference.chat([{"role": "user", "content": prompts[2]}], max_tokens=tokens[2]).text
    assert "".join(c["text"] for item in resp["output"] for c in item.get("content", [])) == want
    assert len({r["id"] for r in results}) == 3 and "3 of 3 requests answered 200" in err


def test_lines_that_fail_get_their_errors_and_the_batch_goes_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = request("ok", "/v1/completions", prompt="Flat is", max_tokens=2)
    lines = [
        request("refused", "/v1/completions", prompt="Flat", max_tokens=-1),
        "not json",
        json.dumps(["a"]),
        json.dumps({"url": "/v1/completions", "body": {}}),
        good,
        good,  # its custom_id again
        request("embed", "/v1/embeddings", input="x"),
        json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}}),
        json.dumps({"custom_id": "nobody", "url": "/v1/completions", "body": "x"}),
        request("stream", "/v1/chat/completions", messages=[{"role": "user", "content": "x"}], stream=True),
        request("model", "/v1/completions", prompt="x", max_tokens=2).replace(DEMO_NAME, "other-model"),
    ]
    code, results, err = run_batch(tmp_path, capsys, lines)
    assert code == 0 and len(results) == len(lines), err
    refused, model = results[0]["response"], results[-1]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "max_tokens"
    assert model["status_code"] == 404 and model["body"]["error"]["code"] == "model_not_found"
    codes = [r["error"]["code"] if r["error"] else None for r in results]
    assert codes == [None, "invalid_json", "invalid_request", "missing_custom_id", None, "duplicate_custom_id",
                     "invalid_url", "invalid_method", "invalid_body", "invalid_body", None]
    assert results[4]["response"]["status_code"] == 200 and results[5]["custom_id"] == "ok"
    assert "1 of 11 requests answered 200" in err


def test_odd_lines_and_a_fault_stay_on_their_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch, reference: LLM) -> None:
    """A body with a raw U+2028 in a string is one line; a lone surrogate in a custom_id, and
    background, are line errors; a fault in the app is that line's 500; "post" is POST."""
    import atlas.server.app as app_module

    real = app_module.check_model

    def faulty(state: Any, model: object) -> None:
        if model == "fault":
            raise RuntimeError("a fault in the app")
        real(state, model)

    monkeypatch.setattr(app_module, "check_model", faulty)
    lines = [
        json.dumps({"custom_id": "sep", "method": "post", "url": "/v1/completions",
                    "body": {"model": DEMO_NAME, "prompt": "Flat\u2028is", "max_tokens": 3, "temperature": 0}}, ensure_ascii=False),
        '{"custom_id": "a\\udc00", "url": "/v1/completions", "body": {}}',
        request("bg", "/v1/responses", input="hi", background=True),
        request("fault", "/v1/completions", prompt="x").replace(DEMO_NAME, "fault"),
        request("after", "/v1/completions", prompt="Flat is", max_tokens=2),
    ]
    code, results, err = run_batch(tmp_path, capsys, lines)
    assert code == 0 and [r["custom_id"] for r in results] == ["sep", None, "bg", "fault", "after"], err
    assert results[0]["response"]["body"]["choices"][0]["text"] == reference.generate("Flat\u2028is", max_tokens=3).text
    assert results[1]["error"]["code"] == "missing_custom_id" and "surrogate" in results[1]["error"]["message"]
    assert results[2]["response"] is None and "'background'" in results[2]["error"]["message"]
    assert results[3]["response"]["status_code"] == 500 and results[3]["error"] is None
    assert results[4]["response"]["status_code"] == 200


@pytest.mark.parametrize(("case", "needle"), [
    ("missing", "cannot be read"),
    ("empty", "holds no requests"),
    ("latin1", "UTF-8"),
    ("no_dir", "does not exist"),
    ("out_is_dir", "is a directory"),
    ("out_is_in", "is the input file"),
])
def test_bad_files_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, needle: str) -> None:
    source = tmp_path / "in.jsonl"
    out = tmp_path / {"no_dir": "no/out.jsonl", "out_is_dir": "a_dir", "out_is_in": "in.jsonl"}.get(case, "out.jsonl")
    if case == "empty":
        source.write_text("\n  \n", encoding="utf-8")
    elif case == "latin1":
        source.write_bytes(b'{"custom_id": "caf\xe9"}\n')
    elif case in ("no_dir", "out_is_dir", "out_is_in"):
        source.write_text(request("a", "/v1/completions", prompt="x") + "\n", encoding="utf-8")
        (tmp_path / "a_dir").mkdir()
    capsys.readouterr()
    code = main(["-i", str(source), "-o", str(out), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not out.exists() or out.is_dir() or out == source


def test_an_interrupted_batch_leaves_no_output(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import atlas.batch

    real, calls = atlas.batch.answer, []

    async def interrupted(app: Any, line: str, seen: set[str]) -> dict[str, Any]:
        calls.append(line)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return await real(app, line, seen)

    monkeypatch.setattr(atlas.batch, "answer", interrupted)
    lines = [request(f"r{i}", "/v1/completions", prompt="Flat is", max_tokens=2) for i in range(3)]
    code, results, err = run_batch(tmp_path, capsys, lines)
    assert code != 0 and "interrupted" in err and results == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"], "a partial output was left"


def test_seed_makes_seedless_requests_reproducible(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   rng: np.random.Generator) -> None:
    """vLLM's --seed: sampled requests that give no seed answer alike in a batch run again with the
    same seed; each request of a run draws its own seed (the same request twice in a run differs)."""
    prompt = random_prompt(rng)
    line = request("x", "/v1/completions", prompt=prompt, max_tokens=24, temperature=2.0, top_p=1.0)
    lines = [line, line.replace('"x"', '"y"')]
    seed = str(int(rng.integers(1 << 30)))
    texts = []
    for flags in (("--seed", seed), ("--seed", seed)):
        code, results, err = run_batch(tmp_path, capsys, lines, *flags)
        assert code == 0, err
        texts.append([r["response"]["body"]["choices"][0]["text"] for r in results])
    assert texts[0] == texts[1] and texts[0][0] != texts[0][1], texts
    code, _, err = run_batch(tmp_path, capsys, lines, "--seed", "-1")
    assert code == 2 and err.count("\n") == 1 and "--seed" in err


def test_override_generation_config_sets_the_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      rng: np.random.Generator, reference: LLM) -> None:
    """--override-generation-config: a request that leaves temperature out samples with the
    override's (0: greedy), over --generation-config vllm's OpenAI default of 1."""
    prompt, tokens = random_prompt(rng), int(rng.integers(4, 16))
    line = request("x", "/v1/completions", prompt=prompt, max_tokens=tokens)
    code, results, err = run_batch(tmp_path, capsys, [line], "--generation-config", "vllm",
                                   "--override-generation-config", '{"temperature": 0}')
    assert code == 0, err
    assert results[0]["response"]["body"]["choices"][0]["text"] == reference.generate(prompt, max_tokens=tokens).text
