"""Shared pytest setup.

Tests import atlas from the source tree (python/) so the CPU runtime is tested without a build;
set ATLAS_TEST_INSTALLED=1 to test the installed wheel instead (the device check does, since only
an installed wheel holds atlas._kernels).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

if os.environ.get("ATLAS_TEST_INSTALLED") != "1":
    sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO))

from _sticky import pytest_runtest_makereport  # noqa: E402,F401  (a hook: found here by its name)
from _background import (  # noqa: E402,F401  (hooks: found here by their names)
    pytest_collection_finish, pytest_collection_modifyitems, pytest_sessionfinish, pytest_terminal_summary)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU and an installed wheel with kernels")
    config.addinivalue_line("markers", "slow: builds wheels or trains; minutes, not seconds")
    config.addinivalue_line("markers", "oracle: compares against Hugging Face transformers")
    config.addinivalue_line("markers", "background(lane): runs in a child process beside the session "
                                       "(tests/_background.py)")
    seed = os.environ.get("ATLAS_TEST_SEED", "")
    if seed and not (seed.isdigit() and int(seed) < 2**32):
        raise pytest.UsageError(f"ATLAS_TEST_SEED={seed!r} is not a seed; set it to the number a failing "
                                "test printed as 'rng seed' or unset it")
    hw = os.environ.get("ATLAS_SIMT", "")
    if hw:
        from _simt import HOST_CC

        if hw not in HOST_CC:
            raise pytest.UsageError(f"ATLAS_SIMT={hw!r} is not a hardware the host emulator builds; "
                                    f"set it to one of {', '.join(sorted(HOST_CC))} or unset it")


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> "np.random.Generator":
    """A fresh generator per test, seeded from the OS so every run draws new inputs.

    The seed is printed on failure (pytest shows captured stdout); ATLAS_TEST_SEED=<seed> draws it
    again to reproduce a failing draw."""
    import numpy as np

    given = os.environ.get("ATLAS_TEST_SEED", "")
    seed = int(given) if given else int.from_bytes(os.urandom(4), "little")
    print(f"rng seed: {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session", autouse=True)
def _host_simt() -> Iterator[None]:
    """ATLAS_SIMT=h200, gb10 or sm80: every CUDA backend the session opens runs on the host emulator
    of that hardware's tuples (tests/_simt.py) instead of a GPU; meant for `-m gpu` runs."""
    hw = os.environ.get("ATLAS_SIMT", "")
    if not hw:
        yield
        return
    from _simt import use_simt

    with pytest.MonkeyPatch.context() as monkeypatch:
        use_simt(monkeypatch, hw)
        yield
