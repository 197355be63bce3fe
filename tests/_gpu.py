"""What the model-level GPU tests share: the demo's CUDA backend, or a skip with the reason (a
failure under ATLAS_REQUIRE_GPU=1, where a GPU or the emulator must be there), and the verdict of
a cross-check."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from atlas.cross_check import NameReport


def require_demo_cuda() -> None:
    """Skip the test unless the CUDA backend opens for the demo model."""
    from atlas.backends import create_backend
    from atlas.config import load_spec
    from atlas.demo import DEMO_DIR
    from atlas.errors import AtlasError

    try:
        create_backend("cuda", DEMO_DIR, load_spec(DEMO_DIR))
    except (AtlasError, ImportError) as err:
        if os.environ.get("ATLAS_REQUIRE_GPU") == "1":
            raise
        pytest.skip(f"no CUDA backend here: {err}")


def assert_no_op_off(reports: list[NameReport], label: str = "") -> None:
    """A cross-check (atlas.cross_check.check_backend) with nothing flagged; its table is printed
    (the device run's junit keeps it) and, on failure, in the message."""
    from atlas.cross_check import DEFAULT_TOLERANCE, first_flagged, format_reports

    table = "\n".join(format_reports(reports))
    print(table)
    flagged = first_flagged(reports)
    assert flagged is None, f"{label}first flagged {flagged.name}: {flagged.reason(DEFAULT_TOLERANCE)}\n{table}"
