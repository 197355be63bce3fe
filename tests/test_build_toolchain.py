"""build_tools/toolchain.py: the kernel cache key follows the toolchain behind an nvcc wrapper.

A stand-in CUDA tree (bin/nvcc, nvcc.profile, ptxas, cudafe++, nvvm/bin/cicc, libdevice, headers
with crt/) sits behind a wrapper script reached through a symlink; each of its files is changed in
turn behind the unchanged wrapper. The real toolchain's resolution is checked against what
`nvcc -dryrun` says it runs.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

import build_tools.toolchain as toolchain_mod
from build_tools.toolchain import fingerprint, include_dirs, real_nvcc, resolve_toolchain

PROFILE = """
TOP              = $(_HERE_)/..

CICC_PATH        = $(TOP)/nvvm/bin
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice

PATH            += $(CICC_PATH):$(_HERE_):

INCLUDES        +=  "-I$(TOP)/$(_TARGET_DIR_)/include" $(_SPACE_)
SYSTEM_INCLUDES +=  "-isystem" "$(TOP)/$(_TARGET_DIR_)/include/cccl" $(_SPACE_)
"""
TOOL_FILES = ("bin/ptxas", "bin/cudafe++", "nvvm/bin/cicc", "nvvm/libdevice/libdevice.10.bc",
              "INC/crt/host_defines.h", "INC/cuda_bf16.h", "INC/cccl/cuda/std/version", "bin/nvcc.profile")


def _write(path: Path, data: bytes, executable: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if executable:
        path.chmod(0o755)


def _include(top: Path) -> Path:
    """A toolkit's targets/<arch>/include (nvcc's _TARGET_DIR_ where that folder exists)."""
    arch = platform.machine()
    return top / "targets" / toolchain_mod.TARGET_DIRS.get(arch, f"{arch}-linux") / "include"


def make_toolchain(top: Path) -> None:
    """A stand-in CUDA tree: every file a few random bytes (the real nvcc here is a script that
    names no other nvcc, so it is where resolution ends)."""
    _write(top / "bin" / "nvcc", b"#!/bin/sh\necho 'Cuda compilation tools, release 99.9'\n", executable=True)
    _write(top / "bin" / "nvcc.profile", PROFILE.encode())
    for rel in TOOL_FILES[:-1]:
        path = top / rel.replace("INC", str(_include(top).relative_to(top)))
        _write(path, os.urandom(64), executable="bin/" in rel)


def file_of(top: Path, rel: str) -> Path:
    return top / rel.replace("INC", str(_include(top).relative_to(top)))


@pytest.fixture
def wrapped(tmp_path: Path) -> tuple[Path, Path]:
    """(the nvcc path the build is given: a symlink to a logging wrapper script, the CUDA tree)."""
    top = tmp_path / "cuda"
    make_toolchain(top)
    wrapper = tmp_path / "shim" / "nvcc"
    _write(wrapper, f'#!/bin/sh\necho "$@" >> "{tmp_path}/nvcc.log"\nexec "{top}/bin/nvcc" "$@"\n'.encode(), True)
    link = tmp_path / "link" / "nvcc"
    link.parent.mkdir()
    link.symlink_to(wrapper)
    return link, top


def test_resolution_follows_links_and_wrappers_to_what_nvcc_runs(wrapped: tuple[Path, Path]) -> None:
    link, top = wrapped
    tc = resolve_toolchain(link, {"PATH": "/nonexistent"})
    assert tc.nvcc == (top / "bin" / "nvcc").resolve() == real_nvcc(link)
    assert {k: p.resolve() for k, p in tc.tools.items() if k != "host-compiler"} == {
        "nvcc": tc.nvcc, "nvcc.profile": (top / "bin/nvcc.profile").resolve(),
        "cicc": (top / "nvvm/bin/cicc").resolve(), "ptxas": (top / "bin/ptxas").resolve(),
        "cudafe++": (top / "bin/cudafe++").resolve()}
    assert [t.resolve() for t in tc.trees] == [_include(top).resolve(), (_include(top) / "cccl").resolve(),
                                               (top / "nvvm/libdevice").resolve()]
    labels = [label for label, _ in tc.files()]
    assert len(labels) == len(set(labels)) and sum("crt/host_defines.h" in label for label in labels) == 1


@pytest.mark.parametrize("rel", TOOL_FILES)
def test_a_change_behind_an_unchanged_wrapper_changes_the_key(
    wrapped: tuple[Path, Path], tmp_path: Path, rel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    link, top = wrapped
    memo = tmp_path / "memo"
    before = fingerprint(resolve_toolchain(link), memo)
    wrapper_bytes = link.resolve().read_bytes()

    def no_rehash(*args: object) -> str:
        raise AssertionError("an unchanged toolchain must be a memo hit")

    with monkeypatch.context() as patch:
        patch.setattr(toolchain_mod, "content_digest", no_rehash)
        assert fingerprint(resolve_toolchain(link), memo) == before
    target = file_of(top, rel)
    stat = target.stat()
    old = target.read_bytes()
    new = os.urandom(len(old)) if not rel.endswith("profile") else old + b"\nCUDAFE_FLAGS +=\n"
    target.write_bytes(new)
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same mtime: the content still counts
    assert link.resolve().read_bytes() == wrapper_bytes
    assert fingerprint(resolve_toolchain(link), memo) != before, f"{rel} changed but the key did not"
    target.write_bytes(old)
    assert fingerprint(resolve_toolchain(link), memo) == before


def test_key_is_path_independent_and_counts_nvcc_env(wrapped: tuple[Path, Path], tmp_path: Path) -> None:
    link, top = wrapped
    memo = tmp_path / "memo"
    before = fingerprint(resolve_toolchain(link), memo)
    moved = tmp_path / "elsewhere" / "cuda"
    shutil.copytree(top, moved, symlinks=True)
    assert fingerprint(resolve_toolchain(moved / "bin" / "nvcc"), memo) == before
    flagged = resolve_toolchain(link, {**os.environ, "NVCC_APPEND_FLAGS": "-DFAST=1"})
    assert fingerprint(flagged, memo) != before


def test_a_script_naming_no_nvcc_is_the_end_of_resolution(tmp_path: Path) -> None:
    lone = tmp_path / "nvcc"
    _write(lone, b"#!/bin/sh\nexec /opt/elsewhere/bin/nvcc-real \"$@\"  # /tmp/none/nvcc is not there\n", True)
    assert real_nvcc(lone) == lone.resolve()
    tc = resolve_toolchain(lone, {"PATH": ""})
    assert tc.tools["nvcc"] == lone.resolve() and "ptxas" not in tc.tools


def _dryrun_values(nvcc: Path, tmp_path: Path) -> dict[str, str]:
    source = tmp_path / "probe.cu"
    source.write_text("__global__ void probe() {}\n")
    proc = subprocess.run([str(nvcc), "-dryrun", "-cubin", "-arch=sm_80", str(source), "-o", str(tmp_path / "p.cubin")],
                          capture_output=True, text=True, check=False, cwd=tmp_path)
    lines = [l[3:] for l in (proc.stdout + proc.stderr).splitlines() if l.startswith("#$ ")]
    values = dict(l.split("=", 1) for l in lines if "=" in l.split(" ", 1)[0])
    values["ptxas-run"] = next(l.split()[0] for l in lines if l.split()[0].endswith("ptxas"))
    return values


def test_real_toolchain_matches_what_nvcc_dryrun_runs(tmp_path: Path) -> None:
    from build_tools.nvcc import find_nvcc

    try:
        nvcc = find_nvcc()
    except Exception as err:  # noqa: BLE001 - no nvcc means skip
        pytest.skip(f"no nvcc: {err}")
    said = _dryrun_values(nvcc.path, tmp_path)
    tc = resolve_toolchain(nvcc.path)
    assert tc.nvcc.parent == Path(said["_HERE_"]).resolve()
    assert tc.tools["cicc"].resolve() == (Path(said["CICC_PATH"]) / "cicc").resolve()
    assert tc.tools["ptxas"].resolve() == Path(shutil.which(said["ptxas-run"], path=said["PATH"]) or "").resolve()
    dirs = include_dirs({"INCLUDES": said["INCLUDES"], "SYSTEM_INCLUDES": said.get("SYSTEM_INCLUDES", "")})
    assert [d.resolve() for d in dirs] == [t.resolve() for t in tc.trees[: len(dirs)]]
    assert tc.trees[-1].resolve() == Path(said["NVVMIR_LIBRARY_DIR"]).resolve()


def test_headers_under_top_include_count_without_a_targets_dir(tmp_path: Path) -> None:
    """A pip-installed toolchain (nvidia/cu13/) may have no targets/<arch>/include: <TOP>/include
    is covered anyway."""
    top = tmp_path / "cu13"
    make_toolchain(top)
    shutil.rmtree(top / "targets")
    header = top / "include" / "crt" / "host_defines.h"
    _write(header, os.urandom(64))
    memo = tmp_path / "memo"
    before = fingerprint(resolve_toolchain(top / "bin" / "nvcc"), memo)
    _write(header, os.urandom(64))
    assert fingerprint(resolve_toolchain(top / "bin" / "nvcc"), memo) != before
