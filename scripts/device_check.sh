#!/usr/bin/env bash
# The one device call (issues 4, 5): build and install the h200 wheel (every model, every quant),
# run the GPU tests, the decode benchmark, the quantized benchmark and atlas.info. Each stage is
# timed, has its own timeout, and tees its output into $OUT/log.txt; a failed stage does not stop
# the next. A summary table is printed LAST.
#
#   OUT=/some/dir scripts/device_check.sh            # on the device machine, from the repo root
#   ATLAS_WHEEL=wheels/atlas-...+h200...whl ...       # use a carried wheel instead of building
#
# Files under $OUT (at most 8): log.txt, junit-ops.xml, junit-optin.xml, junit-model.xml,
# results.json (bench/decode.py), qbench.json (bench/quant.py), variants.json (the opt-in forms'
# bench runs), summary.txt. atlas.info's JSON is in log.txt.
# A stage past its limit gets SIGINT first (pytest then still writes its junit file), SIGKILL 10 s later.
set -u -o pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-/tmp/atlas-device-out}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
: >"$LOG"
PY="${PYTHON:-python3}"
BUDGET_S="${ATLAS_CHECK_BUDGET_S:-540}"  # the whole script, inside the 10-minute call
WHEEL_DIR=/tmp/atlas-wheel
VARIANTS_DIR=/tmp/atlas-variants
rm -rf "$VARIANTS_DIR" && mkdir -p "$VARIANTS_DIR"
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1  # no network there
START=$(date +%s)
SUMMARY=()

elapsed() { echo $(($(date +%s) - START)); }

# stage NAME LIMIT_S COMMAND: run COMMAND (a bash string) under a timeout clipped to what is left
# of the budget (exported as ATLAS_STAGE_LIMIT, so a benchmark can size its own budget to it);
# record status and seconds.
# ATLAS_CHECK_STAGES (space-separated names) runs only those stages; unset runs them all.
stage() {
  local name=$1 limit=$2 cmd=$3 left rc t0 secs
  if [[ -n "${ATLAS_CHECK_STAGES:-}" && " $ATLAS_CHECK_STAGES " != *" $name "* ]]; then
    return 0
  fi
  left=$((BUDGET_S - $(elapsed)))
  if ((left < 15)); then
    SUMMARY+=("$(printf '%-10s %-8s %6s  %s' "$name" SKIPPED "-" "budget spent")")
    return 0
  fi
  ((limit > left)) && limit=$left
  export ATLAS_STAGE_LIMIT=$limit
  echo "=== [$name] limit ${limit}s at +$(elapsed)s: $cmd" | tee -a "$LOG"
  t0=$(date +%s)
  timeout --signal=INT --kill-after=10 "$limit" bash -o pipefail -c "$cmd" 2>&1 | tee -a "$LOG"
  rc=$?
  secs=$(($(date +%s) - t0))
  local status=ok
  ((rc == 124 || rc == 137)) && status=TIMEOUT
  ((rc != 0 && rc != 124 && rc != 137)) && status=FAIL
  echo "=== [$name] $status rc=$rc ${secs}s" | tee -a "$LOG"
  SUMMARY+=("$(printf '%-10s %-8s %6s  rc=%s' "$name" "$status" "${secs}s" "$rc")")
  return 0
}

NVCC="${ATLAS_NVCC:-$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)}"

stage gpu 20 "nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,memory.used,clocks.sm,clocks.mem --format=csv; \
  $PY -c 'import sys, numpy, torch, transformers; from cuda import bindings; print(sys.version.split()[0], \"numpy\", numpy.__version__, \"torch\", torch.__version__, \"transformers\", transformers.__version__, \"cuda-bindings\", bindings.__version__)'; \
  echo nvcc: $NVCC; ${NVCC:-true} --version | tail -2"

if [[ -n "${ATLAS_WHEEL:-}" ]]; then
  stage wheel 20 "mkdir -p $WHEEL_DIR && rm -f $WHEEL_DIR/*.whl && cp '$ATLAS_WHEEL' $WHEEL_DIR/ && ls -l $WHEEL_DIR"
else
  stage wheel 140 "rm -rf $WHEEL_DIR && ATLAS_NVCC='$NVCC' CUDACXX='$NVCC' ATLAS_TARGET_HW=h200 ATLAS_TARGET_MODEL='*' \
    ATLAS_TARGET_QUANT='*' $PY -m pip wheel --no-build-isolation --no-deps -w $WHEEL_DIR . && ls -l $WHEEL_DIR"
fi

stage install 40 "$PY -m pip install --no-deps --force-reinstall $WHEEL_DIR/atlas-*.whl 2>&1 | tail -3"

stage info 20 "cd /tmp && $PY -m atlas.info --json && $PY -m atlas.info | head -20"

stage demo 45 "cd /tmp && ATLAS_CUDA_CHECK=1 $PY -m atlas.run --device cuda --max-tokens 80"

GPU_PYTEST="ATLAS_TEST_INSTALLED=1 ATLAS_REQUIRE_GPU=1 ATLAS_REQUIRE_GPU_QUANT=1 ATLAS_CUDA_CHECK=1 $PY -m pytest -m gpu -q -rfE -p no:cacheprovider -o junit_logging=system-out --continue-on-collection-errors"
# Kernel-level tests first (they name the failing op): the default kernels, then the opt-in forms
# (off until these pass), then everything else marked gpu.
KERNEL_TESTS="tests/test_gpu_ops.py tests/test_gpu_split_linear.py tests/test_gpu_moe_shared.py tests/test_gpu_chain.py \
  tests/test_gpu_quant.py tests/test_gpu_kv.py"
OPTIN_TESTS="tests/test_gpu_router_fused.py tests/test_gpu_delta_decode.py tests/test_gpu_attention_mma.py \
  tests/test_gpu_gemm_wgmma.py tests/test_gpu_delta_chunked.py"
stage ops 90 "$GPU_PYTEST --maxfail=40 --junitxml='$OUT/junit-ops.xml' $KERNEL_TESTS"
stage optin 60 "$GPU_PYTEST --maxfail=40 --junitxml='$OUT/junit-optin.xml' $OPTIN_TESTS"

stage model 110 "$GPU_PYTEST --maxfail=10 --durations=5 --junitxml='$OUT/junit-model.xml' tests \
  $(for f in $KERNEL_TESTS $OPTIN_TESTS; do printf -- '--ignore=%s ' "$f"; done)"

# Benchmarks size their --budget-s to the stage's (clipped) limit so they write their JSON in time.
stage bench 130 "cd /tmp && $PY '$REPO/bench/decode.py' --out '$OUT/results.json' --budget-s \$((ATLAS_STAGE_LIMIT - 10))"

stage qbench 90 "cd /tmp && $PY '$REPO/bench/quant.py' --out '$OUT/qbench.json' --budget-s \$((ATLAS_STAGE_LIMIT - 10))"

# The opt-in forms, measured beside bench's defaults: decode with the fused DeltaNet decode kernel
# and the one-launch router (120 fewer launches per Qwen3.6 token), prefill with the tensor-core
# attention (and the SIMT one on the same model), both with the wgmma GEMM (ATLAS_GEMM=wgmma; bench's
# simt prefill number is the mma.sync GEMM beside it). Both land in $OUT/variants.json (8 files at most).
stage fused 45 "cd /tmp && ATLAS_DELTANET_DECODE=fused ATLAS_ROUTER=fused $PY '$REPO/bench/decode.py' --decode-only \
  --out $VARIANTS_DIR/fused_decode.json"
stage prefill 40 "cd /tmp && ATLAS_PREFILL_ATTENTION=mma ATLAS_GEMM=wgmma $PY '$REPO/bench/decode.py' --prefill-only --out $VARIANTS_DIR/mma_prefill.json"
$PY - "$VARIANTS_DIR" "$OUT/variants.json" <<'EOF'
import json, pathlib, sys
found = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))}
if found:
    pathlib.Path(sys.argv[2]).write_text(json.dumps(found, indent=1))
EOF

{
  echo
  echo "=== summary (total $(elapsed)s of ${BUDGET_S}s budget)"
  printf '%-10s %-8s %6s  %s\n' stage status time detail
  for line in "${SUMMARY[@]}"; do echo "$line"; done
  for junit in "$OUT"/junit-*.xml; do
    [[ -f "$junit" ]] || continue
    $PY - "$junit" <<'EOF'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print(sys.argv[1].rsplit("/", 1)[-1] + ": {tests} tests, {failures} failed, {errors} errors, {skipped} skipped".format(**total))
EOF
  done
  if [[ -f "$OUT/results.json" ]]; then
    $PY - "$OUT/results.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
for key in ("prefill_tok_s", "decode_tok_s", "decode_bytes_per_token", "decode_gb_s",
            "copy_gb_s", "roofline_pct", "transformers", "speedup_vs_transformers", "notes"):
    if key in r:
        print(f"{key}: {json.dumps(r[key])}")
EOF
  fi
  if [[ -f "$OUT/variants.json" ]]; then
    $PY - "$OUT/variants.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
if "fused_decode" in r:
    d = r["fused_decode"]
    forms = d.get("kernel_forms", {})
    print(f"fused decode ({forms.get('ATLAS_DELTANET_DECODE')} DeltaNet, {forms.get('ATLAS_ROUTER')} router): "
          f"{d['decode_tok_s']:.1f} tok/s, roofline {d['roofline_pct']:.1f}%")
if "mma_prefill" in r:
    print("prefill tok/s by attention form:", json.dumps(r["mma_prefill"].get("prefill_tok_s_by_form")))
EOF
  fi
  if [[ -f "$OUT/qbench.json" ]]; then
    $PY - "$OUT/qbench.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print("qbench weight memory GB:", {f: round(b / 1e9, 2) for f, b in r.get("weight_memory_bytes", {}).items()})
for fmt in ("fp8", "nvfp4"):
    d = r.get(fmt)
    if d:
        print(f"qbench {fmt}: decode {d['decode_tok_s']:.1f} tok/s, {d['decode_gb_s']:.0f} GB/s, "
              f"roofline {d['roofline_pct']:.1f}% (ceiling {d['roofline_tok_s']:.0f} tok/s), prefill 1024 {d['prefill_tok_s_1024']:.0f} tok/s")
moe = r.get("moe", {})
for fmt in ("bf16", "fp8", "nvfp4"):
    m = moe.get(fmt)
    if m:
        print(f"qbench moe {fmt} ({moe['tokens']} tok x {moe['experts']} experts): "
              + ", ".join(f"{mode} grouped {m[mode]['grouped_ms']:.3f} ms vs loop {m[mode]['loop_ms']:.3f} ms = {m[mode]['speedup']:.2f}x"
                          for mode in ("eager", "graph") if mode in m) + f", experts {m['expert_weight_bytes'] / 1e9:.3f} GB")
if "memory_ratio_vs_bf16" in moe:
    print("qbench moe memory vs bf16:", {f: round(v, 2) for f, v in moe["memory_ratio_vs_bf16"].items()})
if r.get("notes"):
    print("qbench notes:", json.dumps(r["notes"]))
EOF
  fi
} 2>&1 | tee "$OUT/summary.txt" | tee -a "$LOG"
