#!/bin/bash
# Device check (GPU machine): install each wheel in DIR into its own target dir, print atlas.info, probe loads.
set -u
BENCH="$(cd "$(dirname "$0")" && pwd)"
cd "${1:?usage: bench/device_check.sh DIR_OF_WHEELS}"
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader
python -c "import cuda.bindings, sys; print('cuda.bindings', cuda.bindings.__version__, sys.version.split()[0])" || pip install -q cuda-bindings 2>&1 | tail -1
for w in *.whl; do
  t="$(mktemp -d)"
  python -m pip install -q --no-deps --target "$t" "$w" || { echo "install failed: $w"; continue; }
  echo "== $w"
  (cd /tmp && PYTHONPATH="$t" python -m atlas.info | head -4)
  (cd /tmp && CUDA_CACHE_DISABLE=1 PYTHONPATH="$t" python "$BENCH/module_load_probe.py") | tee -a "$OUT/device.jsonl"
done
