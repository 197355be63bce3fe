"""The build step CMake runs at configure time: select, compile, generate the extension sources.

    python -m build_tools.stage --out <cmake binary dir>/atlas_stage --version <full version>

Prints what it selected (and says plainly when the wheel is CPU-only), then writes
<out>/embed/sources.cmake for CMake to include.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from atlas.errors import AtlasError
from atlas.targets import load_registry

from . import run_tool
from .compile import COMMON_FLAGS, PTXAS_FLAGS, compile_selection
from .embed import generate
from .selection import select, version_for


def stage(out: Path, version: str) -> int:
    registry = load_registry()
    selection = select(registry, os.environ)
    for note in selection.notes:
        print(f"atlas: {note}", flush=True)
    expected = version_for(selection.targets)
    if version != expected:
        raise AtlasError(f"version {version} does not match the selection ({expected}); "
                         "the ATLAS_TARGET_* variables changed during the build, rebuild")
    if selection.cpu_only:
        print("atlas: CPU-only build: the wheel holds no GPU kernels (version label +cpu)", flush=True)
        record = {"nvcc": "", "flags": [*COMMON_FLAGS, *PTXAS_FLAGS], "tuples": []}
    else:
        print("atlas: building tuples " + ", ".join(t.rel for t in selection.targets), flush=True)
        record = compile_selection(registry, selection, out / "kernels")
    generate(record, version, out / "embed")
    (out / "selection.json").write_text(json.dumps({"version": version, "tuples": [t.rel for t in selection.targets]}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--version", required=True)
    args = parser.parse_args()
    return run_tool(lambda: stage(args.out.resolve(), args.version))


if __name__ == "__main__":
    sys.exit(main())
