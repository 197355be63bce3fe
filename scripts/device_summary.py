"""The JSON half of scripts/device_check.sh: merge the opt-in forms' bench runs into variants.json,
and print the summary lines of what landed under $OUT (junit totals and each failing test with
the first line of its message, bench/decode.py's
results.json, variants.json, bench/quant.py's qbench.json). Files that are missing are left out,
so a stage that timed out still leaves the summary of the others.

    python scripts/device_summary.py variants SRC_DIR OUT_FILE   # SRC_DIR/*.json -> one file, by stem
    python scripts/device_summary.py report OUT_DIR              # the lines, to stdout
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import kv_prefill  # noqa: E402  (its summary line)
import launch_settings  # noqa: E402  (its summary line)
import spec_cost  # noqa: E402  (its summary line)
import step_marginal  # noqa: E402  (its summary line)
import step_profile  # noqa: E402  (its summary line)
import weight_bandwidth  # noqa: E402  (its summary line)

LISTED_FAILURES = 8  # per junit file: three files of them stay inside the call's 12,000-character output tail
MESSAGE_CHARS = 160
RESULT_KEYS = ("prefill_tok_s", "decode_tok_s", "decode_tok_s_by_launch", "decode_sampled_tok_s",
               "decode_sampled_tok_s_by_form", "pick_ops_us",
               "decode_bytes_per_token",
               "decode_gb_s", "copy_gb_s",
               "roofline_pct", "transformers", "speedup_vs_transformers", "notes")


def merge_variants(src: Path, out: Path) -> None:
    found = {p.stem: json.loads(p.read_text()) for p in sorted(src.glob("*.json"))}
    if found:
        out.write_text(json.dumps(found, indent=1))


def junit_lines(path: Path) -> list[str]:
    """The totals, then each failing test (at most LISTED_FAILURES) with its message's first line:
    what went wrong shows in the call's output even before the files are read."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    lines = [f"{path.name}: {total['tests']} tests, {total['failures']} failed, {total['errors']} errors, {total['skipped']} skipped"]
    failed = [(case, problem) for case in root.iter("testcase") for problem in case if problem.tag in ("failure", "error")]
    for case, problem in failed[:LISTED_FAILURES]:
        message = (problem.get("message") or problem.text or "").strip().splitlines() or [""]
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        lines.append(f"  {problem.tag.upper()} {test}: {message[0][:MESSAGE_CHARS]}")
    if len(failed) > LISTED_FAILURES:
        lines.append(f"  ... {len(failed) - LISTED_FAILURES} more in {path.name}")
    return lines


SIDE_LINES = (("decode_tok_s_by_setting", launch_settings.summary_line),
              ("decode_tok_s_by_run_ahead", launch_settings.run_ahead_line),
              ("decode_profile", step_profile.summary_line))


def side_line(name: str, side: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> str:
    """A side measure's line: render(side), or its name and why when it failed or was skipped
    (bench/decode.py's side_measure: {"error": ...})."""
    return f"{name}: {side['error']}" if "error" in side else render(side)


def decode_lines(r: dict[str, Any]) -> list[str]:
    """RESULT_KEYS as they are, then the side measures' lines."""
    lines = [f"{key}: {json.dumps(r[key])}" for key in RESULT_KEYS if key in r]
    lines += [side_line(key, side, render) for key, render in SIDE_LINES if isinstance(side := r.get(key), dict)]
    return lines


def transformers_line(r: dict[str, Any]) -> str:
    """The hf stage's JSON (bench/decode.py --transformers-only) in one line."""
    hf = r.get("transformers")
    if hf is None:
        return f"transformers bf16: no result ({'; '.join(r.get('notes', [])) or 'no note'})"
    prefill = ", ".join(f"{length} {rate:.0f}" for length, rate in hf["prefill_tok_s"].items())
    line = f"transformers bf16: decode {hf['decode_tok_s']:.1f} tok/s, prefill {prefill} tok/s"
    if speedup := r.get("speedup_vs_transformers"):
        line += "; atlas over it: " + ", ".join(f"{what} {ratio:.1f}x" for what, ratio in speedup.items())
    return line


def variant_lines(r: dict[str, Any]) -> list[str]:
    lines = []
    if "marginal" in r and "decode_marginal" in r["marginal"]:
        lines.append(step_marginal.summary_line(r["marginal"]["decode_marginal"]))
    if "marginal" in r and isinstance(alone := r["marginal"].get("weights_streamed_alone"), dict):
        lines.append(side_line("weights streamed alone", alone, weight_bandwidth.summary_line))
    if "transformers" in r:
        lines.append(transformers_line(r["transformers"]))
    if "spec" in r and "decode_spec" in r["spec"]:
        lines.append(spec_cost.summary_line(r["spec"]["decode_spec"]))
    if "mma_prefill" in r:
        lines.append(f"prefill tok/s by attention form: {json.dumps(r['mma_prefill'].get('prefill_tok_s_by_form'))}")
        if "prefill_tok_s_by_delta_rule" in r["mma_prefill"]:
            lines.append(f"prefill tok/s by delta rule form: {json.dumps(r['mma_prefill']['prefill_tok_s_by_delta_rule'])}")
        if "prefill_attention_by_level" in r["mma_prefill"]:
            lines.append(kv_prefill.summary_line(r["mma_prefill"]["prefill_attention_by_level"]))
    return lines


def moe_line(fmt: str, moe: dict[str, Any]) -> str:
    m = moe[fmt]
    modes = ", ".join(f"{mode} grouped {m[mode]['grouped_ms']:.3f} ms vs loop {m[mode]['loop_ms']:.3f} ms = "
                      f"{m[mode]['speedup']:.2f}x" for mode in ("eager", "graph") if mode in m)
    return f"qbench moe {fmt} ({moe['tokens']} tok x {moe['experts']} experts): {modes}, experts {m['expert_weight_bytes'] / 1e9:.3f} GB"


def qbench_lines(r: dict[str, Any]) -> list[str]:
    memory = {f: round(b / 1e9, 2) for f, b in r.get("weight_memory_bytes", {}).items()}
    lines = [f"qbench weight memory GB: {memory}"]
    for fmt in ("fp8", "nvfp4"):
        if d := r.get(fmt):
            lines.append(f"qbench {fmt}: decode {d['decode_tok_s']:.1f} tok/s, {d['decode_gb_s']:.0f} GB/s, "
                         f"roofline {d['roofline_pct']:.1f}% (ceiling {d['roofline_tok_s']:.0f} tok/s), "
                         f"prefill {d['decode_context']} {d['prefill_tok_s_1024']:.0f} tok/s")
            if by_norm := d.get("decode_tok_s_by_norm"):
                lines.append(f"qbench {fmt}: decode tok/s by norm form {json.dumps(by_norm)}")
    moe = r.get("moe", {})
    lines += [moe_line(fmt, moe) for fmt in ("bf16", "fp8", "nvfp4") if fmt in moe]
    if "memory_ratio_vs_bf16" in moe:
        lines.append(f"qbench moe memory vs bf16: { {f: round(v, 2) for f, v in moe['memory_ratio_vs_bf16'].items()} }")
    if r.get("notes"):
        lines.append(f"qbench notes: {json.dumps(r['notes'])}")
    return lines


def report(out: Path) -> list[str]:
    lines = []
    for junit in sorted(out.glob("junit-*.xml")):
        try:
            lines += junit_lines(junit)
        except ET.ParseError as err:  # pytest killed while writing it
            lines.append(f"{junit.name}: unreadable ({err})")
    for name, render in (("results.json", decode_lines), ("variants.json", variant_lines), ("qbench.json", qbench_lines)):
        path = out / name
        if path.is_file():
            try:
                lines += render(json.loads(path.read_text()))
            except (ValueError, KeyError, TypeError) as err:  # one bad file must not hide the others
                lines.append(f"{name}: unreadable ({type(err).__name__}: {err})")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "variants":
        merge_variants(Path(argv[1]), Path(argv[2]))
        return 0
    if len(argv) == 2 and argv[0] == "report":
        print("\n".join(report(Path(argv[1]))))
        return 0
    print("usage: device_summary.py variants SRC_DIR OUT_FILE | report OUT_DIR", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
