"""atlas build tools: selection, code generation, nvcc driver, embedding, CI matrix.

Run from the repository root (`python -m build_tools.<tool>`); atlas.targets and
atlas.kernel_params are imported from <repo>/python.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))
