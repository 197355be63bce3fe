"""Find nvcc: ATLAS_NVCC, then CUDACXX, then the PyPI nvidia-cuda-nvcc package, then PATH."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from atlas.errors import AtlasError

from .toolchain import fingerprint, resolve_toolchain


@dataclass(frozen=True)
class Nvcc:
    path: Path
    source: str  # which rule found it, for the build log

    def identity(self, cache_dir: Path) -> str:
        """Content fingerprint of the toolchain behind this path (build_tools/toolchain.py): the
        real nvcc, cicc, ptxas, cudafe++, libdevice, the CUDA headers, the host compiler."""
        return fingerprint(resolve_toolchain(self.path), cache_dir)

    def version(self, cache_dir: Path, identity: str) -> str:
        """`nvcc --version`'s release line, remembered per toolchain identity (no rerun when cached)."""
        memo = cache_dir / f"nvcc-version-{identity[:16]}.txt"
        if memo.is_file():
            return memo.read_text(encoding="utf-8").strip()
        out = subprocess.run([str(self.path), "--version"], capture_output=True, text=True, check=False).stdout
        release = next((l.strip() for l in out.splitlines() if "release" in l), out.strip() or "unknown")
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(release + "\n", encoding="utf-8")
        return release


def pypi_nvcc() -> Path | None:
    """bin/nvcc of the nvidia-cuda-nvcc wheel (nvidia/cu13/bin/nvcc), if installed."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        versions = [p for p in Path(root).glob("cu[0-9]*/bin/nvcc") if p.parts[-3][2:].isdigit()]
        for candidate in sorted(versions, key=lambda p: int(p.parts[-3][2:]), reverse=True):
            if os.access(candidate, os.X_OK):
                return candidate
    return None


def find_nvcc(env: Mapping[str, str] = os.environ) -> Nvcc:
    for var in ("ATLAS_NVCC", "CUDACXX"):
        value = env.get(var)
        if value:
            path = Path(value) if os.sep in value else Path(shutil.which(value) or value)
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise AtlasError(f"{var}={value!r} is not an executable nvcc; fix the path or unset {var}")
            return Nvcc(path, var)
    found = pypi_nvcc()
    if found is not None:
        return Nvcc(found, "PyPI nvidia-cuda-nvcc")
    on_path = shutil.which("nvcc", path=env.get("PATH"))
    if on_path:
        return Nvcc(Path(on_path), "PATH")
    raise AtlasError("nvcc not found; `pip install nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 "
                     "nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85` "
                     "or set ATLAS_NVCC to an nvcc")
