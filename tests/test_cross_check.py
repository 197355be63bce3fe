"""atlas.compare --against cpu (atlas.cross_check): a backend against the numpy backend, each op
given the checked run's inputs. The numpy backend passes against itself exactly, the CUDA stand-in
(bf16 roundings) passes with visible errors, with every KV cache level too, a deliberately broken op
is named as the first flagged intermediate (a decode-only break only with --decode-steps; a fused
DeltaNet decode op's output or the state it leaves at its output), and near-tie expert flips are
noted while other differences are flagged."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from _cuda_stand_in import CudaRounding
from _gpu import require_demo_cuda
from atlas.compare import main
from atlas.cross_check import DEFAULT_TOLERANCE, Capture, compare_runs
from test_speculative import demo_mtp  # noqa: F401  (the demo with a random MTP head)

PROMPT = "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex."
ROW = re.compile(r"^(\S+)\s+\[([\d, ]+)\]\s+([\d.]+|inf)\s+(\S+)(\s+<- outside)?")


def rows(out: str) -> dict[str, tuple[float, bool]]:
    """name -> (rel_err, flagged) of each table row."""
    return {m[1]: (float(m[3]), m[5] is not None) for line in out.splitlines() if (m := ROW.match(line))}


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["--against", "cpu", "--prompt", PROMPT, *argv])
    return code, capsys.readouterr().out


def use_backend(monkeypatch: pytest.MonkeyPatch, backend: type[CudaRounding]) -> None:
    import atlas.backends as backends

    monkeypatch.setattr(backends, "open_cuda_backend", lambda model_dir, spec, run: backend())
    monkeypatch.delenv("ATLAS_REQUIRE_GPU", raising=False)


def test_numpy_against_itself_is_exact(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(["--device", "cpu", "--decode-steps", "3"], capsys)
    assert code == 0, out
    table = rows(out)
    assert {"embed", "layer.0.attn.conv", "layer.3.attn.core", "layer.3.out", "final_norm", "logits"} <= set(table)
    assert all(rel <= 1e-6 and not flagged for rel, flagged in table.values()), out
    assert "PASS" in out and re.search(r"\(\d+ in prefill passes of <= 4096, 3 decode steps\)", out), out
    code, out = run(["--device", "cpu", "--decode-steps", "2", "--prefill-chunk", "5"], capsys)
    assert code == 0 and "prefill passes of <= 5, 2 decode steps" in out, out
    assert all(rel <= 1e-6 for rel, _ in rows(out).values()), out


def test_cuda_stand_in_passes_with_its_rounding(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    use_backend(monkeypatch, CudaRounding)
    code, out = run(["--device", "cuda", "--decode-steps", "2"], capsys)
    assert code == 0, out
    table = rows(out)
    assert max(rel for rel, _ in table.values()) > 1e-4, "the stand-in's bf16 roundings must show"
    assert all(rel < DEFAULT_TOLERANCE and not flagged for rel, flagged in table.values()), out


@pytest.mark.parametrize("level", ["fp8", "nvfp4", "turbo8", "turbo4", "turbo3"])
def test_cuda_stand_in_passes_with_a_quantized_cache(level: str, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """k and v are fed: both caches encode the same rows, so a 3-bit level's code flips cannot
    move attention (they did by up to 5 % when each run encoded its own k)."""
    use_backend(monkeypatch, CudaRounding)
    code, out = run(["--device", "cuda", "--decode-steps", "2", "--kv-cache-dtype", level,
                     "--kv-high-precision-layers", "0"], capsys)
    assert code == 0, out
    assert rows(out)["layer.3.attn.core"][0] < DEFAULT_TOLERANCE / 4, out


class BrokenAttention(CudaRounding):
    def attention(self, q, k, v, cache, positions, scale):  # type: ignore[no-untyped-def]
        return super().attention(q, k, v, cache, positions, scale * 1.5)


class BrokenConvStep(CudaRounding):
    """The one-token conv update (decode) reads a zero weight column; prefill is right."""

    def causal_conv1d(self, x, weight, conv_state):  # type: ignore[no-untyped-def]
        if x.shape[0] != 1:
            return super().causal_conv1d(x, weight, conv_state)
        damaged = np.array(self.to_numpy(weight), np.float32)
        damaged[..., -1] = 0
        return super().causal_conv1d(x, damaged, conv_state)


class BrokenLaterPasses(CudaRounding):
    """A prefill pass after the first attends with the wrong scale (one pass, or decode, is right)."""

    def attention(self, q, k, v, cache, positions, scale):  # type: ignore[no-untyped-def]
        later = q.shape[0] > 1 and int(np.asarray(positions)[0]) > 0
        return super().attention(q, k, v, cache, positions, scale * 1.5 if later else scale)


class BrokenExperts(CudaRounding):
    def moe_experts(self, x, ids, weights, gate_up, down):  # type: ignore[no-untyped-def]
        return super().moe_experts(x, ids, weights * 1.2, gate_up, down)


class BrokenRouter(CudaRounding):
    """Chooses the least likely expert in the last slot: far from any tie."""

    def router(self, x, weight, top_k, renormalize, *, shared_expert=False):  # type: ignore[no-untyped-def]
        ids, weights = super().router(x, weight, top_k, renormalize, shared_expert=shared_expert)
        logits = self.to_numpy(self.linear(x, weight))
        ids = np.array(ids)
        ids[:, top_k - 1] = logits[:, : weight.shape[0] - int(shared_expert)].argmin(axis=-1)
        return ids, weights


class FusedDecode(CudaRounding):
    """Runs a decode step's DeltaNet as one op, as the CUDA backend's opt-in fused kernel does."""

    def fuses_gated_delta_net(self, tokens: int) -> bool:
        return tokens == 1


class BrokenFusedOutput(FusedDecode):
    def gated_delta_net(self, x, layer):  # type: ignore[no-untyped-def]
        out = super().gated_delta_net(x, layer)
        return out * 1.1 if x.mixed.shape[0] == 1 else out


class BrokenFusedState(FusedDecode):
    """A fused step's output is right; the conv state it leaves is zeros. (The demo's DeltaNet
    gates forget the recurrent state almost at once: damage to it barely shows a step later.)"""

    def gated_delta_net(self, x, layer):  # type: ignore[no-untyped-def]
        out = super().gated_delta_net(x, layer)
        if x.mixed.shape[0] == 1:
            layer.conv_state[...] = 0
        return out


@pytest.mark.parametrize(
    "backend, options, first",
    [
        (BrokenAttention, [], "layer.3.attn.core"),
        (BrokenConvStep, ["--decode-steps", "2"], "layer.0.attn.conv"),
        (BrokenConvStep, [], None),
        (BrokenLaterPasses, ["--prefill-chunk", "6"], "layer.3.attn.core"),
        (BrokenLaterPasses, ["--decode-steps", "3"], None),
        (BrokenExperts, ["--decode-steps", "1"], "layer.0.mlp.routed"),
        (BrokenRouter, [], "layer.0.mlp.router_ids"),
        (FusedDecode, ["--decode-steps", "3"], None),
        (BrokenFusedOutput, ["--decode-steps", "1"], "layer.0.attn.gated_norm"),
        (BrokenFusedState, ["--decode-steps", "1"], None),
        (BrokenFusedState, ["--decode-steps", "2"], "layer.0.attn.gated_norm"),
    ],
    ids=["attention", "conv-step", "conv-step-prefill-only", "later-passes", "later-passes-one-pass", "experts", "router",
         "fused-decode", "fused-output", "fused-state-one-step", "fused-state"],
)
def test_a_broken_op_is_named(backend: type[CudaRounding], options: list[str], first: str | None,
                              monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    use_backend(monkeypatch, backend)
    code, out = run(["--device", "cuda", *options], capsys)
    if first is None:
        assert code == 0 and "PASS" in out, out
        return
    assert code == 1, out
    flagged = [name for name, (_, bad) in rows(out).items() if bad]
    assert flagged[0] == first, out
    assert f"FIRST FLAGGED: {first}:" in out


class BrokenHeadSum(CudaRounding):
    """Sums the MTP head's two fc halves 10 % high (`add` serves the head alone)."""

    def add(self, x, y):  # type: ignore[no-untyped-def]
        return super().add(x, y) * np.float32(1.1)


HEAD_NAMES = {"mtp.embed", "mtp.fc", "mtp.attn.q", "mtp.attn.core", "mtp.mlp.router_ids", "mtp.mlp.routed", "mtp.out"}


@pytest.mark.parametrize("backend, first", [(CudaRounding, None), (BrokenHeadSum, "mtp.fc")], ids=["stand-in", "broken-sum"])
def test_the_mtp_head_is_checked(backend: type[CudaRounding], first: str | None, demo_mtp: Path,  # noqa: F811
                                 monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint with the MTP head: its intermediates follow the model's, teacher-forced on the
    checked run (a prefill of the head's rows, then its one-row draft steps)."""
    use_backend(monkeypatch, backend)
    code, out = run(["--model", str(demo_mtp), "--device", "cuda", "--decode-steps", "2"], capsys)
    table = rows(out)
    assert HEAD_NAMES <= set(table), out
    assert list(table).index("mtp.embed") > list(table).index("logits"), out
    if first is None:
        assert code == 0 and max(rel for name, (rel, _) in table.items() if name.startswith("mtp.")) > 1e-4, out
        return
    assert code == 1 and [name for name, (_, bad) in table.items() if bad][0] == first, out


def router_capture(logits: np.ndarray, ids: np.ndarray) -> Capture:
    capture = Capture(positions=np.arange(logits.shape[0], dtype=np.int32))
    capture("layer.0.mlp.router_logits", logits)
    capture("layer.0.mlp.router_ids", ids)
    return capture


def test_near_tie_flips_are_noted_and_others_flagged(rng: np.random.Generator) -> None:
    T, E = 6, 16
    logits = rng.normal(size=(T, E)).astype(np.float32)  # [T, E]
    ids = np.argsort(-logits, axis=-1)[:, :2].astype(np.int32)  # [T, 2]
    row = int(rng.integers(T))
    second, third = np.argsort(-logits[row])[1:3]
    logits[row, third] = logits[row, second] - 1e-4  # a near tie between the 2nd and 3rd expert
    reference = router_capture(logits, ids)
    tied = logits.copy()
    tied[row, third] += 2e-4  # the checked run's rounding moved it past the boundary
    tied_ids = ids.copy()
    tied_ids[row, 1] = third
    [_, report] = compare_runs(router_capture(tied, tied_ids), reference, DEFAULT_TOLERANCE)
    assert not report.flagged and report.note == "1 near-tie flip(s)", report
    assert report.rel_err == 1 / T

    far_ids = ids.copy()
    far_ids[row, 1] = np.argmin(logits[row])  # the least likely expert: no rounding explains it
    [_, report] = compare_runs(router_capture(logits, far_ids), reference, DEFAULT_TOLERANCE)
    assert report.flagged and f"position(s) [{row}]" in report.note, report


def test_non_finite_values_are_flagged(rng: np.random.Generator) -> None:
    values = rng.normal(size=(5, 8)).astype(np.float32)
    reference, checked = Capture(positions=np.arange(5, dtype=np.int32)), Capture(positions=np.arange(5, dtype=np.int32))
    reference("embed", values)
    poisoned = values.copy()
    poisoned[int(rng.integers(5)), int(rng.integers(8))] = np.nan
    checked("embed", poisoned)
    [report] = compare_runs(checked, reference, DEFAULT_TOLERANCE)
    assert report.flagged and report.note == "non-finite values"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--decode-steps", "2"], "--decode-steps, --prefill-chunk and --tolerance apply to --against cpu only"),
        (["--prefill-chunk", "2"], "--decode-steps, --prefill-chunk and --tolerance apply to --against cpu only"),
        (["--against", "cpu", "--oracle-device", "cpu"], "--oracle-device applies to --against transformers only"),
        (["--against", "cpu", "--decode-steps", "400"], "--decode-steps must be in 0..3 for a 4-token prompt"),
        (["--against", "cpu", "--tolerance", "0"], "--tolerance must be in (0, 1)"),
    ],
)
def test_bad_options_are_one_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert "loading weights" not in err


@pytest.mark.gpu
@pytest.mark.parametrize("passes", [[], ["--prefill-chunk", "7"]], ids=["one-pass", "passes-of-7"])
def test_the_gpu_matches_numpy_op_by_op(passes: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """The demo on the CUDA backend: prefill (GEMMs; in passes, later ones reading the cache and
    states earlier ones left) and decode steps (GEMVs), every intermediate."""
    require_demo_cuda()
    code, out = run(["--device", "cuda", "--decode-steps", "3", *passes], capsys)
    print(out)
    assert code == 0, out
    assert "on cuda" in out


@pytest.mark.gpu
def test_the_gpu_head_matches_numpy_op_by_op(demo_mtp: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    """The demo with an MTP head on the CUDA backend: the head's intermediates too (its prefill
    rows and its one-row draft steps)."""
    require_demo_cuda()
    code, out = run(["--model", str(demo_mtp), "--device", "cuda", "--decode-steps", "3"], capsys)
    print(out)
    assert code == 0, out
    fused_prep = os.environ.get("ATLAS_ATTENTION_PREP", "").strip() == "fused"  # the kernel serves a dump: no rotated q
    assert HEAD_NAMES - ({"mtp.attn.q"} if fused_prep else set()) | {"mtp.attn.v"} <= set(rows(out)), out
