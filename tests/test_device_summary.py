"""scripts/device_summary.py, the summary the device check prints last: junit totals, and one bad
or missing file never hides the lines of the others. (tests/test_bench_simt.py runs it over real
bench output from the emulator.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import device_summary  # noqa: E402


def write_junit(path: Path, counts: list[dict[str, int]]) -> None:
    suites = "".join('<testsuite name="pytest" ' + " ".join(f'{k}="{v}"' for k, v in c.items()) + "/>" for c in counts)
    path.write_text(f'<?xml version="1.0" encoding="utf-8"?><testsuites>{suites}</testsuites>')


def test_junit_totals_over_suites(tmp_path: Path, rng: np.random.Generator) -> None:
    counts = [{k: int(rng.integers(0, 50)) for k in ("tests", "failures", "errors", "skipped")} for _ in range(3)]
    write_junit(tmp_path / "junit-ops.xml", counts)
    total = {k: sum(c[k] for c in counts) for k in counts[0]}
    assert device_summary.report(tmp_path) == [
        f"junit-ops.xml: {total['tests']} tests, {total['failures']} failed, {total['errors']} errors, {total['skipped']} skipped"]


def test_failing_tests_are_listed_with_their_first_message_line(tmp_path: Path, rng: np.random.Generator) -> None:
    failing = int(rng.integers(1, device_summary.LISTED_FAILURES + 6))
    cases = "".join(
        f'<testcase classname="tests.test_gpu_ops" name="test_op[{i}]">'
        f'<{"failure" if i % 2 else "error"} message="AssertionError: op {i} off&#10;second line">trace</{"failure" if i % 2 else "error"}>'
        "</testcase>" for i in range(failing)
    ) + '<testcase classname="tests.test_gpu_ops" name="test_fine"/>'
    (tmp_path / "junit-ops.xml").write_text(f'<?xml version="1.0"?><testsuites><testsuite tests="{failing + 1}" '
                                            f'failures="{failing}">{cases}</testsuite></testsuites>')
    lines = device_summary.report(tmp_path)
    listed = min(failing, device_summary.LISTED_FAILURES)
    assert lines[1 : 1 + listed] == [
        f"  {'FAILURE' if i % 2 else 'ERROR'} tests.test_gpu_ops::test_op[{i}]: AssertionError: op {i} off" for i in range(listed)]
    more = failing - listed
    assert lines[1 + listed :] == ([f"  ... {more} more in junit-ops.xml"] if more else [])


def test_a_bad_file_is_named_and_the_others_still_print(tmp_path: Path) -> None:
    (tmp_path / "junit-model.xml").write_text('<?xml version="1.0"?><testsuites><testsuite tests="3"')  # killed mid-write
    (tmp_path / "results.json").write_text(json.dumps({"decode_tok_s": 412.5, "roofline_pct": 57.1}))
    (tmp_path / "variants.json").write_text(json.dumps({"marginal": {"decode_marginal": {}}}))  # no step_us
    (tmp_path / "qbench.json").write_text("{")
    lines = device_summary.report(tmp_path)
    assert lines[0].startswith("junit-model.xml: unreadable")
    assert "decode_tok_s: 412.5" in lines and "roofline_pct: 57.1" in lines
    assert any(line.startswith("variants.json: unreadable (KeyError") for line in lines), lines
    assert any(line.startswith("qbench.json: unreadable (JSONDecodeError") for line in lines), lines


def test_variants_merge_by_stem(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "variants.json"
    src.mkdir()
    assert device_summary.main(["variants", str(src), str(out)]) == 0
    assert not out.exists()  # nothing ran: no file, rather than an empty one
    (src / "marginal.json").write_text(json.dumps({"decode_context": 1024}))
    (src / "mma_prefill.json").write_text(json.dumps({"prefill_tok_s_by_form": {"mma": {"512": 9.0}}}))
    device_summary.merge_variants(src, out)
    assert json.loads(out.read_text()) == {"marginal": {"decode_context": 1024},
                                           "mma_prefill": {"prefill_tok_s_by_form": {"mma": {"512": 9.0}}}}


def test_usage_error_exits_2(capsys) -> None:
    assert device_summary.main(["report"]) == 2
    assert capsys.readouterr().err.startswith("usage: device_summary.py")


def test_marginal_and_delta_rule_variants_get_their_lines(rng: np.random.Generator) -> None:
    kernels = {f"atlas_k{i}": {"launches": int(rng.integers(1, 41)), "us": float(rng.uniform(1, 900))} for i in range(3)}
    for row in kernels.values():
        row["us_per_launch"] = row["us"] / row["launches"]
    step = float(rng.uniform(2000, 4000))
    marginal = {"step_us": step, "step_us_again": step + 3, "launches_per_step": sum(k["launches"] for k in kernels.values()),
                "kernel_us_sum": sum(k["us"] for k in kernels.values()), "outside_kernels_us": 100.0, "kernels": kernels}
    rule = {"recurrent": {"512": float(rng.uniform(1e3, 1e4))}, "chunked": {"512": float(rng.uniform(1e3, 1e4))}}
    gb_s = float(rng.uniform(500, 4500))
    alone = {"launches_per_replay": 24, "gemv": {"12288x2048": {"launches_per_step": 30, "us": 12.0, "gb_s": gb_s}},
             "moe_step": {"slots": 9, "us": 20.0, "gb_s": gb_s / 2}}
    lines = device_summary.variant_lines({"marginal": {"decode_marginal": marginal, "weights_streamed_alone": alone},
                                          "mma_prefill": {"prefill_tok_s_by_form": {}, "prefill_tok_s_by_delta_rule": rule}})
    assert lines[0].startswith(f"in-graph cost: step {step:.0f} us") and all(k in lines[0] for k in kernels)
    assert lines[1] == f"weights streamed alone (GB/s): GEMV 12288x2048 {gb_s:.0f}; MoE step (9 experts) {gb_s / 2:.0f}"
    assert lines[-1] == f"prefill tok/s by delta rule form: {json.dumps(rule)}"


def test_a_marginal_run_cut_by_its_budget_says_what_it_left_out(rng: np.random.Generator) -> None:
    kernels = {"atlas_gemv_t1": {"launches": 41, "us": float(rng.uniform(100, 900)), "us_per_launch": 10.0}}
    step = float(rng.uniform(2000, 4000))
    marginal = {"step_us": step, "step_us_again": step, "launches_per_step": 60, "kernel_us_sum": kernels["atlas_gemv_t1"]["us"],
                "outside_kernels_us": None, "skipped": ["atlas_rms_norm", "atlas_argmax_final"], "kernels": kernels}
    alone = {"error": "skipped: 4 s of --budget-s left, this measure starts with 15"}
    lines = device_summary.variant_lines({"marginal": {"decode_marginal": marginal, "weights_streamed_alone": alone}})
    assert "outside ? us" in lines[0] and lines[0].endswith("; not doubled (budget spent): atlas_rms_norm, atlas_argmax_final")
    assert lines[1] == f"weights streamed alone: {alone['error']}"


def test_spec_variant_gets_its_line(rng: np.random.Generator) -> None:
    plain = float(rng.uniform(200, 400))
    pass_us = float(rng.uniform(3000, 9000))
    k2 = {"tok_s": 1e6 / pass_us, "passes": 31, "tokens_per_pass": 1.0, "acceptance": 0.0, "pass_us": pass_us,
          "break_even_tokens_per_pass": pass_us * plain / 1e6}
    [line] = device_summary.variant_lines({"spec": {"decode_spec": {"plain_tok_s": plain, "tokens": 32, "by_k": {"2": k2}}}})
    assert line == (f"MTP speculation (random head): plain {plain:.1f} tok/s; K=2 {k2['tok_s']:.1f} tok/s, pass "
                    f"{pass_us / 1e3:.2f} ms, break-even {k2['break_even_tokens_per_pass']:.2f} tokens/pass")


def test_a_side_measure_that_failed_is_named_and_the_rest_still_shows(tmp_path: Path, rng: np.random.Generator) -> None:
    decode_tok_s = float(rng.uniform(200, 400))
    (tmp_path / "results.json").write_text(json.dumps({
        "decode_tok_s": decode_tok_s, "decode_tok_s_by_setting": {"error": "skipped: 12 s of --budget-s left"},
        "decode_tok_s_by_run_ahead": {"error": "RuntimeError: capture refused"}}))
    lines = device_summary.report(tmp_path)
    assert lines == [f"decode_tok_s: {json.dumps(decode_tok_s)}", "decode_tok_s_by_setting: skipped: 12 s of --budget-s left",
                     "decode_tok_s_by_run_ahead: RuntimeError: capture refused"]


def test_transformers_stage_gets_its_line(rng: np.random.Generator) -> None:
    hf_decode, speedup = float(rng.uniform(5, 50)), float(rng.uniform(2, 40))
    hf = {"transformers": {"decode_tok_s": hf_decode, "prefill_tok_s": {"512": 900.0, "2048": 1500.0}},
          "speedup_vs_transformers": {"decode": speedup, "prefill_512": 7.25}, "notes": []}
    [line] = device_summary.variant_lines({"transformers": hf})
    assert line == (f"transformers bf16: decode {hf_decode:.1f} tok/s, prefill 512 900, 2048 1500 tok/s; "
                    f"atlas over it: decode {speedup:.1f}x, prefill_512 7.2x")
    failed = {"notes": ["transformers comparison failed: OutOfMemoryError: CUDA out of memory"]}
    assert device_summary.variant_lines({"transformers": failed}) == [
        "transformers bf16: no result (transformers comparison failed: OutOfMemoryError: CUDA out of memory)"]


def test_decode_profile_line_gives_the_host_gap_when_measured(tmp_path: Path, rng: np.random.Generator) -> None:
    step, back_to_back = float(rng.uniform(3000, 4000)), float(rng.uniform(2000, 3000))
    profile = {"steps": 3, "launches_per_step": 473.0, "kernel_us_per_step": 6550.0, "graph_step_us": step,
               "outside_kernels_us_per_step": step - 6550.0, "kernels": {"atlas_gemv_t1": {"launches": 41.0, "us": 987.0}}}
    (tmp_path / "results.json").write_text(json.dumps({"decode_profile": profile}))
    older = device_summary.report(tmp_path)
    assert any(line.startswith(f"decode step: {step:.0f} us replayed, 6550 us in 473 kernels") for line in older), older
    profile.update(back_to_back_step_us=back_to_back, host_gap_us=step - back_to_back)
    (tmp_path / "results.json").write_text(json.dumps({"decode_profile": profile}))
    lines = device_summary.report(tmp_path)
    expected = (f"decode step: {step:.0f} us replayed ({back_to_back:.0f} back to back, so {step - back_to_back:.0f} us "
                "of pick, read-back and host per token), 6550 us in 473 kernels")
    assert any(line.startswith(expected) for line in lines), lines


def test_settings_line_names_each_rate_and_the_settings_that_differ(tmp_path: Path, rng: np.random.Generator) -> None:
    import launch_settings

    rates = {s.name: float(rng.uniform(250, 450)) for s in launch_settings.SETTINGS}
    rates["pdl"] = "not run: compute capability (8, 0) or the pycuda binding"
    result = {**rates, "tokens_differ": ["fused+l2"], "tokens_compared": 32, "rounds": 2}
    (tmp_path / "results.json").write_text(json.dumps({"decode_tok_s_by_setting": result}))
    [line] = [line for line in device_summary.report(tmp_path) if line.startswith("decode tok/s by setting")]
    assert line.startswith("decode tok/s by setting (median of 2 interleaved rounds): plain ")
    assert f"fused+pdl+l2 {rates['fused+pdl+l2']:.1f}" in line and " pdl " not in line
    assert line.endswith("; tokens differ: fused+l2")


def test_run_ahead_line_when_measured(tmp_path: Path, rng: np.random.Generator) -> None:
    ahead, in_turn = (float(r) for r in rng.uniform(250, 450, size=2))
    (tmp_path / "results.json").write_text(json.dumps({"decode_tok_s_by_run_ahead": {"ahead": ahead, "in_turn": in_turn,
                                                                                      "rounds": 2}}))
    assert f"decode tok/s a step ahead {ahead:.1f}, in turn {in_turn:.1f} (median of 2 interleaved rounds)" in \
        device_summary.report(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps({"decode_tok_s_by_run_ahead": {"error": "CudaError: lost"}}))
    assert not any("step ahead" in line for line in device_summary.report(tmp_path))
