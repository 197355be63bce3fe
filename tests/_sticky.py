"""The pytest hook that stops a session at a sticky CUDA error (tests/conftest.py imports it;
scripts/gpu_pytest.py resumes the rest in a new process)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from atlas.backends.cuda.driver import context_lost


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A sticky CUDA error stops the session after its test: every later GPU call of the process
    would fail the same way and bury the test that faulted. With ATLAS_STICKY_FILE set, the ids
    of the tests run so far go there, and scripts/gpu_pytest.py runs the rest in a new process."""
    yield
    if call.excinfo is None or not context_lost(call.excinfo.value):
        return
    session = item.session
    session.shouldfail = f"sticky CUDA error in {item.nodeid}: this process's CUDA context is lost"
    path = os.environ.get("ATLAS_STICKY_FILE")
    if path and item in session.items:
        index = session.items.index(item)
        ran = [i.nodeid for i in session.items[: index + 1]]
        Path(path).write_text(json.dumps({"failed": item.nodeid, "ran": ran, "left": len(session.items) - index - 1}))
