"""atlas.perplexity: the demo's perplexity on a fresh shuffled text against transformers in fp32
(llama.cpp's chunking), the KL divergence's top-K + rest form against a direct computation, a
saved run compared with itself and with a coarser KV cache, and every bad input as one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from atlas.demo import DEMO_DIR, zen_of_python
from atlas.perplexity import Scored, chunks, divergence, main, scored_range
from atlas.tokenizer import Tokenizer


def shuffled_text(rng: np.random.Generator) -> str:
    """The demo's text with its words in a random order: the model is unsure of it."""
    return " ".join(rng.permutation(zen_of_python().split()).tolist())


def run_tool(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["--device", "cpu", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_ppl_is_transformers_in_fp32(tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    text, ctx = shuffled_text(rng), int(rng.integers(16, 48))
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    code, _, err = run_tool(capsys, "--file", str(tmp_path / "text.txt"), "--ctx", str(ctx), "--json", str(tmp_path / "p.json"))
    assert code == 0, err
    report = json.loads((tmp_path / "p.json").read_text())
    tokens = Tokenizer.open(DEMO_DIR).encode(text, add_special_tokens=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32)
    nll = []
    for chunk in chunks(tokens, ctx, None):
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([chunk])).logits[0].double(), -1)  # [ctx, V]
        for t in range(*scored_range(ctx).indices(ctx)):
            nll.append(-float(logprobs[t - 1, chunk[t]]))
    assert report["tokens_scored"] == len(nll) and report["chunks"] == len(tokens) // ctx
    assert report["ppl"] == pytest.approx(math.exp(np.mean(nll)), rel=1e-4)
    assert report["ppl_stderr"] == pytest.approx(math.exp(np.mean(nll)) * np.std(nll, ddof=1) / math.sqrt(len(nll)), rel=1e-3)


def random_scored(rng: np.random.Generator, logits: np.ndarray, top: int) -> Scored:
    logprobs = logits - np.log(np.exp(logits).sum(1, keepdims=True))  # [S, V]
    ids = np.argsort(-logprobs, axis=1)[:, :top]  # [S, K]
    return Scored(np.zeros(len(logits)), ids.astype(np.int32), np.take_along_axis(logprobs, ids, 1).astype(np.float32))


def test_divergence_is_the_top_k_plus_rest_form(rng: np.random.Generator) -> None:
    """With every saved id in the run's list: KL of both distributions merged to the saved top K
    and one bucket, computed directly; never above the full divergence."""
    vocab, positions, top = 300, 40, int(rng.integers(4, 40))
    p_logits = rng.standard_normal((positions, vocab)) * 2
    q_logits = p_logits + rng.standard_normal((positions, vocab)) * rng.uniform(0.05, 0.5)
    base, run = random_scored(rng, p_logits, top), random_scored(rng, q_logits, vocab)  # the run lists all
    kld, missing = divergence(base, run, vocab)
    p = np.exp(p_logits) / np.exp(p_logits).sum(1, keepdims=True)
    q = np.exp(q_logits) / np.exp(q_logits).sum(1, keepdims=True)
    for s in range(positions):
        kept = base.top_ids[s]
        p_k, q_k = p[s, kept], q[s, kept]
        p_rest, q_rest = 1 - p_k.sum(), 1 - q_k.sum()
        want = float(np.sum(p_k * np.log(p_k / q_k)) + p_rest * np.log(p_rest / q_rest))
        assert kld[s] == pytest.approx(want, rel=1e-4, abs=1e-7)
        assert kld[s] <= float(np.sum(p[s] * np.log(p[s] / q[s]))) + 1e-7
    assert missing == 0
    _, missing = divergence(base, random_scored(rng, q_logits, top), vocab)  # a short list misses some
    assert missing > 0


def test_saved_run_against_itself_and_a_coarser_kv_cache(tmp_path: Path, rng: np.random.Generator,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "text.txt").write_text(shuffled_text(rng), encoding="utf-8")
    saved = tmp_path / "base.npz"
    code, out, err = run_tool(capsys, "--file", str(tmp_path / "text.txt"), "--ctx", "32", "--save-logprobs", str(saved))
    assert code == 0, err
    reports = {}
    for level in ("bf16", "turbo3"):
        out_json = tmp_path / f"{level}.json"
        code, out, err = run_tool(capsys, "--kl-divergence", str(saved), "--kv-cache-dtype", level,
                                  "--kv-high-precision-layers", "0", "--json", str(out_json))
        assert code == 0, err
        reports[level] = json.loads(out_json.read_text())
        assert "KL divergence (top 32 + rest)" in out and "top-1 agreement" in out
    same, coarse = reports["bf16"], reports["turbo3"]
    assert same["kld_mean"] < 1e-9 and same["top1_agreement"] == 1.0 and same["ppl_ratio"] == pytest.approx(1.0, abs=1e-9)
    assert same["ppl"] == pytest.approx(same["base_ppl"], rel=1e-9)
    assert coarse["kld_mean"] > 1e-7 and 0 <= coarse["top1_agreement"] <= 1  # 3-bit keys and values move the logits


def test_bad_inputs_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "text.txt"
    text.write_text(zen_of_python(), encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "garbage.npz").write_bytes(b"not an npz")
    np.savez(tmp_path / "partial.npz", tokens=np.arange(10))
    np.savez(tmp_path / "shapes.npz", tokens=np.arange(10), ctx=np.array(8), nll=np.zeros(3),
             top_ids=np.zeros((2, 4), np.int32), top_logprobs=np.zeros((2, 4), np.float32))
    cases = [
        (["--file", str(tmp_path / "missing.txt")], "cannot be read"),
        (["--file", str(tmp_path / "latin1.txt")], "UTF-8"),
        (["--file", str(text), "--ctx", "4000"], "--ctx must be in"),
        (["--file", str(text), "--ctx", "4"], "--ctx must be in"),
        (["--file", str(text), "--ctx", "1000"], "fewer than --ctx 1000"),
        (["--top", "300"], "--top must be in"),
        (["--kl-divergence", str(tmp_path / "garbage.npz")], "cannot be read as saved"),
        (["--kl-divergence", str(tmp_path / "partial.npz")], "lacks ctx"),
        (["--kl-divergence", str(tmp_path / "shapes.npz")], "shapes"),
        (["--kl-divergence", str(tmp_path / "garbage.npz"), "--file", str(text)], "leave --file out"),
        (["--save-logprobs", str(tmp_path / "no" / "dir.npz")], "does not exist"),
        (["--model", str(tmp_path)], "config.json"),
    ]
    for argv, needle in cases:
        code, _, err = run_tool(capsys, *argv)
        lines = [line for line in err.splitlines() if "error" in line]
        assert code == 2 and len(lines) == 1 and needle in lines[0], (argv, err)
        assert "Traceback" not in err
    assert not list((tmp_path).glob(".*.tmp")), "a partial file was left behind"
