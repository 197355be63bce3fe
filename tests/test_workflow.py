"""The wheels workflow: valid against the GitHub workflow schema (offline) and driven by the matrix."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WORKFLOW = REPO / ".github" / "workflows" / "wheels.yml"


def _validate(path: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("check-jsonschema")
    if exe is None:
        pytest.skip("check-jsonschema is not installed (pip install '.[test]')")
    return subprocess.run([exe, "--builtin-schema", "vendor.github-workflows", str(path)], capture_output=True, text=True)


def test_workflow_validates() -> None:
    proc = _validate(WORKFLOW)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_schema_check_catches_a_broken_workflow(tmp_path: Path) -> None:
    broken = tmp_path / "wheels.yml"
    broken.write_text(WORKFLOW.read_text().replace("runs-on:", "runs_on:", 1))
    assert _validate(broken).returncode != 0


def test_workflow_uses_the_matrix_command() -> None:
    text = WORKFLOW.read_text()
    assert "python -m build_tools.matrix)" in text
    assert "fromJSON(needs.matrix.outputs.matrix)" in text
    assert ('python -m build_tools.matrix --build --hw "${{ matrix.hw }}" --model "${{ matrix.model }}" '
            '--quant "${{ matrix.quant }}"') in text
    assert "actions/upload-artifact" in text and "bash .ci/run" in text


def test_matrix_lists_every_existing_tuple() -> None:
    out = subprocess.run([sys.executable, "-m", "build_tools.matrix"], cwd=REPO, capture_output=True, text=True, check=True)
    entries = json.loads(out.stdout)["include"]
    on_disk = {str(p.parent.relative_to(REPO / "kernels")) for p in (REPO / "kernels").glob("*/*/*/*.cu")
               if p.parts[-4] != "templates"}
    assert {f"{e['hw']}/{e['model']}/{e['quant']}" for e in entries} == on_disk
    assert len(entries) == len(on_disk) > 0
