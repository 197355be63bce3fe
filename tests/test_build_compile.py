"""build_tools.compile against a scratch kernels tree: cache, diagnostics, spills, resource table.

nvcc is whatever build_tools.nvcc finds (ATLAS_NVCC, CUDACXX, the PyPI package, PATH), wrapped
in a script that logs each call so the tests can count compiler runs.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from build_tools.nvcc import find_nvcc

REPO = Path(__file__).resolve().parent.parent

KERNEL = """#include "atlas_tuple.cuh"
#include "atlas/scale.cuh"
extern "C" __global__ void atlas_scale_{tag}(float* x, int n) {{
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = atlas::scale(x[i]) * atlas::model::hidden_size;
}}
"""
HEADER = "#pragma once\nnamespace atlas {{ __device__ inline float scale(float v) {{ return v * {factor}f; }} }}\n"
SPILL = """extern "C" __global__ void __launch_bounds__(1024, 2) atlas_spill(float* out, const float* in, int n) {
  float acc[96];
#pragma unroll
  for (int i = 0; i < 96; ++i) acc[i] = in[threadIdx.x * 96 + i];
  for (int k = 0; k < n; ++k) {
#pragma unroll
    for (int i = 0; i < 96; ++i) acc[i] = acc[i] * acc[(i + 1) % 96] + in[k + i];
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 96; ++i) s += acc[i] * (i + 1);
  out[threadIdx.x] = s;
}
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    try:
        nvcc = find_nvcc()
    except Exception as err:  # noqa: BLE001 - any failure to find nvcc means skip
        pytest.skip(f"no nvcc: {err}")
    kernels = tmp_path / "kernels"
    (kernels / "include" / "atlas").mkdir(parents=True)
    (kernels / "include" / "atlas" / "scale.cuh").write_text(HEADER.format(factor=random.uniform(1, 2)))
    for rel in ("sm80/atlas-demo/bf16", "h200/atlas-demo/bf16"):
        (kernels / rel).mkdir(parents=True)
        for tag in ("a", "b"):
            (kernels / rel / f"{tag}.cu").write_text(KERNEL.format(tag=tag))
    log = tmp_path / "nvcc.log"
    wrapper = tmp_path / "nvcc"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexec "{nvcc.path}" "$@"\n')
    wrapper.chmod(0o755)
    return {**os.environ, "ATLAS_KERNELS_DIR": str(kernels), "ATLAS_NVCC": str(wrapper),
            "ATLAS_KERNEL_CACHE": str(tmp_path / "cache"), "NVCC_LOG": str(log), "OUT": str(tmp_path / "out")}


def _compile(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "build_tools.compile", "--out", env["OUT"], *args],
                          cwd=REPO, env=env, capture_output=True, text=True)


def _nvcc_calls(env: dict[str, str]) -> list[str]:
    log = Path(env["NVCC_LOG"])
    return log.read_text().splitlines() if log.exists() else []


def test_compile_cache_and_resource_table(env: dict[str, str]) -> None:
    first = _compile(env, "--hw", "*")
    assert first.returncode == 0, first.stderr
    calls = _nvcc_calls(env)
    assert any("-ptx" in c and "compute_90a" in c for c in calls) and any("-cubin" in c and "sm_90a" in c for c in calls)
    assert any("-cubin" in c and "-arch=sm_80" in c and "-v,-warn-spills" in c for c in calls)
    out = Path(env["OUT"])
    record = json.loads((out / "build.json").read_text())
    by_hw = {t["hw"]: t for t in record["tuples"]}
    names = {e["name"] for m in by_hw["h200"]["modules"] for e in m["entries"]}
    assert names == {"atlas_scale_a", "atlas_scale_b"}
    assert by_hw["h200"]["modules"][0]["cubin_bytes"] > 0 and by_hw["sm80"]["modules"][0]["cubin_bytes"] == 0
    assert (out / "h200/atlas-demo/bf16/kernels.cubin").read_bytes()[:4] == b"\x7fELF"
    table = (out / "resources.txt").read_text()
    assert "atlas_scale_b" in table and "regs" in table and table in first.stdout
    progress = [line for line in first.stdout.splitlines() if line.startswith("atlas: [")]
    assert [line.split()[1] for line in progress] == ["[1/2]", "[2/2]"] and all(" compiled (" in p for p in progress)
    assert json.loads((out / "resources.json").read_text())[0]["modules"][0]["resources"][0]["registers"] > 0

    Path(env["NVCC_LOG"]).unlink()
    again = _compile(env, "--hw", "*")
    assert again.returncode == 0 and _nvcc_calls(env) == [], "an unchanged tree must run no nvcc"
    assert "2 from cache" in again.stdout
    assert sum(line.startswith("atlas: [") and " from cache (" in line for line in again.stdout.splitlines()) == 2

    header = Path(env["ATLAS_KERNELS_DIR"]) / "include" / "atlas" / "scale.cuh"
    header.write_text(HEADER.format(factor=3.5))
    third = _compile(env, "--hw", "h200")
    assert third.returncode == 0 and any("-ptx" in c for c in _nvcc_calls(env)), "a header change must recompile"


def _private_toolchain(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the real nvcc binary whose nvcc.profile puts a ptxas shim first on its PATH
    (cicc, headers and the real ptxas stay where they are): (that nvcc, the shim)."""
    from build_tools.toolchain import resolve_toolchain

    real = resolve_toolchain(find_nvcc().path)
    if real.tools["nvcc"].read_bytes()[:4] != b"\x7fELF" or "ptxas" not in real.tools:
        pytest.skip(f"the nvcc behind {find_nvcc().path} is not a CUDA binary with a ptxas beside it")
    bindir = tmp_path / "private-cuda" / "bin"
    bindir.mkdir(parents=True)
    shutil.copy2(real.nvcc, bindir / "nvcc")
    top = real.nvcc.parent.parent
    profile = (real.nvcc.parent / "nvcc.profile").read_text()
    profile = re.sub(r"(?m)^TOP\s*=.*$", f"TOP = {top}", profile)
    profile = re.sub(r"(?m)^PATH\s*\+=\s*", f"PATH += $(_HERE_):{real.nvcc.parent}:", profile)
    (bindir / "nvcc.profile").write_text(profile)
    shim = bindir / "ptxas"
    shim.write_text(f'#!/bin/sh\n# stand-in 1\nexec "{real.tools["ptxas"]}" "$@"\n')
    shim.chmod(0o755)
    return bindir / "nvcc", shim


def test_a_new_ptxas_behind_the_same_wrapper_recompiles(env: dict[str, str], tmp_path: Path) -> None:
    nvcc, ptxas = _private_toolchain(tmp_path)
    wrapper = Path(env["ATLAS_NVCC"])
    wrapper.write_text(wrapper.read_text().replace(str(find_nvcc().path), str(nvcc)))
    assert _compile(env, "--hw", "h200").returncode == 0
    Path(env["NVCC_LOG"]).unlink()
    hit = _compile(env, "--hw", "h200")
    assert hit.returncode == 0 and "1 from cache" in hit.stdout and _nvcc_calls(env) == []
    wrapper_bytes = wrapper.read_bytes()
    ptxas.write_text(ptxas.read_text().replace("stand-in 1", "stand-in 2"))
    miss = _compile(env, "--hw", "h200")
    assert wrapper.read_bytes() == wrapper_bytes
    assert miss.returncode == 0 and "1 tuples compiled, 0 from cache" in miss.stdout, miss.stdout
    assert any("-cubin" in c for c in _nvcc_calls(env)), "a changed ptxas must recompile"


def test_compiler_error_shows_file_and_line(env: dict[str, str]) -> None:
    bad = Path(env["ATLAS_KERNELS_DIR"]) / "h200/atlas-demo/bf16/b.cu"
    line = random.randint(3, 9)
    bad.write_text("\n" * (line - 1) + "extern \"C\" __global__ void atlas_bad(int* x) { x[0] = atlas::model::nope; }\n")
    proc = _compile(env, "--hw", "h200")
    assert proc.returncode == 1
    assert f"{bad}:{line}: error" in proc.stderr or f"{bad.name}:{line}: error" in proc.stderr, proc.stderr
    assert "failed to compile: h200/atlas-demo/bf16" in proc.stderr


def test_register_spill_fails(env: dict[str, str]) -> None:
    (Path(env["ATLAS_KERNELS_DIR"]) / "sm80/atlas-demo/bf16/spill.cu").write_text(SPILL)
    proc = _compile(env, "--hw", "sm80")
    assert proc.returncode == 1
    assert "register spill in atlas_spill" in proc.stderr


def test_unknown_hw_fails_before_compiling(env: dict[str, str]) -> None:
    proc = _compile(env, "--hw", "h300")
    assert proc.returncode == 2 and "valid: gb10, h100, h200, sm80" in proc.stderr
    assert "Traceback" not in proc.stderr and _nvcc_calls(env) == []


def test_nvcc_discovery_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import build_tools.nvcc as nvcc_mod
    from atlas.errors import AtlasError

    fakes = {}
    for name in ("atlas", "cudacxx", "onpath"):
        (tmp_path / name).mkdir()
        fakes[name] = tmp_path / name / "nvcc"
        fakes[name].write_text("#!/bin/sh\n")
        fakes[name].chmod(0o755)
    monkeypatch.setattr(nvcc_mod, "pypi_nvcc", lambda: None)
    path = str(fakes["onpath"].parent)
    assert nvcc_mod.find_nvcc({"ATLAS_NVCC": str(fakes["atlas"]), "CUDACXX": str(fakes["cudacxx"]), "PATH": path}).source == "ATLAS_NVCC"
    assert nvcc_mod.find_nvcc({"CUDACXX": str(fakes["cudacxx"]), "PATH": path}).path == fakes["cudacxx"]
    assert nvcc_mod.find_nvcc({"PATH": path}).path == fakes["onpath"]
    with pytest.raises(AtlasError, match="ATLAS_NVCC="):
        nvcc_mod.find_nvcc({"ATLAS_NVCC": str(tmp_path / "missing" / "nvcc"), "PATH": path})
    with pytest.raises(AtlasError, match="nvcc not found"):
        nvcc_mod.find_nvcc({"PATH": str(tmp_path / "atlas-none")})
