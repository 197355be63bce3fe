"""Runs the slowest tests (the host emulator's suites and benchmarks, ~45 minutes of one core) in
child pytest processes, started as soon as collection ends, so on CI's two cores they proceed
beside the rest of the session instead of after it.

A test marked `background(lane)` runs as `python -m pytest <its node id>` in a child process. Each
lane runs its tests one after another, the lanes side by side (the emulator benchmarks load ~9 GB
each: they share a lane so two never overlap). In the session the test is moved to the end and
stands for its child: it passes, skips or fails as the child did, showing the child's output when
it fails. ATLAS_BACKGROUND=0 runs marked tests in-process as plain tests (to debug one).
The terminal summary says how long each lane ran and when the session reached the stand-ins, so
the split can be balanced from a CI log. tests/conftest.py imports the hooks.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

MARK = "background"
CHILD = "ATLAS_BACKGROUND_CHILD"  # set in a child: its tests run in-process
LANES = pytest.StashKey["Lanes"]()
OUTPUT_TAIL = 12_000


@dataclass
class Job:
    nodeid: str
    log: Path
    returncode: int | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""


class Lanes:
    """One thread per lane, each running its jobs' child pytest processes in turn."""

    def __init__(self, root: Path, lanes: dict[str, list[str]]) -> None:
        self.root = root
        self.logs = tempfile.TemporaryDirectory(prefix="atlas-background-")
        self.jobs: dict[str, Job] = {}
        self.lock = threading.Lock()  # a child starts only while the session has not stopped
        self.stopping = False
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.started = time.monotonic()
        self.lane_seconds: dict[str, tuple[int, float]] = {}  # lane -> (tests run, seconds) once it ends
        self.reached: float | None = None  # seconds into the session when it first waited for a child
        self.threads = []
        for lane, nodeids in lanes.items():
            jobs = [self._job(nodeid) for nodeid in nodeids]
            self.threads.append(threading.Thread(target=self._run_lane, args=(lane, jobs), daemon=True))
        for thread in self.threads:
            thread.start()

    def _job(self, nodeid: str) -> Job:
        job = Job(nodeid, Path(self.logs.name) / f"{len(self.jobs)}.log")
        self.jobs[nodeid] = job
        return job

    def _run_lane(self, lane: str, jobs: list[Job]) -> None:
        for job in jobs:
            job.returncode = self._run_child(lane, job)
            job.done.set()
        ran = sum(job.returncode is not None for job in jobs)  # a stopped session's lane ran fewer
        self.lane_seconds[lane] = (ran, time.monotonic() - self.started)

    def _run_child(self, lane: str, job: Job) -> int | None:
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", job.nodeid]
        with job.log.open("wb") as log:
            with self.lock:
                if self.stopping:
                    return None
                # Its own session: the emulator suites start a grandchild pytest, killed with it.
                child = subprocess.Popen(cmd, cwd=self.root, env={**os.environ, CHILD: "1"}, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
                self.running[lane] = child
            returncode = child.wait()
        with self.lock:
            self.running.pop(lane, None)
        return returncode

    def wait(self, nodeid: str) -> Job:
        if self.reached is None:
            self.reached = time.monotonic() - self.started
        job = self.jobs[nodeid]
        job.done.wait()
        return job

    def stop(self) -> None:
        """Kills what still runs (an interrupted or failed-fast session) and removes the logs."""
        with self.lock:
            self.stopping = True
            for child in self.running.values():
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for thread in self.threads:
            thread.join()
        self.logs.cleanup()


class ChildFailed(Exception):
    pass


class BackgroundItem(pytest.Item):
    """Stands in the session for a test that runs in a child process: waits for the child and
    reports its outcome."""

    def __init__(self, *, original: pytest.Item, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.original = original
        self.own_markers.extend(original.own_markers)  # a parameter's marks (skipif and such)
        self.keywords.update(original.keywords)

    def runtest(self) -> None:
        job = self.config.stash[LANES].wait(self.nodeid)
        output = job.output()
        if job.returncode is None:
            raise ChildFailed("the session stopped before this test's child process ran")
        if job.returncode == 0 and re.search(r"\b1 skipped\b", output) and not re.search(r"\b1 passed\b", output):
            reason = re.search(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", output, re.MULTILINE)
            pytest.skip(f"in its child process: {reason.group(1) if reason else '?'}")
        if job.returncode != 0 or not re.search(r"\b1 passed\b", output):
            raise ChildFailed(f"child pytest exited {job.returncode}:\n{output[-OUTPUT_TAIL:]}")

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: object = None) -> str:
        if isinstance(excinfo.value, ChildFailed):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.original.reportinfo()


def children_run_marked_tests() -> bool:
    return os.environ.get(CHILD) != "1" and os.environ.get("ATLAS_BACKGROUND", "1") != "0"


def lane_of(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker(MARK)
    return str(mark.args[0]) if mark else None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """After selection (-k, -m): each marked test becomes its stand-in, moved to the end so the
    session runs everything else while the children work."""
    if not children_run_marked_tests() or config.option.collectonly:
        return
    marked = [item for item in items if lane_of(item)]
    if not marked:
        return
    standins = [BackgroundItem.from_parent(item.parent, name=item.name, original=item) for item in marked]
    items[:] = [item for item in items if not lane_of(item)] + standins


def pytest_collection_finish(session: pytest.Session) -> None:
    lanes: dict[str, list[str]] = {}
    for item in session.items:
        if isinstance(item, BackgroundItem):
            lanes.setdefault(lane_of(item) or "", []).append(item.nodeid)
    if lanes:
        session.config.stash[LANES] = Lanes(session.config.rootpath, lanes)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Each lane's length beside the session's own, to balance them."""
    lanes = config.stash.get(LANES, None)
    if lanes is None or not lanes.lane_seconds:
        return
    reached = "never" if lanes.reached is None else f"at {lanes.reached:.0f} s"
    for lane, (count, seconds) in sorted(lanes.lane_seconds.items()):
        terminalreporter.write_line(f"background lane {lane}: {count} tests, ended at {seconds:.0f} s")
    terminalreporter.write_line(f"background lanes: the session reached their stand-ins {reached}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    lanes = session.config.stash.get(LANES, None)
    if lanes is not None:
        lanes.stop()
