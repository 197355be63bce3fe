"""Build benchmark (not a test): clean and no-op wheel build times for one tuple and for `*`,
wheel size per tuple, and the cold module-load cost of PTX vs cubin where a GPU is present.

    python bench/build.py [--tuple h200/qwen3.6-35b-a3b/bf16] [--skip-all]

Builds use this environment (--no-build-isolation; the build requirements must be installed) and
a fresh kernel cache, so "clean" includes every nvcc run. Results: bench/results/build-<date>.json
with the date, commit and machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from build_tools.selection import existing_targets  # noqa: E402
from atlas.targets import load_registry  # noqa: E402
from provenance import git_commit  # noqa: E402


def build(env: dict[str, str], out: Path) -> tuple[float, Path]:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    return seconds, max(out.glob("*.whl"), key=lambda p: p.stat().st_mtime)


def selection_env(cache: Path, hw: str, model: str = "*", quant: str = "*") -> dict[str, str]:
    return {**os.environ, "ATLAS_KERNEL_CACHE": str(cache), "ATLAS_TARGET_HW": hw,
            "ATLAS_TARGET_MODEL": model, "ATLAS_TARGET_QUANT": quant}


def clean_and_noop(name: str, env: dict[str, str], work: Path) -> dict[str, object]:
    clean, wheel = build(env, work / f"{name}-clean")
    noop, _ = build(env, work / f"{name}-noop")
    print(f"{name}: clean {clean:.1f} s, no-op {noop:.1f} s, wheel {wheel.stat().st_size} B", flush=True)
    return {"selection": name, "clean_s": round(clean, 2), "noop_s": round(noop, 2), "wheel": wheel.name,
            "wheel_bytes": wheel.stat().st_size}


LOAD_PROBE = """
import sys, time
from cuda.bindings import driver as d
data = open(sys.argv[1], "rb").read() + (b"\\0" if sys.argv[2] == "ptx" else b"")
assert d.cuInit(0)[0] == 0
_, dev = d.cuDeviceGet(0)
_, ctx = d.cuDevicePrimaryCtxRetain(dev)
d.cuCtxSetCurrent(ctx)
t = time.perf_counter(); err, mod = d.cuModuleLoadData(data); dt = time.perf_counter() - t
assert err == 0, err
print(dt)
"""


def module_load(out_dir: Path) -> list[dict[str, object]]:
    """Cold cuModuleLoadData of each compiled tuple this GPU can run (JIT cache disabled)."""
    try:
        cc = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                            capture_output=True, text=True, check=True).stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return []
    from atlas.targets import hardware_candidates

    record = json.loads((out_dir / "build.json").read_text())
    usable = {hw.name for hw in hardware_candidates(cc)}
    rows = []
    for t in record["tuples"]:
        if t["hw"] not in usable:
            continue
        for kind in ("ptx", "cubin"):
            path = t["modules"][0][kind]
            if not path:
                continue
            env = {**os.environ, "CUDA_CACHE_DISABLE": "1"}
            out = subprocess.run([sys.executable, "-c", LOAD_PROBE, str(REPO / path), kind], env=env,
                                 capture_output=True, text=True)
            seconds = float(out.stdout.strip()) if out.returncode == 0 else None
            rows.append({"tuple": f"{t['hw']}/{t['model']}/{t['quant']}", "kind": kind, "load_s": seconds,
                         "error": out.stderr[-300:] if out.returncode else ""})
    return rows


def machine() -> dict[str, object]:
    gpu = subprocess.run("nvidia-smi --query-gpu=name,driver_version --format=csv,noheader", shell=True,
                         capture_output=True, text=True).stdout.strip()
    return {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "python": platform.python_version(), "gpu": gpu or "none"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tuple", default="h200/qwen3.6-35b-a3b/bf16")
    parser.add_argument("--skip-all", action="store_true", help="skip the `*` build (slow on few cores)")
    args = parser.parse_args()
    parts = args.tuple.split("/")
    if len(parts) != 3 or not all(parts):
        parser.error(f"--tuple {args.tuple!r}: expected HW/MODEL/QUANT, e.g. h200/qwen3.6-35b-a3b/bf16")
    hw, model, quant = parts
    commit = git_commit()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        results = [clean_and_noop(args.tuple, selection_env(work / "cache-one", hw, model, quant), work)]
        sizes = []
        if not args.skip_all:
            results.append(clean_and_noop("*", selection_env(work / "cache-all", "*"), work))
            for t in existing_targets(load_registry()):
                _, wheel = build(selection_env(work / "cache-all", t.hw, t.model, t.quant), work / f"one-{t.hw}-{t.model}-{t.quant}")
                sizes.append({"tuple": t.rel, "wheel": wheel.name, "wheel_bytes": wheel.stat().st_size})
                print(f"wheel {t.rel}: {wheel.stat().st_size} B", flush=True)
        compiled = work / "kernels"
        subprocess.run([sys.executable, "-m", "build_tools.compile", "--hw", "*", "--out", str(compiled)], cwd=REPO,
                       env={**os.environ, "ATLAS_KERNEL_CACHE": str(work / "cache-all")}, check=True, stdout=subprocess.DEVNULL)
        loads = module_load(compiled)
    now = dt.datetime.now(dt.timezone.utc)
    report = {"date": now.isoformat(timespec="seconds"), "commit": commit, "machine": machine(),
              "builds": results, "wheel_sizes": sizes, "module_load": loads or "no GPU: not measured"}
    out = REPO / "bench" / "results" / f"build-{now:%Y%m%d-%H%M}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
