#!/usr/bin/env bash
# The one device call (issue 4): build and install the h200 wheel, run the GPU tests, the decode
# benchmark and atlas.info. Each stage is timed, has its own timeout, and tees its output into
# $OUT/log.txt; a failed stage does not stop the next. A summary table is printed LAST.
#
#   OUT=/some/dir scripts/device_check.sh            # on the device machine, from the repo root
#   ATLAS_WHEEL=wheels/atlas-...+h200...whl ...       # use a carried wheel instead of building
#
# Files under $OUT (at most 8): log.txt, info.json, junit.xml, results.json, summary.txt.
set -u -o pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-/tmp/atlas-device-out}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
: >"$LOG"
PY="${PYTHON:-python3}"
BUDGET_S="${ATLAS_CHECK_BUDGET_S:-510}"  # the whole script, well inside the 9-minute call
WHEEL_DIR=/tmp/atlas-wheel
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1  # no network there
START=$(date +%s)
SUMMARY=()

elapsed() { echo $(($(date +%s) - START)); }

# stage NAME LIMIT_S COMMAND: run COMMAND (a bash string) under a timeout clipped to what is left
# of the budget; record status and seconds.
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
  echo "=== [$name] limit ${limit}s at +$(elapsed)s: $cmd" | tee -a "$LOG"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" bash -o pipefail -c "$cmd" 2>&1 | tee -a "$LOG"
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

stage gpu 30 "nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,memory.used,clocks.sm,clocks.mem --format=csv; \
  $PY -c 'import sys, numpy, torch, transformers; from cuda import bindings; print(sys.version.split()[0], \"numpy\", numpy.__version__, \"torch\", torch.__version__, \"transformers\", transformers.__version__, \"cuda-bindings\", bindings.__version__)'; \
  echo nvcc: $NVCC; ${NVCC:-true} --version | tail -2"

if [[ -n "${ATLAS_WHEEL:-}" ]]; then
  stage wheel 20 "mkdir -p $WHEEL_DIR && rm -f $WHEEL_DIR/*.whl && cp '$ATLAS_WHEEL' $WHEEL_DIR/ && ls -l $WHEEL_DIR"
else
  stage wheel 150 "rm -rf $WHEEL_DIR && ATLAS_NVCC='$NVCC' CUDACXX='$NVCC' ATLAS_TARGET_HW=h200 ATLAS_TARGET_MODEL='*' \
    ATLAS_TARGET_QUANT=bf16 $PY -m pip wheel --no-build-isolation --no-deps -w $WHEEL_DIR . && ls -l $WHEEL_DIR"
fi

stage install 60 "$PY -m pip install --no-deps --force-reinstall $WHEEL_DIR/atlas-*.whl 2>&1 | tail -3"

stage info 30 "cd /tmp && $PY -m atlas.info --json >'$OUT/info.json' && $PY -m atlas.info | head -20"

stage demo 60 "cd /tmp && ATLAS_CUDA_CHECK=1 $PY -m atlas.run --device cuda --max-tokens 80"

GPU_PYTEST="ATLAS_TEST_INSTALLED=1 ATLAS_REQUIRE_GPU=1 ATLAS_CUDA_CHECK=1 $PY -m pytest -m gpu -q -rfE -p no:cacheprovider"
# Kernel-level tests first (they name the failing op), then everything else marked gpu.
KERNEL_TESTS="tests/test_gpu_ops.py tests/test_gpu_delta_chunked.py tests/test_gpu_chain.py tests/test_gpu_quant.py"
stage ops 150 "$GPU_PYTEST --maxfail=40 --junitxml='$OUT/junit-ops.xml' $KERNEL_TESTS"

stage model 200 "$GPU_PYTEST --maxfail=10 --durations=5 --junitxml='$OUT/junit-model.xml' tests \
  $(for f in $KERNEL_TESTS; do printf -- '--ignore=%s ' "$f"; done)"

stage bench 170 "cd /tmp && $PY '$REPO/bench/decode.py' --out '$OUT/results.json' --budget-s 150"

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
} 2>&1 | tee "$OUT/summary.txt" | tee -a "$LOG"
