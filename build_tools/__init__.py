"""atlas build tools: selection, code generation, nvcc driver, embedding, CI matrix.

Run from the repository root (`python -m build_tools.<tool>`); atlas.targets and
atlas.kernel_params are imported from <repo>/python.
"""

from __future__ import annotations

import sys
from pathlib import Path

import os

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))


def kernels_dir() -> Path:
    """kernels/ of the repo; ATLAS_KERNELS_DIR points the tools at another tree (tests do)."""
    return Path(os.environ.get("ATLAS_KERNELS_DIR") or REPO / "kernels").resolve()
