"""A sticky CUDA error (a kernel fault: the context is lost for the rest of the process) costs one
failed test, not every GPU test after it: tests/_sticky.py stops the session there and
scripts/gpu_pytest.py runs the rest in a new process, merging the runs' junit files. Checked on a
fake suite whose "GPU" turns every later call into the same error once one test faults, as a
real context does."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from atlas.backends.cuda.driver import CudaError, sticky_result

REPO = Path(__file__).resolve().parents[1]
FAULT = "cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)"

FAKE_SUITE = f'''
import pytest
from atlas.backends.cuda.driver import CudaError

LOST = []


def gpu_call():
    if LOST:
        raise CudaError({FAULT!r})


@pytest.mark.parametrize("i", range(7))
def test_kernel(i):
    gpu_call()
    if i in FAULTING:
        LOST.append(i)
        gpu_call()
    assert i != 3, "a plain failure"
'''


def test_sticky_results_are_told_apart() -> None:
    assert CudaError(FAULT).sticky
    assert CudaError(f"atlas_gemv grid=(4, 1, 1) block=(256, 1, 1) failed while running: {FAULT}").sticky
    assert not CudaError("cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)").sticky
    assert not CudaError("illegal memory access at 0x7f00 (block (0,0,0) thread (3,0,0))").sticky  # the emulator
    assert sticky_result("cuCtxSynchronize failed: an illegal memory access was encountered") == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert sticky_result("cuLaunchKernel failed: unspecified launch failure") == "CUDA_ERROR_LAUNCH_FAILED"
    assert sticky_result("cuMemcpyDtoH failed: invalid argument") is None


def fake_suite(tmp_path: Path, faulting: set[int]) -> Path:
    """tmp_path/suite: the fake tests, faulting at the given indices, with the sticky hook."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text("from _sticky import pytest_runtest_makereport  # noqa: F401\n")
    (suite / "test_fake.py").write_text(f"FAULTING = {sorted(faulting)!r}\n{FAKE_SUITE}")
    return suite


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), str(REPO / "tests")])}
    env.pop("ATLAS_STICKY_FILE", None)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def outcomes(junit: Path) -> dict[str, str]:
    """test name -> passed / failed, over every testsuite of the file."""
    return {case.get("name", ""): "failed" if any(c.tag in ("failure", "error") for c in case) else "passed"
            for case in ET.parse(junit).getroot().iter("testcase")}


@pytest.mark.parametrize("faulting", [{1, 4}, {6}, set()], ids=["two-faults", "last-test", "none"])
def test_the_tests_after_a_fault_run_in_a_new_process(tmp_path: Path, faulting: set[int]) -> None:
    suite, junit = fake_suite(tmp_path, faulting), tmp_path / "out.xml"
    done = run([sys.executable, str(REPO / "scripts" / "gpu_pytest.py"), "--junitxml", str(junit), "--",
                "-q", "-p", "no:cacheprovider", "--rootdir", str(suite), "test_fake.py"], suite)
    want = {f"test_kernel[{i}]": "failed" if i in faulting or i == 3 else "passed" for i in range(7)}
    assert outcomes(junit) == want, done.stdout + done.stderr
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.count("resume in a new process") == len(faulting - {6}), done.stderr


def test_one_process_alone_stops_at_the_fault(tmp_path: Path) -> None:
    """Without the wrapper the session stops after the faulting test with the reason, instead of
    failing the five after it on the lost context."""
    suite = fake_suite(tmp_path, {1})
    done = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(suite), "test_fake.py"], suite)
    assert "1 failed, 1 passed" in done.stdout and "sticky CUDA error in test_fake.py::test_kernel[1]" in done.stdout, done.stdout
    assert done.returncode == 1


def test_restarts_are_bounded(tmp_path: Path) -> None:
    suite, junit = fake_suite(tmp_path, {0, 1, 2}), tmp_path / "out.xml"
    done = run([sys.executable, str(REPO / "scripts" / "gpu_pytest.py"), "--junitxml", str(junit), "--restarts", "1",
                "--", "-q", "-p", "no:cacheprovider", "--rootdir", str(suite), "test_fake.py"], suite)
    assert list(outcomes(junit).values()) == ["failed", "failed"], done.stderr
    assert "the 5 tests after it did not run (1 restarts spent)" in done.stderr
