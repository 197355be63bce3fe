"""What the model-level GPU tests share: the demo's CUDA backend, or a skip with the reason (a
failure under ATLAS_REQUIRE_GPU=1, where a GPU or the emulator must be there)."""

from __future__ import annotations

import os

import pytest


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
