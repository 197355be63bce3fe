"""CPU checks of the h200 wgmma GEMM (gemm_wgmma.cuh, atlas_gemm_wgmma; no GPU needed).

The emulation stages x and W the way the kernel's threads do (which global element lands at which
shared-memory byte, 128-byte swizzle), builds the kernel's matrix descriptors, then reads the
operands back the way the PTX ISA says wgmma does (descriptor fields, K-major canonical layout,
the hardware's address-bit swizzle), spreads each 64 x 128 product over the D fragment registers
by the ISA's table and writes them out with the kernel's epilogue index math. The result must be
bf16(x) @ bf16(W)^T for shapes that are not multiples of the tile.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from atlas.backends.cuda import ops_dense
from atlas.errors import AtlasError
from atlas.kernel_params import dense as kp

from _abi import MODELS, REPO, PtxBuild, RecordingRuntime, compile_ptx_entries, header_constant

HEADER = "gemm_wgmma.cuh"
BM, BN, BK = (header_constant(HEADER, n) for n in ("kWgmmaBM", "kWgmmaBN", "kWgmmaBK"))
THREADS = header_constant(HEADER, "kWgmmaThreads")
STAGES = header_constant(HEADER, "kWgmmaStages")
GROUP_ROWS = header_constant(HEADER, "kWgmmaGroupRows")
WG_K = header_constant(HEADER, "kWgmmaK")
ROW_BYTES = BK * 2
TILE_BYTES = BM * ROW_BYTES
STAGES_OFFSET = 2 * TILE_BYTES  # the W ring follows the two A tiles
SMEM_BYTES = STAGES_OFFSET + STAGES * TILE_BYTES + 1024
A_LOADS, B_LOADS = BM * BK // 4 // THREADS, BN * BK // 8 // THREADS
TID = np.arange(THREADS)


# --- the kernel's side (mirrors gemm_wgmma.cuh) ----------------------------------------------------
def swizzled(row: np.ndarray, col: np.ndarray) -> np.ndarray:
    """wgmma_swizzled: byte of element (row, col) in a [rows][64] bf16 tile."""
    return row * ROW_BYTES + (((col // 8) ^ (row % 8)) * 16) + (col % 8) * 2


def kernel_desc(addr: int, stride: int = 8 * ROW_BYTES) -> int:
    """wgmma_desc: start >> 4 (bits 0-13), leading 16 >> 4 (16-29), stride >> 4 (32-45), 128B swizzle."""
    return ((addr & 0x3FFFF) >> 4) | ((16 >> 4) << 16) | ((stride >> 4) << 32) | (1 << 62)


def as_bf16_bits(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


@dataclass
class Block:
    """One block's shared memory and the asynchronous parts of the machine, in one of two timings:
    "early" lands each cp.async at its issue and reads wgmma operands at wgmma.wait_group (a W tile
    refilled or an A tile rewritten while a wgmma may still read it changes the result); "late"
    lands cp.async groups only at the cp.async.wait_group that guarantees them and reads wgmma
    operands at issue (a tile read before its copies are waited for holds stale 0xFF bytes)."""

    x: np.ndarray  # [T, K] f32
    w: np.ndarray  # [N, K] bf16 bits (uint16)
    smem: np.ndarray  # uint8, indexed by shared byte address
    aligned: int  # the kernel's 1024-aligned base
    timing: str
    stride: int = 8 * ROW_BYTES
    group: list[tuple[int, np.ndarray]] = field(default_factory=list)
    pending: list[list[tuple[int, np.ndarray]]] = field(default_factory=list)
    in_flight: list[tuple[int, int, np.ndarray]] = field(default_factory=list)

    def write(self, addr: int, data: np.ndarray) -> None:
        raw = np.ascontiguousarray(data).view(np.uint8)
        self.smem[addr:addr + raw.size] = raw

    def cp_async_16(self, addr: int, data: np.ndarray) -> None:
        assert addr % 16 == 0 and data.nbytes == 16, "cp.async 16 misaligned"
        if self.timing == "early":
            self.write(addr, data)
        else:
            self.group.append((addr, data.copy()))

    def commit(self) -> None:
        self.pending.append(self.group)
        self.group = []

    def wait(self, allowed: int) -> None:
        while len(self.pending) > allowed:
            for addr, data in self.pending.pop(0):
                self.write(addr, data)

    def wgmma(self, a_tile: int, b_tile: int, acc: np.ndarray) -> None:
        self.in_flight.append((a_tile, b_tile, acc))
        if self.timing == "late":
            self.wgmma_wait_all()

    def wgmma_wait_all(self) -> None:
        for a_tile, b_tile, acc in self.in_flight:
            wgmma_compute(self, a_tile, b_tile, acc)
        self.in_flight = []

    # the shared-memory layout (WgmmaSmem)
    def a(self, i: int) -> int:
        return self.aligned + i * TILE_BYTES

    def w_tile(self, step: int) -> int:
        return self.aligned + STAGES_OFFSET + (step % STAGES) * TILE_BYTES


def chunk_grid(j: int, per_row: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of chunk tid + j * threads for every thread, per_row chunks of 64 / per_row columns."""
    c = TID + j * THREADS
    return c // per_row, (c % per_row) * (BK // per_row)


def issue_b(b: Block, n0: int, step: int) -> None:
    """wgmma_issue_b: W chunks (8 bf16) into the ring's swizzled tile; zeros past N / K."""
    n, k = b.w.shape
    k0, tile = step * BK, b.w_tile(step)
    for j in range(B_LOADS):
        for r, c in zip(*chunk_grid(j, BK // 8)):
            valid = n0 + r < n and k0 + c < k
            b.cp_async_16(tile + int(swizzled(r, c)), b.w[n0 + r, k0 + c:k0 + c + 8] if valid else np.zeros(8, np.uint16))


def load_a(b: Block, m0: int, step: int) -> list[np.ndarray]:
    """wgmma_load_a: each thread's float4 registers (zeros past T / K), [j][thread] -> 4 f32."""
    t, k = b.x.shape
    k0 = step * BK
    return [np.stack([b.x[m0 + r, k0 + c:k0 + c + 4] if m0 + r < t and k0 + c < k else np.zeros(4, np.float32)
                      for r, c in zip(*chunk_grid(j, BK // 4))]) for j in range(A_LOADS)]


def store_a(b: Block, regs: list[np.ndarray], a_tile: int) -> set[int]:
    """wgmma_store_a: 4 bf16 per (thread, j) at the swizzled byte; returns the bytes written."""
    written: set[int] = set()
    for j in range(A_LOADS):
        for (r, c), values in zip(zip(*chunk_grid(j, BK // 4)), regs[j]):
            dst = a_tile + int(swizzled(r, c))
            assert dst % 8 == 0, "uint2 store misaligned"
            b.write(dst, as_bf16_bits(values))
            written.update(range(dst, dst + 8))
    return written


def wgmma_compute(b: Block, a_tile: int, b_tile: int, acc: np.ndarray) -> None:
    """wgmma_compute for both warpgroups: 4 chained m64n128k16, descriptors advanced 32 B per k16."""
    for group in range(2):
        a_base = a_tile + group * GROUP_ROWS * ROW_BYTES
        for ks in range(BK // WG_K):
            a = descriptor_operand(b.smem, kernel_desc(a_base + ks * WG_K * 2, b.stride), GROUP_ROWS)
            w = descriptor_operand(b.smem, kernel_desc(b_tile + ks * WG_K * 2, b.stride), BN)
            spread_d(acc[group], a @ w.T)


# --- the hardware's side (PTX ISA: matrix descriptor, K-major 128B-swizzle layout, D fragments) ---
def descriptor_operand(smem: np.ndarray, desc: int, rows: int) -> np.ndarray:
    """The [rows, 16] bf16 operand wgmma reads through `desc` (K-major, no transpose)."""
    start = (desc & 0x3FFF) << 4
    stride = ((desc >> 32) & 0x3FFF) << 4
    assert (desc >> 62) == 1 and ((desc >> 49) & 7) == 0, "expected 128B swizzle, base offset 0"
    r = np.arange(rows)[:, None]
    k = np.arange(WG_K)[None, :]
    linear = start + (r // 8) * stride + (r % 8) * 128 + 2 * k  # [rows, 16] byte addresses
    physical = linear ^ (((linear >> 7) & 7) << 4)  # 128B swizzle: 16-byte chunk ^= row within 1024
    bits = smem[physical].astype(np.uint16) | (smem[physical + 1].astype(np.uint16) << 8)
    return bits.view(ml_dtypes.bfloat16).astype(np.float64)


def spread_d(acc: np.ndarray, d: np.ndarray) -> None:
    """acc [4 warps, 32 lanes, N/2] += the m64nNk16 f32 D fragment: warp w holds rows 16w..16w+15;
    register i of lane l: row 16w + l/4 + 8 * ((i/2) % 2), column 8 * (i/4) + 2 * (l%4) + i%2."""
    w, lane, i = np.meshgrid(np.arange(4), np.arange(32), np.arange(acc.shape[2]), indexing="ij")
    acc += d[16 * w + lane // 4 + 8 * ((i // 2) % 2), 8 * (i // 4) + 2 * (lane % 4) + i % 2]


def emulate_block(b: Block, m0: int, n0: int, out: np.ndarray) -> None:
    """gemm_wgmma's program order for one block."""
    acc = np.zeros((2, 4, 32, BN // 2))  # [warpgroup, warp, lane, register]
    steps = -(-b.x.shape[1] // BK)
    for s in range(STAGES - 1):
        if s < steps:
            issue_b(b, n0, s)
        b.commit()
    a_next = load_a(b, m0, 0)
    assert len(store_a(b, a_next, b.a(0))) == TILE_BYTES, "an A tile byte is left unwritten"
    if steps > 1:
        a_next = load_a(b, m0, 1)
    b.wait(STAGES - 2)
    for step in range(steps):
        ahead = step + STAGES - 1
        if ahead < steps:
            issue_b(b, n0, ahead)
        b.commit()
        b.wgmma(b.a(step & 1), b.w_tile(step), acc)
        if step + 1 < steps:
            store_a(b, a_next, b.a((step + 1) & 1))
        if step + 2 < steps:
            a_next = load_a(b, m0, step + 2)
        b.wait(STAGES - 2)
        b.wgmma_wait_all()
    store_out(acc, m0, n0, out)


def store_out(acc: np.ndarray, m0: int, n0: int, out: np.ndarray) -> None:
    """wgmma_store_out, thread by thread: registers i, i + 1 go to columns col, col + 1."""
    t, n = out.shape
    for tid in range(THREADS):
        group, warp, lane = tid // 128, (tid // 32) % 4, tid % 32
        row0 = m0 + group * GROUP_ROWS + warp * 16 + lane // 4
        for i in range(0, BN // 2, 2):
            row, col = row0 + 8 * ((i % 4) // 2), n0 + 8 * (i // 4) + 2 * (lane % 4)
            if row >= t:
                continue
            if n % 2 == 0 and col + 1 < n:
                assert (row * n + col) % 2 == 0, "float2 store misaligned"
            for e in range(2):
                if col + e < n:
                    out[row, col + e] = acc[group, warp, lane, i + e]


def emulate_gemm(x: np.ndarray, w_bits: np.ndarray, rng: np.random.Generator, timing: str,
                 stride: int = 8 * ROW_BYTES) -> np.ndarray:
    """Every block of the grid ops_dense.gemm launches for "wgmma"; output poisoned with NaN."""
    (t, k), n = x.shape, w_bits.shape[0]
    rt = RecordingRuntime()
    params = kp.LinearParams(x=rt.empty(x.shape, "f32").ptr, weight=rt.empty(w_bits.shape, "bf16").ptr,
                             out=rt.empty((t, n), "f32").ptr, tokens=t, n=n, k=k)
    ops_dense.gemm(rt, params, "wgmma")
    (launch,) = rt.launches
    raw = 16 * int(rng.integers(0, 64))  # dynamic shared memory is only 16-byte aligned
    aligned = (raw + 1023) & ~1023
    assert aligned + SMEM_BYTES - 1024 <= raw + launch.smem
    out = np.full((t, n), np.nan)
    for by in range(launch.grid[1]):
        for bx in range(launch.grid[0]):
            m0, n0 = by * BM, bx * BN
            if m0 < t and n0 < n:
                smem = np.full(raw + launch.smem, 0xFF, np.uint8)  # stale bytes: bf16 / f32 NaNs
                emulate_block(Block(x, w_bits, smem, aligned, timing, stride), m0, n0, out)
    return out


def _operands(rng: np.random.Generator, t: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = rng.standard_normal((t, k)).astype(np.float32)
    w_bits = as_bf16_bits(rng.standard_normal((n, k)) * 0.1)
    want = as_bf16_bits(x).view(ml_dtypes.bfloat16).astype(np.float64) @ w_bits.view(ml_dtypes.bfloat16).astype(np.float64).T
    return x, w_bits, want


@pytest.mark.parametrize("timing", ["early", "late"])
@pytest.mark.parametrize("parity", [0, 1])
def test_emulated_wgmma_gemm_equals_x_times_w_transposed(rng: np.random.Generator, parity: int, timing: str) -> None:
    t = int(rng.integers(BM + 1, 2 * BM))
    n = 2 * int(rng.integers(BN // 2 + 1, BN)) + parity  # partial tiles both ways; odd N: scalar stores
    k = 8 * int(rng.integers((STAGES + 1) * BK // 8 + 1, (STAGES + 2) * BK // 8))  # ring wraps; partial last step
    x, w_bits, want = _operands(rng, t, n, k)
    out = emulate_gemm(x, w_bits, rng, timing)
    assert np.isfinite(out).all(), "some output element is never written"
    np.testing.assert_allclose(out, want, rtol=1e-9, atol=1e-9)


def test_emulation_catches_a_wrong_descriptor_stride(rng: np.random.Generator) -> None:
    x, w_bits, want = _operands(rng, 20, 40, BK)
    out = emulate_gemm(x, w_bits, rng, "early", stride=4 * ROW_BYTES)
    assert not np.allclose(out, want, rtol=1e-3, atol=1e-3)


def test_descriptor_fields_follow_the_ptx_isa(rng: np.random.Generator) -> None:
    addr = 1024 * int(rng.integers(0, 200)) + 32 * int(rng.integers(0, 4))
    desc = kernel_desc(addr)
    assert desc & 0x3FFF == addr >> 4 and (desc >> 14) & 3 == 0
    assert (desc >> 16) & 0x3FFF == 1 and (desc >> 32) & 0x3FFF == 1024 >> 4
    assert (desc >> 49) & 7 == 0 and desc >> 62 == 1 and desc < 1 << 64


# --- wrapper, flag and PTX entry ----------------------------------------------------------------------
def test_wrapper_geometry_mirrors_the_header() -> None:
    assert (ops_dense.WGMMA_BM, ops_dense.WGMMA_BN, ops_dense.WGMMA_BK) == (BM, BN, BK)
    assert ops_dense.WGMMA_THREADS == THREADS == 2 * 128
    assert ops_dense.WGMMA_STAGES == STAGES and ops_dense.WGMMA_SMEM == SMEM_BYTES <= 227 * 1024
    assert A_LOADS * THREADS * 4 == BM * BK and B_LOADS * THREADS * 8 == BN * BK


def test_linear_takes_the_wgmma_gemm_only_past_the_gemv_sizes(rng: np.random.Generator) -> None:
    rt = RecordingRuntime()
    k, n = 8 * int(rng.integers(1, 300)), int(rng.integers(1, 3000))
    for t in (1, ops_dense.GEMV_MAX_TOKENS, ops_dense.GEMV_MAX_TOKENS + 1, int(rng.integers(9, 3000))):
        ops_dense.linear(rt, rt.empty((t, k), "f32"), rt.empty((n, k), "bf16"), gemm_with="wgmma")
        launch = rt.launches[-1]
        if t <= ops_dense.GEMV_MAX_TOKENS:
            assert launch.kernel.startswith("atlas_gemv")
            continue
        assert launch.kernel == "atlas_gemm_wgmma" and launch.block == (THREADS, 1, 1)
        assert launch.grid[0] * BN >= n > (launch.grid[0] - 1) * BN
        assert launch.grid[1] * BM >= t > (launch.grid[1] - 1) * BM
        assert launch.smem == SMEM_BYTES


def _device(cc: tuple[int, int], sm: int = 90) -> SimpleNamespace:
    """A runtime on a GPU of `cc` with a tuple built for sm_`sm` loaded."""
    return SimpleNamespace(info=SimpleNamespace(cc=cc), image=SimpleNamespace(sm=sm, label=f"sm{sm} tuple"))


def test_gemm_form_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ops_dense.GEMM_ENV, raising=False)
    assert ops_dense.gemm_form(_device((8, 0))) == "mma"
    monkeypatch.setenv(ops_dense.GEMM_ENV, "wgmma")
    assert ops_dense.gemm_form(_device((9, 0))) == "wgmma"
    assert ops_dense.gemm_form(_device((12, 1)), "mma") == "mma"
    for cc in ((8, 0), (12, 1), (10, 0)):
        with pytest.raises(AtlasError, match=r"ATLAS_GEMM=wgmma needs an h200.*unset ATLAS_GEMM") as err:
            ops_dense.gemm_form(_device(cc))
        assert "\n" not in str(err.value)
    for sm in (80, 121):  # another tuple's PTX on an H200 has no wgmma kernel
        with pytest.raises(AtlasError, match=rf"ATLAS_GEMM=wgmma needs the h200 tuple's kernels; the loaded sm{sm} "
                                             rf"tuple is built for sm_{sm}; unset ATLAS_GEMM"):
            ops_dense.gemm_form(_device((9, 0), sm))
    monkeypatch.setenv(ops_dense.GEMM_ENV, "tma")
    with pytest.raises(AtlasError, match=r"ATLAS_GEMM='tma' is not a prefill GEMM form"):
        ops_dense.gemm_form(_device((9, 0)))


def test_entry_exists_on_h200_only() -> None:
    for model in MODELS:
        for hw in ("h200", "gb10", "sm80"):
            text = (REPO / "kernels" / hw / model / "bf16" / "linear.cu").read_text()
            assert ("atlas_gemm_wgmma" in text) == (hw == "h200"), f"{hw}/{model}"


def test_ptx_entry_takes_linear_params(tmp_path: Path) -> None:
    sources = ("kernels/h200/qwen3.6-35b-a3b/bf16/linear.cu",)
    entries = compile_ptx_entries(PtxBuild("h200", "qwen3.6-35b-a3b", "bf16", "compute_90a", sources), tmp_path)
    entry = entries["atlas_gemm_wgmma"]
    assert entry.param_bytes == ctypes.sizeof(kp.LinearParams)
    assert entry.align == ctypes.alignment(kp.LinearParams)
    assert entry.max_threads == THREADS


def test_backend_reads_the_flag_and_launches_an_h200_entry(monkeypatch: pytest.MonkeyPatch,
                                                           rng: np.random.Generator) -> None:
    """The demo through CudaBackend on the emulated H200 driver (test_cuda_select): with
    ATLAS_GEMM=wgmma its prefill GEMMs are atlas_gemm_wgmma, an entry of the h200 instance files."""
    from atlas.demo import DEMO_DIR
    from test_cuda_launch_entries import instance_entries, launched_kernels

    monkeypatch.setenv(ops_dense.GEMM_ENV, "wgmma")
    launched = launched_kernels(DEMO_DIR, rng, dump=False)
    assert "atlas_gemm_wgmma" in launched and "atlas_gemm_bf16" not in launched
    assert launched <= instance_entries("h200", "atlas-demo", "bf16")
