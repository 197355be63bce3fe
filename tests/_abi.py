"""Shared pieces of the kernels' CPU-side ABI tests: a runtime that records launches instead of
running them, the kernel entries of PTX compiled here with nvcc, and header constants."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pytest

from atlas.backends.cuda.runtime import CudaRuntime, DeferredLaunch
from atlas.backends.cuda.tensor import DeviceTensor

REPO = Path(__file__).resolve().parent.parent
MODELS = ("atlas-demo", "qwen3.6-35b-a3b")
_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(\s*\.param\s+\.align\s+(\d+)\s+\.b8\s+\w+\[(\d+)\]\s*\)\s*\.maxntid\s+(\d+)")


class PtxEntry(NamedTuple):
    align: int
    param_bytes: int
    max_threads: int


@dataclass
class Launch:
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    params: ctypes.Structure
    smem: int


@dataclass
class RecordingRuntime:
    """The slice of CudaRuntime the op wrappers use; memory is fake addresses, 256-aligned."""

    sm_count: int = 132
    programmatic: bool = False  # ATLAS_LAUNCH=pdl
    prefetch: bool = False  # ATLAS_PREFETCH=l2
    launches: list[Launch] = field(default_factory=list)
    zeroed: list[int] = field(default_factory=list)
    _next: int = 1 << 20

    def empty(self, shape: tuple[int, ...], dtype: str) -> DeviceTensor:
        tensor = DeviceTensor(self._next, tuple(int(d) for d in shape), dtype)  # type: ignore[arg-type]
        self._next += -(-max(tensor.nbytes, 1) // 256) * 256
        return tensor

    def memset_zero(self, t: DeviceTensor) -> None:
        self.zeroed.append(t.ptr)

    _deferred: DeferredLaunch | None = None

    def launch(self, kernel: str, grid: tuple[int, int, int], block: tuple[int, int, int],
               params: ctypes.Structure, smem: int = 0) -> None:
        self.issue_deferred()
        self.launches.append(Launch(kernel, grid, block, params, smem))

    # the runtime's deferred launch (norm_fusion.py), as CudaRuntime keeps it
    defer = CudaRuntime.defer
    deferred_writing = CudaRuntime.deferred_writing
    take_deferred = CudaRuntime.take_deferred
    issue_deferred = CudaRuntime.issue_deferred


@dataclass(frozen=True)
class PtxBuild:
    """Kernel sources (repo-relative .cu files) compiled to PTX for one (hw, model, quant) header set."""

    hw: str
    model: str
    quant: str
    arch: str  # nvcc's virtual arch, e.g. compute_80
    sources: tuple[str, ...]


def compile_ptx_entries(build: PtxBuild, tmp: Path) -> dict[str, PtxEntry]:
    """Kernel name -> its entry in the PTX nvcc makes here (skips the test without nvcc)."""
    return {m[1]: PtxEntry(int(m[2]), int(m[3]), int(m[4])) for m in _ENTRY.finditer(compile_ptx(build, tmp))}


def compile_ptx(build: PtxBuild, tmp: Path) -> str:
    """The PTX text nvcc makes here of the build's sources (skips the test without nvcc)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip(f"no nvcc here: cannot compile the {build.model} {build.quant} kernels' PTX")
    include = tmp / "include"
    subprocess.run(["python", "-m", "build_tools.headers", "--hw", build.hw, "--model", build.model,
                    "--quant", build.quant, "--out", str(include)], cwd=REPO, check=True, capture_output=True)
    source = tmp / "kernels.cu"
    source.write_text("".join(f'#include "{path}"\n' for path in build.sources))
    out = tmp / "kernels.ptx"
    subprocess.run([nvcc, "-std=c++17", "-O3", f"-I{include}", "-Ikernels/include", "-I.", f"-arch={build.arch}",
                    "-ptx", "-o", str(out), str(source)], cwd=REPO, check=True, capture_output=True)
    return out.read_text()


def model_dims(model: str) -> dict[str, int]:
    from atlas.targets import load_registry

    return dict(load_registry().models[model].constants)


def header_constant(header: str, name: str) -> int:
    text = (REPO / "kernels/include/atlas" / header).read_text()
    match = re.search(rf"constexpr int {name} = (\d+);", text)
    assert match, f"{name} not found in {header}"
    return int(match[1])
