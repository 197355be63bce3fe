"""atlas build tools: selection, code generation, nvcc driver, embedding, CI matrix.

Run from the repository root (`python -m build_tools.<tool>`); atlas.targets and
atlas.kernel_params are imported from <repo>/python.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))


def kernels_dir() -> Path:
    """kernels/ of the repo; ATLAS_KERNELS_DIR points the tools at another tree (tests do)."""
    return Path(os.environ.get("ATLAS_KERNELS_DIR") or REPO / "kernels").resolve()


def run_tool(body: Callable[[], int]) -> int:
    """A tool's main: an AtlasError (bad input, failed build) is one `error:` line and exit code 2."""
    from atlas.errors import AtlasError

    try:
        return body()
    except AtlasError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
