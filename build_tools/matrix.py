"""The CI matrix: one entry per existing (hw, model, quant) tuple; --build makes their wheels.

    python -m build_tools.matrix                       # JSON {"include": [{hw, model, quant}, ...]}
    python -m build_tools.matrix --build [--hw H --model M --quant Q] [--out wheels]

--build runs `pip wheel . --no-deps` once per selected tuple with ATLAS_TARGET_* set to it, so
each wheel holds exactly one tuple (the workflow runs this per matrix entry).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from atlas.errors import AtlasError
from atlas.targets import load_registry

from . import REPO, run_tool
from .selection import ENV_HW, ENV_MODEL, ENV_QUANT, Target, existing_targets, select


def matrix() -> dict[str, list[dict[str, str]]]:
    return {"include": [{"hw": t.hw, "model": t.model, "quant": t.quant}
                        for t in existing_targets(load_registry())]}


def print_matrix() -> int:
    print(json.dumps(matrix()))
    return 0


def build_wheel(target: Target, out: Path, extra: list[str]) -> None:
    env = {**os.environ, ENV_HW: target.hw, ENV_MODEL: target.model, ENV_QUANT: target.quant}
    cmd = [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-w", str(out), *extra]
    print(f"atlas: building {target.rel}: {' '.join(cmd)}", flush=True)
    if subprocess.run(cmd, env=env, check=False).returncode != 0:
        raise AtlasError(f"the wheel of {target.rel} failed to build (see the log above)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="build one wheel per selected tuple")
    parser.add_argument("--hw", default="*")
    parser.add_argument("--model", default="*")
    parser.add_argument("--quant", default="*")
    parser.add_argument("--out", type=Path, default=REPO / "wheels")
    parser.add_argument("--pip-arg", action="append", default=[], help="extra argument for pip wheel")
    args = parser.parse_args(argv)
    if not args.build:
        return run_tool(print_matrix)
    env = {ENV_HW: args.hw, ENV_MODEL: args.model, ENV_QUANT: args.quant}
    return run_tool(lambda: build_wheels(select(load_registry(), env).targets, args.out.resolve(), args.pip_arg))


def build_wheels(targets: tuple[Target, ...], out: Path, extra: list[str]) -> int:
    for target in targets:
        build_wheel(target, out, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
