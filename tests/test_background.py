"""tests/_background.py: marked tests run in child processes, lanes side by side, beside the rest of
the session, and report as their children did."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import os, pathlib, sys
sys.path.insert(0, {str(TESTS)!r})
from _background import (pytest_collection_finish, pytest_collection_modifyitems, pytest_sessionfinish,
                         pytest_terminal_summary)

def pytest_configure(config):
    config.addinivalue_line("markers", "background(lane): runs in a child process")

def pytest_sessionstart(session):
    if not os.environ.get("ATLAS_BACKGROUND_CHILD"):  # the children's sessions start here too
        (pathlib.Path(__file__).parent / "session-pid").write_text(str(os.getpid()))
"""

TESTS_SOURCE = """
import os, pathlib, time, pytest

HERE = pathlib.Path(__file__).parent


def wait_for(name):
    deadline = time.monotonic() + 60
    while not (HERE / name).exists():
        assert time.monotonic() < deadline, f"{name} never appeared"
        time.sleep(0.05)


def test_plain_runs_while_the_children_work():
    wait_for("b-started")
    (HERE / "plain-pid").write_text(str(os.getpid()))


@pytest.mark.background("a")
def test_a_meets_lane_b():
    wait_for("b-started")  # serial lanes would never get there


@pytest.mark.background("b")
def test_b():
    (HERE / "b-pid").write_text(str(os.getpid()))
    (HERE / "b-started").touch()


@pytest.mark.background("b")
def test_fails_in_its_child():
    assert 1 == 2, "the child says no"


@pytest.mark.background("b")
def test_skips_in_its_child():
    pytest.skip("decided in the child")


@pytest.mark.background("c")
def test_sleeper():
    (HERE / "sleeper-pid").write_text(str(os.getpid()))
    time.sleep(600)


def test_fails_plain():
    assert False, "the parent fails fast"
"""


def run_session(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    (root / "conftest.py").write_text(CONFTEST)
    (root / "test_demo.py").write_text(TESTS_SOURCE)
    for stale in ("b-started", "b-pid", "plain-pid", "sleeper-pid"):
        (root / stale).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", *args]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ATLAS_BACKGROUND")}
    return subprocess.run(cmd, cwd=root, env={**environ, **env}, capture_output=True, text=True, timeout=300)


def outcome_lines(stdout: str) -> list[str]:
    found = (re.match(r"test_demo.py::(\w+) (PASSED|FAILED|SKIPPED)", line) for line in stdout.splitlines())
    return [f"{m.group(1)} {m.group(2)}" for m in found if m]


def test_marked_tests_run_in_lanes_beside_the_session(tmp_path: Path) -> None:
    done = run_session(tmp_path, "-k", "not sleeper and not fails_plain")
    report = done.stdout + done.stderr
    assert done.returncode == 1, report
    assert outcome_lines(done.stdout) == [
        "test_plain_runs_while_the_children_work PASSED", "test_a_meets_lane_b PASSED", "test_b PASSED",
        "test_fails_in_its_child FAILED", "test_skips_in_its_child SKIPPED"], report  # marked ones last
    assert "the child says no" in done.stdout, report
    assert "in its child process: decided in the child" in done.stdout, report
    session = (tmp_path / "session-pid").read_text()
    assert (tmp_path / "plain-pid").read_text() == session
    assert (tmp_path / "b-pid").read_text() != session
    lanes = dict(re.findall(r"background lane (\w+): (\d+) tests, ended at \d+ s", done.stdout))
    assert lanes == {"a": "1", "b": "3"}, report
    assert re.search(r"the session reached their stand-ins at \d+ s", done.stdout), report


def test_opting_out_runs_them_in_the_session(tmp_path: Path) -> None:
    done = run_session(tmp_path, "-k", "test_b", ATLAS_BACKGROUND="0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "b-pid").read_text() == (tmp_path / "session-pid").read_text()


def test_a_stopped_session_kills_its_children(tmp_path: Path) -> None:
    started = time.monotonic()
    done = run_session(tmp_path, "-x", "-k", "sleeper or fails_plain")
    assert done.returncode == 1 and "the parent fails fast" in done.stdout, done.stdout + done.stderr
    assert time.monotonic() - started < 120, "the session waited for a sleeping child"
    pid_file = tmp_path / "sleeper-pid"
    if pid_file.exists():  # the child had started: it is gone now
        try:
            os.kill(int(pid_file.read_text()), 0)
            alive = True
        except ProcessLookupError:
            alive = False
        assert not alive, "the sleeping child outlived its session"
