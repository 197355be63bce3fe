"""The commit a benchmark result was measured at (every bench/results file records it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """The checkout's short commit; outside a git checkout ATLAS_COMMIT, else "unknown"."""
    try:
        done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("ATLAS_COMMIT", "unknown")
    return done.stdout.strip() or os.environ.get("ATLAS_COMMIT", "unknown")
