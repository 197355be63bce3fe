"""The device check's benchmark stages end to end on the host SIMT emulator (tests/_simt.py), so the
first GPU run does not spend its minutes on a bug in a script: bench/decode.py as the device check
runs it (default, with its decode settings and sampling forms, transformers left to its own stage;
--prefill-only with the tensor-core forms) and bench/quant.py (MoE grouped vs loop, fp8 and nvfp4
decode), each on a 4-layer model with the Qwen3.6 dimensions and tiny prompt lengths, then
scripts/device_summary.py over what they wrote.
The numbers are the emulator's, meaningless as speeds: only their presence and form are checked."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "scripts"))

import decode as bench_decode  # noqa: E402
import kv_prefill  # noqa: E402
import launch_settings  # noqa: E402
import pick_ops  # noqa: E402
import device_summary  # noqa: E402
import quant as bench_quant  # noqa: E402
import quant_moe  # noqa: E402
import step_profile  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.background("emulator-bench"),  # ~9 GB each: one at a time
              pytest.mark.skipif(shutil.which("g++") is None, reason="the host emulator is built with g++")]

LAYERS = "4"  # 3 DeltaNet + 1 full-attention layer
FORM_SWITCHES = ("ATLAS_GEMM", "ATLAS_PREFILL_ATTENTION", "ATLAS_ROUTER", "ATLAS_DELTA_RULE", "ATLAS_DELTANET_DECODE",
                 "ATLAS_ATTENTION_PREP", "ATLAS_NORM")


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The h200 kernels on the emulator, the default kernel forms, and prompt lengths it runs in
    seconds rather than hours."""
    from _simt import use_simt

    use_simt(monkeypatch, "h200")
    for switch in FORM_SWITCHES:
        monkeypatch.delenv(switch, raising=False)
    for name, value in (("PREFILL_LENGTHS", (4, 8)), ("DECODE_CONTEXT", 8), ("DECODE_TOKENS", 3),
                        ("SAMPLED_TOKENS", 3), ("WARMUP_TOKENS", 4), ("COPY_BYTES", 1 << 20)):
        monkeypatch.setattr(bench_decode, name, value)
    monkeypatch.setattr(step_profile, "QUEUE_BYTES", 1 << 16)
    monkeypatch.setattr(step_profile, "BACK_TO_BACK", 2)
    monkeypatch.setattr(pick_ops, "REPEATS", 1)
    monkeypatch.setattr(launch_settings, "CHECK_TOKENS", 3)
    monkeypatch.setattr(launch_settings, "TOKENS", 2)
    monkeypatch.setattr(launch_settings, "ROUNDS", 1)
    everything = launch_settings.Setting(fused=True, programmatic=True, prefetch=True, norm=True)
    monkeypatch.setattr(launch_settings, "SETTINGS", [launch_settings.SETTINGS[0], everything])  # plain and all on
    monkeypatch.setattr(bench_quant, "MOE_TOKENS", 4)
    monkeypatch.setattr(kv_prefill, "PROMPT_TOKENS", 8)
    monkeypatch.setattr(kv_prefill, "REPEATS", 1)
    monkeypatch.setattr(quant_moe, "REPEATS", 1)
    return monkeypatch


def run_decode_bench(monkeypatch: pytest.MonkeyPatch, out: Path, *flags: str) -> dict[str, Any]:
    monkeypatch.setattr(sys, "argv", ["decode.py", "--out", str(out), "--layers", LAYERS, "--budget-s", "1e6", *flags])
    assert bench_decode.main() == 0
    return json.loads(out.read_text())


def assert_rates(rates: dict[str, float], keys: set[str]) -> None:
    assert set(rates) == keys
    assert all(math.isfinite(v) and v > 0 for v in rates.values()), rates


def check_decode_result(r: dict[str, Any]) -> None:
    assert r["model"] == f"qwen3.6-35b-a3b dims, {LAYERS} layers, synthetic weights"
    assert "host SIMT emulator" in r["device"]
    assert math.isfinite(r["decode_tok_s"]) and r["decode_tok_s"] > 0
    assert r["decode_tokens"] == bench_decode.DECODE_TOKENS - 1
    parts = r["decode_bytes_per_token"]
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    assert r["roofline_pct"] == pytest.approx(100 * r["decode_gb_s"] / r["copy_gb_s"])


def check_launch_and_profile(r: dict[str, Any]) -> None:
    """bench/decode.py's own: decode under each (patched) setting, and the step profile."""
    by_setting = r["decode_tok_s_by_setting"]
    assert by_setting["tokens_differ"] == [] and by_setting["tokens_compared"] == 3, by_setting
    assert by_setting["rounds"] == 1
    rates = [by_setting[name] for name in ("plain", "fused+norm+pdl+l2")]
    assert all(math.isfinite(rate) and rate > 0 for rate in rates), by_setting
    profile = r["decode_profile"]
    kernels = profile["kernels"]
    assert {"atlas_embedding_bf16", "atlas_gemv_t1", "atlas_attention_decode"} <= set(kernels), kernels
    assert profile["launches_per_step"] == sum(k["launches"] for k in kernels.values()) >= 4 * 8  # 4 layers
    assert profile["kernel_us_per_step"] > 0
    assert 0 < profile["back_to_back_step_us"] and profile["host_gap_us"] == pytest.approx(
        profile["graph_step_us"] - profile["back_to_back_step_us"])
    assert list(kernels) == sorted(kernels, key=lambda k: -kernels[k]["us"])
    assert_rates(r["pick_ops_us"], {"argmax", "penalize", "sample_block", "sample_split", "count_token"})


def test_decode_bench_and_its_variants(emulated: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out, variants = tmp_path / "out", tmp_path / "variants"
    out.mkdir(), variants.mkdir()
    main = run_decode_bench(emulated, out / "results.json", "--skip-transformers")  # its own stage, hf
    check_decode_result(main)
    check_launch_and_profile(main)
    assert math.isfinite(main["decode_sampled_tok_s"]) and main["decode_sampled_tok_s"] > 0
    assert_rates(main["prefill_tok_s"], {"4", "8"})
    assert main["kernel_forms"]["ATLAS_GEMM"] == "mma"
    run_ahead = main["decode_tok_s_by_run_ahead"]
    assert run_ahead["rounds"] == 1 and all(run_ahead[key] > 0 for key in ("ahead", "in_turn")), run_ahead
    sample_forms = main["decode_sampled_tok_s_by_form"]
    assert sample_forms["rounds"] == 1 and all(sample_forms[form] > 0 for form in ("block", "split")), sample_forms
    assert "transformers" not in main and any("skipped (flag)" in n for n in main["notes"]), main["notes"]

    emulated.setenv("ATLAS_PREFILL_ATTENTION", "mma")
    emulated.setenv("ATLAS_GEMM", "wgmma")
    prefill = run_decode_bench(emulated, variants / "mma_prefill.json", "--prefill-only")
    assert (prefill["prefill_attention"], prefill["gemm"]) == ("mma", "wgmma")
    assert set(prefill["prefill_tok_s_by_form"]) == {"mma", "simt"}
    for rates in prefill["prefill_tok_s_by_form"].values():
        assert_rates(rates, {"4", "8"})
    assert set(prefill["prefill_tok_s_by_delta_rule"]) == {"recurrent", "chunked"}
    for rates in prefill["prefill_tok_s_by_delta_rule"].values():
        assert_rates(rates, {"4", "8"})
    assert "ATLAS_DELTA_RULE" not in os.environ  # restored
    by_level = prefill["prefill_attention_by_level"]
    assert by_level["prompt_tokens"] == 8
    assert list(by_level["us_by_level"]) == ["bf16", "fp8", "nvfp4", "turbo8", "turbo4", "turbo3"]
    for times in by_level["us_by_level"].values():
        assert_rates(times, {"simt", "mma"})

    device_summary.merge_variants(variants, out / "variants.json")
    lines = "\n".join(device_summary.report(out))
    assert "unreadable" not in lines, lines
    for expected in ("decode_tok_s: ", "decode_sampled_tok_s: ", 'pick_ops_us: {"argmax": ', "roofline_pct: ", "copy_gb_s: ",
                     "decode tok/s by setting (median of 1 interleaved rounds): plain ",
                     'decode_sampled_tok_s_by_form: {"block": ', "decode step: ",
                     'prefill tok/s by attention form: {"mma": ', 'prefill tok/s by delta rule form: {"recurrent": ', "prefill attention us per layer at 8 tokens: bf16 mma "):
        assert expected in lines, lines


def test_spec_bench(emulated: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--spec-only on one layer with the MTP head: plain decode, then speculation with K = 2."""
    import spec_cost

    emulated.setattr(spec_cost, "KS", (2,))
    emulated.setattr(spec_cost, "TOKENS", 3)
    emulated.setattr(sys, "argv", ["decode.py", "--out", str(tmp_path / "spec.json"), "--layers", "1", "--spec-only"])
    assert bench_decode.main() == 0
    r = json.loads((tmp_path / "spec.json").read_text())["decode_spec"]
    assert r["tokens"] == 3 and r["plain_tok_s"] > 0 and list(r["by_k"]) == ["2"]
    k2 = r["by_k"]["2"]
    assert k2["passes"] >= 1 and k2["tokens_per_pass"] == pytest.approx(2 / k2["passes"])
    assert k2["break_even_tokens_per_pass"] == pytest.approx(k2["pass_us"] * r["plain_tok_s"] / 1e6)
    assert spec_cost.summary_line(r).startswith(f"MTP speculation (random head): plain {r['plain_tok_s']:.1f} tok/s; K=2 ")


def test_marginal_bench(emulated: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--marginal-only on one layer (~3 min here): every kernel of the step doubled inside a
    captured graph, then each GEMV shape and the MoE expert step alone, and their summary lines."""
    import step_marginal
    import weight_bandwidth

    emulated.setattr(step_marginal, "STEPS", 2)  # one timed step after the capture
    for name, value in (("LAUNCHES", 1), ("REPEATS", 1), ("SPREAD_BYTES", 1 << 20), ("EXPERT_CHOICES", 2)):
        emulated.setattr(weight_bandwidth, name, value)
    out = tmp_path / "marginal.json"
    assert bench_decode.main(["--out", str(out), "--layers", "1", "--marginal-only", "--budget-s", "1e6"]) == 0
    r = json.loads(out.read_text())
    marginal, alone = r["decode_marginal"], r["weights_streamed_alone"]
    kernels = marginal["kernels"]
    assert marginal["skipped"] == [] and {"atlas_gemv_t1", "atlas_moe_gate_up_gemv", "atlas_gated_delta_rule"} <= set(kernels)
    assert marginal["launches_per_step"] == sum(row["launches"] for row in kernels.values())
    assert kernels["atlas_gemv_t1"]["weight_mb"] > 1017  # the lm_head's 248320 x 2048 alone
    assert {"2048x4096", "12352x2048", "248320x2048"} <= set(alone["gemv"]) and alone["moe_step"]["slots"] == 9
    lines = device_summary.variant_lines({"marginal": r})
    assert lines[0].startswith("in-graph cost: step ") and lines[1].startswith("weights streamed alone (GB/s): GEMV 2048x4096 ")


def test_quant_bench(emulated: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = tmp_path / "qbench.json"
    assert bench_quant.main(["--out", str(out), "--layers", LAYERS, "--budget-s", "1e6"]) == 0
    r = json.loads(out.read_text())
    assert r["notes"] == []
    for fmt in ("fp8", "nvfp4"):
        check_decode_result({**r[fmt], "model": r["model"], "copy_gb_s": r["copy_gb_s"]})
        by_norm = r[fmt]["decode_tok_s_by_norm"]
        assert by_norm["tokens_equal"] and by_norm["separate"] > 0 and by_norm["fused"] > 0, by_norm
    moe = r["moe"]
    assert (moe["tokens"], moe["experts"]) == (4, 256)
    for fmt in ("bf16", "fp8", "nvfp4"):
        for mode in ("eager", "graph"):
            timing = moe[fmt][mode]
            assert timing["speedup"] == pytest.approx(timing["loop_ms"] / timing["grouped_ms"])
    assert moe["memory_ratio_vs_bf16"]["nvfp4"] > moe["memory_ratio_vs_bf16"]["fp8"] > 1

    lines = "\n".join(device_summary.report(tmp_path))
    assert "unreadable" not in lines, lines
    for expected in ("qbench fp8: decode ", "qbench nvfp4: decode ", "qbench moe bf16 (4 tok x 256 experts): eager grouped",
                     "qbench moe memory vs bf16: ", "qbench nvfp4: decode tok/s by norm form "):
        assert expected in lines, lines
