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
# bench runs, the in-graph kernel costs and transformers' rates), summary.txt. atlas.info's JSON is in log.txt.
# A stage past its limit gets SIGINT first (pytest then still writes its junit file), SIGKILL 10 s later.
# The test stages run through scripts/gpu_pytest.py: a kernel fault that loses the CUDA context fails
# its test, and the tests after it go on in a new process.
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

# The installed kernels op by op against numpy on the demo (bf16, in passes, each KV level, fp8,
# nvfp4), with the other forms (the fused DeltaNet decode kernel, router, attention prep and norms, wgmma,
# the SIMT prefill attention) in the whole model: a table a line per check, in this call's output. The
# default forms get the same check in the model stage (tests/test_cross_check.py) and the ops
# stage (the op-by-op tests of test_gpu_quant.py, test_gpu_kv.py).
OPT_IN_FORMS="ATLAS_DELTANET_DECODE=fused ATLAS_ROUTER=fused ATLAS_ATTENTION_PREP=fused ATLAS_GEMM=wgmma ATLAS_PREFILL_ATTENTION=simt \
  ATLAS_PREFETCH=l2 ATLAS_NORM=fused"
stage verify 40 "cd /tmp && ATLAS_CUDA_CHECK=1 $OPT_IN_FORMS $PY -m atlas.verify"

# gpu_pytest JUNIT ARGS...: pytest over GPU tests; a sticky CUDA error (a kernel fault loses the
# process's context) fails its test and the rest resume in a new process (scripts/gpu_pytest.py).
gpu_pytest() {
  echo "ATLAS_TEST_INSTALLED=1 ATLAS_REQUIRE_GPU=1 ATLAS_REQUIRE_GPU_QUANT=1 ATLAS_CUDA_CHECK=1 \
    $PY '$REPO/scripts/gpu_pytest.py' --junitxml '$1' -- -m gpu -q -rfE -p no:cacheprovider -o junit_logging=system-out \
    --continue-on-collection-errors ${*:2}"
}
# Kernel-level tests first (they name the failing op): the default kernels, then the opt-in forms
# (off until these pass) and the newest default not yet run on a GPU (the decode loop a step ahead),
# so they run even when `ops` is left out; then everything else marked gpu.
KERNEL_TESTS="tests/test_gpu_ops.py tests/test_gpu_split_linear.py tests/test_gpu_moe_shared.py tests/test_gpu_chain.py \
  tests/test_gpu_quant.py tests/test_gpu_kv.py"
# Newest defaults: the decode GEMVs and router with their weights issued first (2026-12-05).
OPS_OPTIN="test_weight_prefetch_changes_no_bit test_a_row_of_nan_alone_picks_no_token test_sample_matches_reference \
  test_sample_over_any_row_length test_sample_top_p_alone_matches_reference test_sample_extremes_match_reference \
  test_linear test_router test_moe_experts"
OPTIN_TESTS="tests/test_gpu_router_fused.py tests/test_gpu_delta_decode.py tests/test_gpu_attention_mma.py \
  tests/test_gpu_gemm_wgmma.py tests/test_gpu_delta_chunked.py tests/test_gpu_attention_prep.py tests/test_gpu_norm_fused.py \
  $(for t in $OPS_OPTIN; do printf 'tests/test_gpu_ops.py::%s ' "$t"; done) \
  tests/test_gpu_quant.py::test_quant_linear tests/test_gpu_quant.py::test_quant_moe_experts \
  tests/test_gpu_chain.py::test_running_ahead_gives_the_tokens_in_turn"
stage ops 210 "$(gpu_pytest "$OUT/junit-ops.xml" --maxfail=40 $KERNEL_TESTS)"
stage optin 90 "$(gpu_pytest "$OUT/junit-optin.xml" --maxfail=40 $OPTIN_TESTS)"

stage model 125 "$(gpu_pytest "$OUT/junit-model.xml" --maxfail=10 --durations=5 tests \
  $(for f in $KERNEL_TESTS $OPTIN_TESTS tests/test_verify.py; do printf -- '--ignore=%s ' "$f"; done))"

# Benchmarks size their --budget-s to the stage's (clipped) limit so they write their JSON in time.
stage bench 115 "cd /tmp && $PY '$REPO/bench/decode.py' --skip-transformers --out '$OUT/results.json' --budget-s \$((ATLAS_STAGE_LIMIT - 10))"
# transformers bf16 on the same synthetic weights and GPU, in its own process: inside bench it only
# ran when atlas's timings left half the stage, and it shares no memory with atlas's weights here
# (an H100 holds one copy of the 69 GB, not two). Speedups over bench's results.json where it wrote one.
stage hf 100 "cd /tmp && $PY '$REPO/bench/decode.py' --transformers-only --out $VARIANTS_DIR/transformers.json \
  \$([[ -f '$OUT/results.json' ]] && echo --against '$OUT/results.json')"

# fp8 and nvfp4 decode first: never yet timed on a GPU, while the MoE comparison was (2026-12-04),
# so a part the budget skips is the MoE one.
stage qbench 120 "cd /tmp && $PY '$REPO/bench/quant.py' --parts fp8,nvfp4,moe --out '$OUT/qbench.json' \
  --budget-s \$((ATLAS_STAGE_LIMIT - 10))"

# The opt-in decode forms are timed inside bench itself, in interleaved rounds on one loaded model
# (bench/launch_settings.py: the fused forms, pdl and the L2 prefetch; the split draw). Here:
# prefill with the tensor-core attention (the default) and the SIMT one on the same model, both
# with the wgmma GEMM (ATLAS_GEMM=wgmma; bench's prefill number is the mma.sync GEMM beside it),
# into $OUT/variants.json (8 files at most) with the marginal costs below.
stage prefill 40 "cd /tmp && ATLAS_GEMM=wgmma $PY '$REPO/bench/decode.py' --prefill-only --out $VARIANTS_DIR/mma_prefill.json"
# Each decode kernel's cost inside the replayed graph (bench/step_marginal.py: the step with one
# kernel's launches doubled against the plain one): the eager profile above puts a ~10 us floor
# on every launch, too coarse to say which of 473 launches to fuse or speed up. Then each GEMV shape
# and the MoE expert step alone over weights that overflow L2 (bench/weight_bandwidth.py): GB/s.
# Inside the stage's budget: the kernels it leaves no time for are named as not doubled.
stage marginal 75 "cd /tmp && $PY '$REPO/bench/decode.py' --marginal-only --out $VARIANTS_DIR/marginal.json \
  --budget-s \$((ATLAS_STAGE_LIMIT - 10))"
# MTP speculation (on by default for a checkpoint with the head) runs its verify passes eagerly:
# what one pass costs against the plain replayed step, so the tokens per pass a real head must
# reach to pay (bench/spec_cost.py).
stage spec 50 "cd /tmp && $PY '$REPO/bench/decode.py' --spec-only --out $VARIANTS_DIR/spec.json"
$PY "$REPO/scripts/device_summary.py" variants "$VARIANTS_DIR" "$OUT/variants.json"

{
  echo
  echo "=== summary (total $(elapsed)s of ${BUDGET_S}s budget)"
  printf '%-10s %-8s %6s  %s\n' stage status time detail
  for line in "${SUMMARY[@]}"; do echo "$line"; done
  $PY "$REPO/scripts/device_summary.py" report "$OUT"
} 2>&1 | tee "$OUT/summary.txt" | tee -a "$LOG"
