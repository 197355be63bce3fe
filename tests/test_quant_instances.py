"""build_tools.instances: the per-template hardware filter and `templates` (including another
quant's kernels), which the fp8 / nvfp4 tuples use to render for h200 and gb10 only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(kernels: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "build_tools.instances", "--kernels", str(kernels), *args],
                          cwd=REPO, capture_output=True, text=True)


def test_hardware_line_limits_the_instances_and_includes_render(tmp_path: Path) -> None:
    (tmp_path / "templates" / "bf16").mkdir(parents=True)
    (tmp_path / "templates" / "nvfp4").mkdir(parents=True)
    (tmp_path / "templates" / "bf16" / "a.cu.j2").write_text("int a_{{ hw.name }} = {{ model.hidden_size }};\n")
    (tmp_path / "templates" / "nvfp4" / "q.cu.j2").write_text(
        "{#- atlas-hardware: gb10 -#}\n{% for t in templates['bf16'] %}{% include t %}{% endfor %}int q;\n")
    assert _run(tmp_path).returncode == 0
    rendered = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("*/*/nvfp4/*.cu"))
    assert rendered == ["gb10/atlas-demo/nvfp4/q.cu", "gb10/qwen3.6-35b-a3b/nvfp4/q.cu"]
    assert len(list(tmp_path.glob("*/*/bf16/a.cu"))) == 6  # no line: every hardware
    text = (tmp_path / "gb10" / "atlas-demo" / "nvfp4" / "q.cu").read_text()
    assert "int a_gb10 = 128;" in text and "int q;" in text and "atlas-hardware" not in text
    assert _run(tmp_path, "--check").returncode == 0


def test_unknown_hardware_is_named(tmp_path: Path) -> None:
    (tmp_path / "templates" / "fp8").mkdir(parents=True)
    (tmp_path / "templates" / "fp8" / "q.cu.j2").write_text("{#- atlas-hardware: h200, h300 -#}\nint q;\n")
    proc = _run(tmp_path)
    assert proc.returncode != 0 and "h300" in proc.stderr and not list(tmp_path.glob("*/*/fp8/*.cu"))
