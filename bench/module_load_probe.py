"""Cold module load of the installed wheel's tuples (run by bench/device_check.sh on a GPU machine).

For each tuple: cuModuleLoadData of the cubin and of the PTX (driver JIT; run with
CUDA_CACHE_DISABLE=1 so the JIT cache does not hide the cost), then every manifest entry must
resolve with cuModuleGetFunction. One JSON line per (tuple, kind).
Without a GPU (no driver, no cuda-bindings) it prints one line "no GPU: ..." and exits 2, as
bench/quant.py does; an AtlasError (no installed kernels) is one line and exit 2 too.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cli  # noqa: E402

import atlas  # noqa: E402
import atlas.kernels as k  # noqa: E402

PROG = "bench/module_load_probe.py"


def checked(result: Any) -> Any:
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return values[0] if len(values) == 1 else values


def load(data: bytes) -> tuple[int, float, Any]:
    from cuda.bindings import driver as d

    start = time.perf_counter()
    err, module = d.cuModuleLoadData(data)
    return int(err), time.perf_counter() - start, module


def probe() -> None:
    from cuda.bindings import driver as d

    checked(d.cuInit(0))
    device = checked(d.cuDeviceGet(0))
    checked(d.cuCtxSetCurrent(checked(d.cuDevicePrimaryCtxRetain(device))))
    for t in k.tuples():
        images = {"cubin": k.cubin(t.hw, t.model, t.quant), "ptx": k.ptx(t.hw, t.model, t.quant) + b"\0"}
        for kind, data in images.items():
            if len(data) <= 1:
                continue
            err, seconds, module = load(data)
            row = {"version": atlas.__version__, "tuple": t.rel, "kind": kind, "bytes": len(data),
                   "err": err, "load_s": round(seconds, 4)}
            if err == 0:
                row["entries"] = len(t.kernels)
                row["missing"] = [e for e in t.kernels if int(d.cuModuleGetFunction(module, e.encode())[0]) != 0]
                checked(d.cuModuleUnload(module))
            print(json.dumps(row), flush=True)


def main() -> int:
    from atlas.errors import AtlasError

    missing = bench_cli.gpu_missing()
    if missing is not None:
        return bench_cli.no_gpu(missing)
    try:
        probe()
    except ImportError as err:  # atlas drove the GPU through another binding (ATLAS_CUDA_BINDING=pycuda)
        return bench_cli.fail(PROG, f"{err}; the probe needs cuda-bindings (pip install cuda-bindings)")
    except AtlasError as err:
        return bench_cli.fail(PROG, str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
