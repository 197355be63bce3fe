"""The compiled kernel images of this install (the optional extension atlas._kernels).

A wheel built with kernels holds one module per (hw, model, quant) tuple, as PTX and (except for
PTX-only hardware such as sm80) cubin, plus a manifest read from the PTX: every entry point and
its parameter types. A CPU-only wheel (+cpu) and the source tree hold none: tuples() is [].
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any

MODULE = "kernels"  # the one module of each tuple (build_tools.compile.MODULE)


@dataclass(frozen=True)
class KernelTuple:
    hw: str
    model: str
    quant: str
    arch: str  # sm_90a, or compute_80 for PTX only
    kernels: tuple[str, ...]  # .entry names
    ptx_bytes: int
    cubin_bytes: int  # 0 when the hardware is PTX only

    @property
    def rel(self) -> str:
        return f"{self.hw}/{self.model}/{self.quant}"


@cache
def _extension() -> ModuleType | None:
    try:
        from . import _kernels
    except ImportError:
        return None
    return _kernels


def available() -> bool:
    """True when the compiled extension is importable (it may still hold no tuple)."""
    return _extension() is not None


@cache
def manifest() -> dict[str, Any]:
    """version, nvcc, flags and tuples (hw, model, quant, arch, gencode, kernels, modules)."""
    ext = _extension()
    if ext is None:
        return {"version": None, "nvcc": "", "flags": [], "tuples": []}
    return json.loads(ext.manifest_json())


def tuples() -> list[KernelTuple]:
    found = []
    for t in manifest()["tuples"]:
        module = next(m for m in t["modules"] if m["name"] == MODULE)
        found.append(KernelTuple(t["hw"], t["model"], t["quant"], t["arch"], tuple(t["kernels"]),
                                 module["ptx_bytes"], module["cubin_bytes"]))
    return found


def entries(hw: str, model: str, quant: str) -> dict[str, list[dict[str, Any]]]:
    """Entry name -> its PTX parameters ({type, align, count}) for one tuple."""
    for t in manifest()["tuples"]:
        if (t["hw"], t["model"], t["quant"]) == (hw, model, quant):
            return {e["name"]: e["params"] for m in t["modules"] for e in m["entries"]}
    raise KeyError(f"{hw}/{model}/{quant}")


def _image(hw: str, model: str, quant: str, kind: str) -> bytes:
    ext = _extension()
    if ext is None:
        raise KeyError(f"{hw}/{model}/{quant}: this install holds no compiled kernels")
    return ext.image(hw, model, quant, MODULE, kind)


def ptx(hw: str, model: str, quant: str) -> bytes:
    """The tuple's PTX text (no trailing NUL); KeyError when the install lacks the tuple."""
    return _image(hw, model, quant, "ptx")


def cubin(hw: str, model: str, quant: str) -> bytes:
    """The tuple's cubin; b"" for PTX-only hardware; KeyError when the install lacks the tuple."""
    if any(t.rel == f"{hw}/{model}/{quant}" and t.cubin_bytes == 0 for t in tuples()):
        return b""
    return _image(hw, model, quant, "cubin")
