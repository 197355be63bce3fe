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
from atlas.perplexity import chunks, divergence, main
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
    """llama.cpp's chunking (tokens ctx/2+1 .. ctx-1 of each whole chunk scored) on the demo in
    fp32, against transformers' log-softmax of the same chunks."""
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
    for start in range(0, len(tokens) - ctx + 1, ctx):
        chunk = tokens[start : start + ctx]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([chunk])).logits[0].double(), -1)  # [ctx, V]
        nll += [-float(logprobs[t - 1, chunk[t]]) for t in range(ctx // 2 + 1, ctx)]
    assert report["chunks"] == len(tokens) // ctx and report["tokens_scored"] == report["chunks"] * (ctx - ctx // 2 - 1) == len(nll)
    assert report["ppl"] == pytest.approx(math.exp(np.mean(nll)), rel=1e-4)
    assert report["ppl_stderr"] == pytest.approx(math.exp(np.mean(nll)) * np.std(nll, ddof=1) / math.sqrt(len(nll)), rel=1e-3)


def test_chunks_are_whole_and_start_with_bos() -> None:
    assert chunks(list(range(10)), 4, None) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert chunks(list(range(10)), 4, 99) == [[99, 1, 2, 3], [99, 5, 6, 7]]


def test_divergence_is_the_top_k_plus_rest_form(rng: np.random.Generator) -> None:
    """KL of both distributions merged to the saved run's top K ids and one bucket, computed
    directly; never above the full divergence, 0 for equal distributions."""
    vocab, positions = 300, 40
    top = int(rng.integers(4, 40))
    p_logits = rng.standard_normal((positions, vocab)) * 2
    q_logits = p_logits + rng.standard_normal((positions, vocab)) * rng.uniform(0.05, 0.5)
    p = np.exp(p_logits) / np.exp(p_logits).sum(1, keepdims=True)  # [S, V]
    q = np.exp(q_logits) / np.exp(q_logits).sum(1, keepdims=True)
    kept = np.argsort(-p, axis=1)[:, :top]  # [S, K]
    saved, at_saved = (np.log(np.take_along_axis(x, kept, 1)).astype(np.float32) for x in (p, q))
    kld = divergence(saved, at_saved)
    for s in range(positions):
        p_k, q_k = p[s, kept[s]], q[s, kept[s]]
        p_rest, q_rest = 1 - p_k.sum(), 1 - q_k.sum()
        want = float(np.sum(p_k * np.log(p_k / q_k)) + p_rest * np.log(p_rest / q_rest))
        assert kld[s] == pytest.approx(want, rel=1e-3, abs=1e-6)
        assert kld[s] <= float(np.sum(p[s] * np.log(p[s] / q[s]))) + 1e-6
    assert np.all(divergence(saved, saved) < 1e-6)


def saved_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], rng: np.random.Generator, *flags: str) -> Path:
    (tmp_path / "text.txt").write_text(shuffled_text(rng), encoding="utf-8")
    saved = tmp_path / "base.npz"
    code, _, err = run_tool(capsys, "--file", str(tmp_path / "text.txt"), "--ctx", "32", "--save-logprobs", str(saved), *flags)
    assert code == 0, err
    return saved


def test_saved_run_against_itself_and_a_coarser_kv_cache(tmp_path: Path, rng: np.random.Generator,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    saved = saved_run(tmp_path, capsys, rng)
    reports = {}
    for level in ("bf16", "turbo3"):
        out_json = tmp_path / f"{level}.json"
        code, out, err = run_tool(capsys, "--kl-divergence", str(saved), "--kv-cache-dtype", level,
                                  "--kv-high-precision-layers", "0", "--json", str(out_json))
        assert code == 0, err
        reports[level] = json.loads(out_json.read_text())
        assert "KL divergence (its top 32 + rest)" in out and "top-1 agreement" in out
    same, coarse = reports["bf16"], reports["turbo3"]
    assert same["kld_max"] < 1e-9 and same["top1_agreement"] == 1.0 and same["ppl_ratio"] == pytest.approx(1.0, abs=1e-9)
    assert same["ppl"] == pytest.approx(same["base_ppl"], rel=1e-9)
    assert coarse["kld_mean"] > 1e-7 and 0 <= coarse["top1_agreement"] <= 1  # 3-bit keys and values move the logits


def test_a_comparison_scores_what_was_saved(tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]) -> None:
    """A run saved with --chunks 1 is compared over that chunk alone; --ctx / --top / --file that
    differ from the saved run, or another tokenizer's file, are one line before any scoring."""
    saved = saved_run(tmp_path, capsys, rng, "--chunks", "1", "--top", "8")
    code, out, err = run_tool(capsys, "--kl-divergence", str(saved), "--json", str(tmp_path / "r.json"))
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert (report["chunks"], report["tokens_scored"], report["kld_top"]) == (1, 15, 8)
    arrays = dict(np.load(saved))
    np.savez(tmp_path / "other.npz", **{**arrays, "tokenizer": np.array("0" * 64)})
    for flags, needle in ((["--ctx", "16"], "differs from the saved run's 32"), (["--top", "4"], "--top is the saved run's"),
                          (["--file", str(tmp_path / "text.txt")], "leave --file out")):
        code, _, err = run_tool(capsys, "--kl-divergence", str(saved), *flags)
        assert code == 2 and needle in err, err
    code, _, err = run_tool(capsys, "--kl-divergence", str(tmp_path / "other.npz"))
    assert code == 2 and "another tokenizer" in err, err


def test_bad_inputs_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "text.txt"
    text.write_text(zen_of_python(), encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "garbage.npz").write_bytes(b"not an npz")
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    np.save(tmp_path / "array.npy", np.zeros(3))
    np.savez(tmp_path / "partial.npz", tokens=np.arange(10))
    good = {"tokens": np.arange(40), "ctx": np.array(8), "vocab": np.array(512), "tokenizer": np.array("x"),
            "nll": np.zeros(3), "top_ids": np.zeros((3, 4), np.int32), "top_logprobs": np.zeros((3, 4), np.float32)}
    np.savez(tmp_path / "shapes.npz", **{**good, "top_ids": np.zeros((2, 4), np.int32)})
    np.savez(tmp_path / "strings.npz", **{**good, "nll": np.array(["a", "b", "c"])})
    np.savez(tmp_path / "nan.npz", **{**good, "top_logprobs": np.full((3, 4), np.nan, np.float32)})
    np.savez(tmp_path / "ids.npz", **{**good, "top_ids": np.full((3, 4), 600, np.int32)})
    np.savez(tmp_path / "inf.npz", **{**good, "nll": np.array([0.5, np.inf, 1.0])})
    np.savez(tmp_path / "positive.npz", **{**good, "top_logprobs": np.full((3, 4), 0.25, np.float32)})
    np.savez_compressed(tmp_path / "whole.npz", **good)
    whole = (tmp_path / "whole.npz").read_bytes()
    (tmp_path / "truncated.npz").write_bytes(whole[: len(whole) // 2])
    flipped = bytearray(whole)
    start = whole.index(b"top_logprobs.npy") + 40  # inside that member's compressed data: its CRC fails
    flipped[start] ^= 0xFF
    (tmp_path / "flipped.npz").write_bytes(bytes(flipped))
    cases = [
        (["--file", str(tmp_path / "missing.txt")], "cannot be read"),
        (["--file", str(tmp_path / "latin1.txt")], "UTF-8"),
        (["--file", str(text), "--ctx", "4000"], "--ctx must be in"),
        (["--file", str(text), "--ctx", "4"], "--ctx must be in"),
        (["--file", str(text), "--ctx", "1000"], "fewer than --ctx 1000"),
        (["--top", "300"], "--top must be in 1..256"),
        (["--file", str(tmp_path / "empty.txt")], "the text has 0 tokens"),
        (["--kl-divergence", str(tmp_path / "garbage.npz")], "cannot be read as saved"),
        (["--kl-divergence", str(tmp_path / "array.npy")], "cannot be read as saved"),
        (["--kl-divergence", str(tmp_path / "partial.npz")], "lacks ctx"),
        (["--kl-divergence", str(tmp_path / "shapes.npz")], "their lengths"),
        (["--kl-divergence", str(tmp_path / "strings.npz")], "nll"),
        (["--kl-divergence", str(tmp_path / "nan.npz")], "not finite"),
        (["--kl-divergence", str(tmp_path / "inf.npz")], "not finite"),
        (["--kl-divergence", str(tmp_path / "positive.npz")], "<= 0"),
        (["--kl-divergence", str(tmp_path / "truncated.npz")], "cannot be read as saved"),
        (["--kl-divergence", str(tmp_path / "flipped.npz")], "cannot be read as saved"),
        (["--kl-divergence", str(tmp_path / "ids.npz")], "outside its vocabulary"),
        (["--kl-divergence", str(tmp_path / "garbage.npz"), "--file", str(text)], "leave --file out"),
        (["--save-logprobs", str(tmp_path / "no" / "dir.npz")], "does not exist"),
        (["--model", str(tmp_path)], "config.json"),
    ]
    for argv, needle in cases:
        code, _, err = run_tool(capsys, *argv)
        lines = [line for line in err.splitlines() if "error" in line]
        assert code == 2 and len(lines) == 1 and needle in lines[0], (argv, err)
        assert "Traceback" not in err
