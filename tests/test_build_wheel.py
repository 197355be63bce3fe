"""Real wheel builds: an isolated pip build with only pip's CUDA, no-op rebuilds, reproducibility,
CPU-only wheels and fast failure on unknown targets.

The isolated build installs [build-system] requires from the index; the others reuse this
environment (--no-build-isolation) so CI installs the build requirements once (.ci/run does).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from build_tools.nvcc import find_nvcc

REPO = Path(__file__).resolve().parent.parent
TUPLE = {"ATLAS_TARGET_HW": "gb10", "ATLAS_TARGET_MODEL": "atlas-demo", "ATLAS_TARGET_QUANT": "bf16"}


def _base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATLAS_") and k not in ("CUDACXX", "PYTHONPATH")}
    return {**env, **extra}


def _pip_wheel(env: dict[str, str], out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-v", "-w", str(out), *args]
    return subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True)


def _logging_nvcc(tmp_path: Path) -> tuple[Path, Path]:
    try:
        nvcc = find_nvcc()
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"no nvcc: {err}")
    log, wrapper = tmp_path / "nvcc.log", tmp_path / "nvcc-logging"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexec "{nvcc.path}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, log


def _need_build_env() -> None:
    for module in ("scikit_build_core", "nanobind", "jinja2"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed; .ci/run installs the build requirements")


def _path_without(program: str) -> str:
    return os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if d and not (Path(d) / program).exists())


@pytest.mark.slow
def test_isolated_wheel_with_only_pip_cuda_installs_and_lists_its_tuple(tmp_path: Path) -> None:
    path = _path_without("nvcc")
    env = _base_env(**TUPLE, PATH=path, ATLAS_KERNEL_CACHE=str(tmp_path / "cache"))
    assert shutil.which("nvcc", path=path) is None
    proc = _pip_wheel(env, tmp_path / "wheels")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "(PyPI nvidia-cuda-nvcc)" in proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "wheels").glob("atlas-*.whl")
    assert wheel.name.startswith("atlas-0.1.0+gb10.atlas.demo.bf16-")
    names = zipfile.ZipFile(wheel).namelist()
    assert "atlas/targets.toml" in names and "atlas/targets.py" in names and "atlas/_version.py" in names
    assert all(f"atlas/demo/{p.name}" in names for p in (REPO / "python/atlas/demo").glob("*.json"))
    (so,) = [n for n in names if n.startswith("atlas/_kernels") and n.endswith(".so")]
    _check_links_no_cuda(zipfile.ZipFile(wheel).read(so), tmp_path)
    _check_manylinux(wheel)

    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    py = tmp_path / "venv" / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True, env=_base_env())
    info = subprocess.run([str(py), "-m", "atlas.info", "--json"], cwd=tmp_path, env=_base_env(),
                          capture_output=True, text=True, check=True)
    data = json.loads(info.stdout)
    assert data["version"] == "0.1.0+gb10.atlas.demo.bf16"
    assert [(t["hw"], t["model"], t["quant"], t["arch"]) for t in data["tuples"]] == [("gb10", "atlas-demo", "bf16", "sm_121a")]
    assert data["tuples"][0]["kernels"] and all(k.startswith("atlas_") for k in data["tuples"][0]["kernels"])
    assert "13.0" in data["nvcc"]
    text = subprocess.run([str(py), "-m", "atlas.info"], cwd=tmp_path, env=_base_env(), capture_output=True, text=True, check=True)
    script = subprocess.run([str(tmp_path / "venv" / "bin" / "atlas"), "info", "--json"], cwd=tmp_path, env=_base_env(),
                            capture_output=True, text=True, check=True)  # the console script the wheel declares
    assert {k: json.loads(script.stdout)[k] for k in ("version", "tuples")} == {k: data[k] for k in ("version", "tuples")}
    assert "gb10/atlas-demo/bf16" in text.stdout and data["tuples"][0]["kernels"][0] in text.stdout


def _check_links_no_cuda(data: bytes, tmp_path: Path) -> None:
    so = tmp_path / "ext.so"
    so.write_bytes(data)
    dynamic = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
    needed = [line for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert needed and not any("cuda" in line or "nvrtc" in line for line in needed), needed


def _check_manylinux(wheel: Path) -> None:
    exe = shutil.which("auditwheel")
    if exe is None:
        pytest.skip("auditwheel is not installed (pip install '.[test]')")
    show = subprocess.run([exe, "show", str(wheel)], capture_output=True, text=True, check=True).stdout
    assert "manylinux" in show, show


@pytest.mark.slow
def test_rebuild_runs_no_nvcc_and_is_byte_identical(tmp_path: Path) -> None:
    _need_build_env()
    wrapper, log = _logging_nvcc(tmp_path)
    env = _base_env(ATLAS_TARGET_HW="sm80", ATLAS_TARGET_MODEL="atlas-demo", ATLAS_TARGET_QUANT="bf16",
                    ATLAS_NVCC=str(wrapper), ATLAS_KERNEL_CACHE=str(tmp_path / "cache"), SOURCE_DATE_EPOCH="1767225600")
    first = _pip_wheel(env, tmp_path / "one", "--no-build-isolation")
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    assert any("-ptx" in line for line in log.read_text().splitlines())
    log.unlink()
    second = _pip_wheel(env, tmp_path / "two", "--no-build-isolation")
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    assert not log.exists(), f"the no-op rebuild ran nvcc: {log.read_text()}"
    (a,), (b,) = (tmp_path / "one").glob("*.whl"), (tmp_path / "two").glob("*.whl")
    assert a.name == b.name and a.name.startswith("atlas-0.1.0+sm80.atlas.demo.bf16-")
    assert a.read_bytes() == b.read_bytes(), "two builds of the same tree differ"


@pytest.mark.slow
def test_no_gpu_and_no_target_builds_a_cpu_wheel(tmp_path: Path) -> None:
    _need_build_env()
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    (fake / "nvidia-smi").chmod(0o755)
    wrapper, log = _logging_nvcc(tmp_path)
    env = _base_env(PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", ATLAS_NVCC=str(wrapper))
    proc = _pip_wheel(env, tmp_path / "wheels", "--no-build-isolation")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    log_text = proc.stdout + proc.stderr
    assert "no GPU is visible" in log_text and "CPU-only" in log_text
    (wheel,) = (tmp_path / "wheels").glob("*.whl")
    assert wheel.name.startswith("atlas-0.1.0+cpu-")
    assert 'version = "0.1.0+cpu"' in zipfile.ZipFile(wheel).read("atlas/_version.py").decode()
    assert not log.exists()


def test_unknown_target_fails_fast_naming_valid_values(tmp_path: Path) -> None:
    _need_build_env()
    wrapper, log = _logging_nvcc(tmp_path)
    env = _base_env(ATLAS_TARGET_HW="h300", ATLAS_NVCC=str(wrapper))
    start = time.monotonic()
    proc = _pip_wheel(env, tmp_path / "wheels", "--no-build-isolation")
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    output = proc.stdout + proc.stderr
    assert "ATLAS_TARGET_HW='h300': unknown name 'h300'; valid: gb10, h100, h200, sm80 or '*'" in output
    assert not log.exists() and not list((tmp_path / "wheels").glob("*.whl"))
