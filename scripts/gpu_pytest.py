"""pytest over GPU tests that survives a sticky CUDA error: a kernel fault loses the CUDA context
for the rest of its process, so tests/conftest.py stops that session after the failing test and
notes which tests ran (ATLAS_STICKY_FILE); this runs the rest in a new process, up to --restarts
times, and merges the runs' junit files into one. One faulting kernel then costs one failed test,
not every GPU test after it.

    python scripts/gpu_pytest.py --junitxml OUT.xml [--restarts N] -- PYTEST_ARGS...

Exit status: pytest's for the whole (1 when any run failed a test, 2 when interrupted).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

NO_TESTS = 5  # pytest's exit code when a resumed run finds nothing left


def run_pytest(cmd: list[str], env: dict[str, str]) -> tuple[int, bool]:
    """(exit code, interrupted). A SIGINT (the device check's stage timeout signals the whole
    process group) lets pytest finish writing its junit file before this returns."""
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait(), False
    except KeyboardInterrupt:
        try:
            return proc.wait(timeout=8), True
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(), True


def merge_junit(parts: list[Path], out: Path) -> None:
    """Every testsuite of the readable parts under one <testsuites> root."""
    root = ET.Element("testsuites")
    for part in parts:
        try:
            tree = ET.parse(part).getroot()
        except (ET.ParseError, OSError) as err:
            print(f"gpu_pytest: {part.name} left out ({err})", file=sys.stderr)
            continue
        root.extend([tree] if tree.tag == "testsuite" else list(tree))
    ET.ElementTree(root).write(out, encoding="utf-8", xml_declaration=True)


def run_all(pytest_args: list[str], junit: Path, restarts: int, work: Path) -> int:
    ran: list[str] = []
    parts: list[Path] = []
    codes: list[int] = []
    for attempt in range(restarts + 1):
        part, sticky = work / f"part{attempt}.xml", work / f"sticky{attempt}.json"
        deselect = [arg for node in ran for arg in ("--deselect", node)]
        cmd = [sys.executable, "-m", "pytest", *pytest_args, f"--junitxml={part}", *deselect]
        code, interrupted = run_pytest(cmd, {**os.environ, "ATLAS_STICKY_FILE": str(sticky)})
        parts.append(part)
        codes.append(0 if attempt and code == NO_TESTS else code)
        if interrupted:
            codes.append(2)
            break
        if not sticky.exists():
            break
        note = json.loads(sticky.read_text())
        ran += note["ran"]
        if not note["left"]:
            break
        fate = "resume in a new process" if attempt < restarts else f"did not run ({restarts} restarts spent)"
        print(f"gpu_pytest: sticky CUDA error in {note['failed']}; the {note['left']} tests after it {fate}",
              file=sys.stderr, flush=True)
    merge_junit(parts, junit)
    return 2 if 2 in codes else max(codes)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--junitxml", type=Path, required=True, help="the merged junit file")
    parser.add_argument("--restarts", type=int, default=5, help="new processes after sticky errors (default 5)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="-- then pytest's arguments")
    args = parser.parse_args(argv)
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    with tempfile.TemporaryDirectory(prefix="gpu-pytest-") as work:
        return run_all(pytest_args, args.junitxml, max(args.restarts, 0), Path(work))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
