"""The host SIMT emulator (tests/_simt.py, tests/simt/) against the definitions it emulates, and
each fault it promises to report, on the kernels of tests/simt/selftest.cu."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from atlas.backends.cuda.driver import CudaError, LaunchArgs

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the host emulator is built with g++")


class SelfTestParams(ctypes.Structure):
    _fields_ = [("input", ctypes.c_void_p), ("out", ctypes.c_void_p), ("n", ctypes.c_int32)]


class Device:
    """The emulator driver with the self-test kernels loaded, and numpy-in / numpy-out launches."""

    def __init__(self) -> None:
        from _simt import SimtDriver, build_selftest

        self.driver = SimtDriver("sm80")
        self.module = self.driver.load_library(build_selftest())

    def put(self, array: np.ndarray) -> int:
        ptr = self.driver.mem_alloc(array.nbytes)
        self.driver.memcpy_htod(ptr, array.ctypes.data, array.nbytes, None)
        return ptr

    def get(self, ptr: int, like: np.ndarray) -> np.ndarray:
        out = np.empty_like(like)
        self.driver.memcpy_dtoh(out.ctypes.data, ptr, out.nbytes, None)
        return out

    def launch(self, kernel: str, threads: int, in_ptr: int, out_ptr: int, n: int = 0, smem: int = 0) -> None:
        params = SelfTestParams(in_ptr, out_ptr, n)
        function = self.driver.get_function(self.module, kernel)
        self.driver.launch(LaunchArgs(function, (1, 1, 1), (threads, 1, 1), smem, None,
                                      ctypes.addressof(params), ctypes.sizeof(params), kernel))

    def run(self, kernel: str, data: np.ndarray, out_like: np.ndarray, n: int = 0, threads: int = 32,
            smem: int = 0) -> np.ndarray:
        in_ptr, out_ptr = self.put(data), self.driver.mem_alloc(out_like.nbytes)  # 0xFF bytes: f32 NaN
        self.launch(kernel, threads, in_ptr, out_ptr, n, smem)
        return self.get(out_ptr, out_like)


@pytest.fixture(scope="module")
def device() -> Device:
    return Device()


def bf16_bits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    values = rng.standard_normal(shape).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16)  # truncation: any bf16 will do


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def test_block_barrier_and_shuffle(device: Device, rng: np.random.Generator) -> None:
    x = rng.standard_normal(256).astype(np.float32)
    np.testing.assert_allclose(device.run("simt_block_sum", x, x, threads=256), np.full(256, x.sum()), rtol=1e-5)
    lane_mask = int(rng.integers(1, 32))
    want = x.reshape(8, 32)[:, np.arange(32) ^ lane_mask].reshape(-1)
    np.testing.assert_array_equal(device.run("simt_shfl_xor", x, x, n=lane_mask, threads=256), want)


def test_a_missing_barrier_shows_in_the_result(device: Device, rng: np.random.Generator) -> None:
    x = rng.standard_normal(256).astype(np.float32)
    got = device.run("simt_block_sum_unsynced", x, x, threads=256)
    assert not np.allclose(got, x.sum(), rtol=1e-5, equal_nan=False), "a read before the barrier went unnoticed"


@pytest.mark.parametrize(
    ("kernel", "n", "message"),
    [
        ("simt_exit_then_sync", 16, "exited"),
        ("simt_deadlock", 0, "deadlock"),
        ("simt_read_past_end", 64, "illegal memory access"),
        ("simt_vector_load", 1, "misaligned access"),
    ],
)
def test_faults_are_reported(device: Device, kernel: str, n: int, message: str) -> None:
    x = np.zeros(64, np.float32)  # 256 bytes: element 64 is on the guard page
    with pytest.raises(CudaError, match=message):
        device.run(kernel, x, np.zeros(64, np.float32), n=n, threads=64)


def test_step_tensors_end_at_a_guard_page(device: Device) -> None:
    """GuardedArena: a 60-float scratch tensor (240 bytes, not a multiple of 256) faults at element 60;
    the same sizes in the same order give the same addresses after a reset."""
    from _simt import GuardedArena

    arena = GuardedArena(device.driver)
    first = [arena.alloc(240), arena.alloc(64)]
    arena.reset()
    assert [arena.alloc(240), arena.alloc(64)] == first and arena.generation == 0
    out = device.driver.mem_alloc(256)
    device.launch("simt_read_past_end", 32, first[0], out, n=59)
    with pytest.raises(CudaError, match="illegal memory access"):
        device.launch("simt_read_past_end", 32, first[0], out, n=60)
    arena.reset()
    arena.alloc(480)
    assert arena.generation == 1
    arena.release()


def test_launch_limits_are_enforced(device: Device) -> None:
    x = np.zeros(64, np.float32)
    ptr = device.put(x)
    with pytest.raises(CudaError, match="__launch_bounds__ 32"):
        device.launch("simt_mma_tile", 64, ptr, ptr)
    with pytest.raises(CudaError, match="dynamic shared memory"):
        device.launch("simt_block_sum", 32, ptr, ptr, smem=64 * 1024)  # > 48 KiB without the opt-in
    function = device.driver.get_function(device.module, "simt_block_sum")
    device.driver.set_max_dynamic_smem(function, 64 * 1024)
    device.launch("simt_block_sum", 32, ptr, ptr, smem=64 * 1024)


def test_mma_tile_equals_a_matrix_product(device: Device, rng: np.random.Generator) -> None:
    """ldmatrix + mma.sync m16n8k16 as gemm.cuh uses them: D = A @ B."""
    a_bits, bt_bits = bf16_bits(rng, (16, 16)), bf16_bits(rng, (8, 16))  # A [M, K], B^T [N, K]
    got = device.run("simt_mma_tile", np.concatenate([a_bits.ravel(), bt_bits.ravel()]), np.zeros((16, 8), np.float32))
    want = bf16_values(a_bits).astype(np.float64) @ bf16_values(bt_bits).astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_ldmatrix_trans_follows_the_ptx_definition(device: Device, rng: np.random.Generator) -> None:
    """PTX ISA, ldmatrix .trans: of matrix j, lane l holds elements (2 (l % 4), l / 4) and
    (2 (l % 4) + 1, l / 4); matrix j is the 8x8 quarter whose rows lanes 8j..8j+7 addressed."""
    tile = rng.integers(0, 1 << 16, size=(16, 16), dtype=np.uint16)
    got = device.run("simt_ldmatrix_trans", tile, np.zeros((32, 4), np.uint32))
    quarters = [tile[0:8, 0:8], tile[8:16, 0:8], tile[0:8, 8:16], tile[8:16, 8:16]]  # lanes 0-7, 8-15, 16-23, 24-31
    lane = np.arange(32)
    for j, quarter in enumerate(quarters):
        lo = quarter[2 * (lane % 4), lane // 4].astype(np.uint32)
        hi = quarter[2 * (lane % 4) + 1, lane // 4].astype(np.uint32)
        np.testing.assert_array_equal(got[:, j], lo | (hi << 16), err_msg=f"register {j}")


def test_shared_memory_starts_poisoned_at_every_launch(device: Device) -> None:
    """A template kernel's __shared__ array read before any write holds the poison (NaN), also after
    an earlier launch wrote 1.0 into it."""
    for _ in range(2):
        got = device.run("simt_template_shared", np.zeros(64, np.float32), np.zeros(1, np.float32), threads=64)
        assert np.isnan(got[0]), got


def test_cp_async_lands_at_the_wait(device: Device, rng: np.random.Generator) -> None:
    x = rng.standard_normal(128).astype(np.float32)
    got = device.run("simt_cp_async", x, np.zeros(256, np.float32), n=128)
    assert np.isnan(got[:128]).all(), "shared memory held the copy before cp.async.wait_group"
    np.testing.assert_array_equal(got[128:], x)


WGMMA_SMEM = (64 + 128) * 128  # the A and B tiles, 128-byte rows


def test_wgmma_tile_equals_a_matrix_product(device: Device, rng: np.random.Generator) -> None:
    """wgmma m64n128k16 from 128-byte-swizzled shared memory, D read back in the PTX ISA's
    m64nNk16 f32 accumulator layout: D = A @ B^T."""
    a_bits, b_bits = bf16_bits(rng, (64, 16)), bf16_bits(rng, (128, 16))
    data = np.concatenate([a_bits.ravel(), b_bits.ravel()])
    got = device.run("simt_wgmma_tile", data, np.zeros((64, 128), np.float32), threads=128, smem=WGMMA_SMEM)
    want = bf16_values(a_bits).astype(np.float64) @ bf16_values(b_bits).astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("mode", "message"), [(1, "written between its issue and its wgmma.wait_group"),
                                               (2, "without a wgmma.fence")])
def test_wgmma_misuse_is_reported(device: Device, rng: np.random.Generator, mode: int, message: str) -> None:
    """An operand written while its wgmma is in flight (the GPU may read it at any point up to the
    wait) and an issue without the fence PTX requires are launch failures, not lucky results."""
    data = np.concatenate([bf16_bits(rng, (64, 16)).ravel(), bf16_bits(rng, (128, 16)).ravel()])
    with pytest.raises(CudaError, match=message):
        device.run("simt_wgmma_tile", data, np.zeros((64, 128), np.float32), n=mode, threads=128, smem=WGMMA_SMEM)


def test_graph_replays_the_captured_params(device: Device, rng: np.random.Generator) -> None:
    driver = device.driver
    x = rng.standard_normal(64).astype(np.float32)
    in_ptr, out_a, out_b = device.put(x), driver.mem_alloc(256), driver.mem_alloc(256)
    params = SelfTestParams(in_ptr, out_a, 3)
    function = driver.get_function(device.module, "simt_shfl_xor")
    launch: Callable[[], None] = lambda: driver.launch(LaunchArgs(
        function, (1, 1, 1), (64, 1, 1), 0, None, ctypes.addressof(params), ctypes.sizeof(params), "simt_shfl_xor"))
    driver.begin_capture(None)
    launch()
    driver.memset_d8(out_b, 0, 64 * 4, None)
    graph = driver.end_capture(None)
    assert np.isnan(device.get(out_a, x)).all(), "a captured launch ran at capture time"
    params.out, params.n = out_b, 5  # later changes to the struct do not reach the graph
    driver.memcpy_htod(out_b, np.ones(64, np.float32).ctypes.data, 256, None)
    driver.graph_launch(graph, None)
    np.testing.assert_array_equal(device.get(out_a, x), x.reshape(2, 32)[:, np.arange(32) ^ 3].reshape(-1))
    np.testing.assert_array_equal(device.get(out_b, x), np.zeros(64, np.float32))
    driver.graph_destroy(graph)
    with pytest.raises(CudaError, match="destroyed"):
        driver.graph_launch(graph, None)


QWEN = "qwen3.6-35b-a3b"
# The qwen3.6-dimension tests that take minutes each on the emulator (the lm_head GEMV, the prefill
# GEMMs and MoE at 17 tokens and up), left to the device run.
QWEN_HEAVY = (
    f"test_gpu_ops.py::test_linear_lm_head[{QWEN}]", f"test_gpu_ops.py::test_linear[{QWEN}-17]",
    f"test_gpu_ops.py::test_linear[{QWEN}-100]", f"test_gpu_ops.py::test_moe_experts[{QWEN}-17]",
    f"test_gpu_ops.py::test_moe_experts[{QWEN}-70]",
    f"test_gpu_moe_shared.py::test_moe_experts_with_the_shared_slot[{QWEN}-70]",
)
DEMO = ["-k", "not qwen", "tests"]
# The opt-in forms the device run measures before any becomes a default.
OPT_IN = {"ATLAS_GEMM": "wgmma", "ATLAS_PREFILL_ATTENTION": "simt", "ATLAS_DELTANET_DECODE": "fused",
          "ATLAS_ROUTER": "fused", "ATLAS_ATTENTION_PREP": "fused", "ATLAS_NORM": "fused", "ATLAS_LAUNCH": "pdl"}  # pdl: its launch path (the emulator has nothing to order)
SUITES: dict[str, tuple[list[str], dict[str, str]]] = {
    # every gpu-marked test at the demo dimensions, with the default forms and with the opt-in ones
    "demo": (DEMO, {}),
    "demo-opt-in": (DEMO, OPT_IN),
    # the real-dimension kernel instances (head_dim 256, 256 experts, the DeltaNet heads, the KV levels)
    "qwen-dims": (["-k", "qwen", *(f"--deselect=tests/{t}" for t in QWEN_HEAVY),
                   *(f"tests/test_gpu_{f}.py" for f in ("ops", "delta_decode", "delta_chunked", "router_fused",
                                                        "moe_shared", "kv", "attention_prep"))], {}),
}


@pytest.mark.slow
@pytest.mark.background("emulator-suites")
@pytest.mark.parametrize("suite", SUITES)
def test_gpu_suite_passes_on_the_emulated_h200_kernels(suite: str) -> None:
    """gpu-marked tests with their CUDA backend on the emulated h200 tuples, whose sources hold
    gb10's and sm80's plus wgmma. The REQUIRE flags turn "no CUDA backend" into a failure, so
    nothing passes by skipping; the qwen3.6 model-against-transformers test needs ~17 GB for the
    fp32 reference and stays with the device run."""
    repo = Path(__file__).resolve().parent.parent
    args, forms = SUITES[suite]
    env = {**os.environ, **forms, "ATLAS_SIMT": "h200", "ATLAS_REQUIRE_GPU": "1", "ATLAS_REQUIRE_GPU_QUANT": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rs", *args]
    done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    report = done.stdout[-8000:] + done.stderr[-2000:]
    assert done.returncode == 0, report
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 50, report
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    allowed = ("pycuda is not installed", "T = 1 is decode")
    assert all(any(reason in line for reason in allowed) for line in skips), report
