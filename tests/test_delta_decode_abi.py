"""CPU-side checks of the fused Gated DeltaNet decode kernel (delta_decode.cuh), no GPU needed.

The op wrapper runs against a recording runtime: its launch must match the compiled PTX entry
(params size, block = launch bound) and the grid the kernel accepts. A numpy emulation follows the
kernel's index math block by block (threads' columns and state rows, the q/k / v conv channels,
the arrival counters, the last block's q/k conv state and gated norm) over random block orders,
and must reproduce the numpy backend's three ops while writing every conv-state and recurrent-state
entry exactly once and reading no conv-state entry after it was overwritten. A deliberately racy
ownership (q/k state written by a fixed block as soon as it ran) must be caught by the same check.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from atlas.backends.base import DeltaNetInputs, DeltaNetOperands
from atlas.backends.cuda import ops_delta_decode as ops
from atlas.backends.numpy_backend import NumpyBackend
from atlas.errors import AtlasError

from _abi import MODELS, PtxBuild, PtxEntry, RecordingRuntime, compile_ptx_entries, header_constant, model_dims

THREADS = 32 * header_constant("delta_rule.cuh", "kWarps")
COLS_PER_WARP = header_constant("delta_rule.cuh", "kColsPerWarp")
KEY_PARTS = 32 // COLS_PER_WARP
COLS_PER_BLOCK = THREADS // 32 * COLS_PER_WARP
EPS = 1e-6


@dataclass(frozen=True)
class Dims:
    hk: int
    hv: int
    dk: int
    dv: int
    width: int

    @classmethod
    def of(cls, model: str) -> Dims:
        d = model_dims(model)
        return cls(d["linear_num_key_heads"], d["linear_num_value_heads"], d["linear_key_head_dim"],
                   d["linear_value_head_dim"], d["linear_conv_kernel_dim"])

    @property
    def channels(self) -> int:
        return 2 * self.hk * self.dk + self.hv * self.dv

    @property
    def group_blocks(self) -> int:
        return self.hv // self.hk * (self.dv // COLS_PER_BLOCK)


def _recorded_launch(d: Dims, conv_dtype: str) -> RecordingRuntime:
    rt = RecordingRuntime()
    f = lambda *s: rt.empty(s, "f32")  # noqa: E731
    x = DeltaNetInputs(f(1, d.channels), f(1, d.hv, d.dv), f(1, d.hv), f(1, d.hv))
    layer = DeltaNetOperands(rt.empty((d.channels, d.width), conv_dtype), f(d.hv), f(d.hv), f(d.dv), EPS,
                             f(d.channels, d.width - 1), f(d.hv, d.dk, d.dv), d.hk)
    out = ops.delta_net_decode(rt, x, layer, rt.empty((ops.ARRIVAL_COUNTERS,), "i32"))
    assert out.shape == (1, d.hv, d.dv)
    return rt


@pytest.fixture(scope="module", params=MODELS)
def ptx_entry(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, PtxEntry]:
    model = request.param
    build = PtxBuild("sm80", model, "bf16", "compute_80", (f"kernels/sm80/{model}/bf16/delta_net_decode.cu",))
    found = compile_ptx_entries(build, tmp_path_factory.mktemp(model.replace(".", "_")))
    assert set(found) == {"atlas_delta_net_decode"}
    return model, found["atlas_delta_net_decode"]


@pytest.mark.parametrize("conv_dtype", ["f32", "bf16"])
def test_launch_matches_the_ptx_entry_and_the_grid_the_kernel_takes(ptx_entry: tuple[str, PtxEntry], conv_dtype: str) -> None:
    model, entry = ptx_entry
    d = Dims.of(model)
    (launch,) = _recorded_launch(d, conv_dtype).launches
    p = launch.params
    assert launch.kernel == "atlas_delta_net_decode" and launch.smem == 0
    assert entry.param_bytes == ctypes.sizeof(p) and entry.align == ctypes.alignment(type(p))
    assert math.prod(launch.block) == entry.max_threads == THREADS
    assert launch.grid == (d.hv, d.dv // COLS_PER_BLOCK, 1)  # the kernel refuses any other grid
    assert (p.num_k_heads, p.num_v_heads, p.k_head_dim, p.v_head_dim, p.kernel_width) == (d.hk, d.hv, d.dk, d.dv, d.width)
    assert p.weight_bf16 == (conv_dtype == "bf16") and p.arrivals and math.isclose(p.eps, EPS, rel_tol=1e-6)


def test_bad_calls_are_refused() -> None:
    d = Dims(2, 4, 64, 64, 4)
    rt = RecordingRuntime()
    f = lambda *s: rt.empty(s, "f32")  # noqa: E731
    layer = DeltaNetOperands(f(d.channels, d.width), f(d.hv), f(d.hv), f(d.dv), EPS, f(d.channels, d.width - 1),
                             f(d.hv, d.dk, d.dv), d.hk)
    arrivals = rt.empty((ops.ARRIVAL_COUNTERS,), "i32")
    with pytest.raises(ValueError, match="mixed"):  # two tokens: not a decode step
        ops.delta_net_decode(rt, DeltaNetInputs(f(2, d.channels), f(2, d.hv, d.dv), f(2, d.hv), f(2, d.hv)), layer, arrivals)
    with pytest.raises(ValueError, match="dtype"):
        x = DeltaNetInputs(f(1, d.channels), rt.empty((1, d.hv, d.dv), "bf16"), f(1, d.hv), f(1, d.hv))
        ops.delta_net_decode(rt, x, layer, arrivals)
    assert rt.launches == []


def test_the_form_comes_from_the_environment_once() -> None:
    assert ops.decode_form(None, {}) == "separate"
    assert ops.decode_form(None, {"ATLAS_DELTANET_DECODE": "fused"}) == "fused"
    assert ops.decode_form("separate", {"ATLAS_DELTANET_DECODE": "fused"}) == "separate"
    with pytest.raises(AtlasError, match="ATLAS_DELTANET_DECODE='one'.*'fused'"):
        ops.decode_form(None, {"ATLAS_DELTANET_DECODE": "one"})


# --- emulation of the kernel's index math --------------------------------------------------------


@dataclass
class Memory:
    """The kernel's global memory, and who touched which conv / recurrent state entry when."""

    mixed: np.ndarray  # [C]
    z: np.ndarray  # [Hv*Dv]
    a: np.ndarray  # [Hv]
    b: np.ndarray  # [Hv]
    conv_weight: np.ndarray  # [C, K]
    conv_state: np.ndarray  # [C, K-1]
    A_log: np.ndarray  # [Hv]
    dt_bias: np.ndarray  # [Hv]
    norm_weight: np.ndarray  # [Dv]
    state: np.ndarray  # [Hv, Dk, Dv]
    out: np.ndarray  # [Hv*Dv]
    arrivals: np.ndarray  # [Hk]
    eps: float = EPS
    clock: int = 0
    conv_reads: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # channel -> (time, block)
    conv_writes: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    state_writes: np.ndarray | None = None  # [Hv, Dk, Dv] write counts

    def log(self, table: dict[int, list[tuple[int, int]]], channels: np.ndarray, block: int) -> None:
        self.clock += 1
        for c in np.unique(channels).tolist():
            table.setdefault(c, []).append((self.clock, block))


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def qk_channels(d: Dims, hk: int) -> np.ndarray:
    """delta_decode.cuh qk_channel over i in [0, 2 Dk)."""
    i = np.arange(2 * d.dk)
    return np.where(i < d.dk, hk * d.dk + i, d.hk * d.dk + hk * d.dk + (i - d.dk))


def conv_channels(mem: Memory, channels: np.ndarray, block: int) -> np.ndarray:
    """conv_channel: silu(x * tap[K-1] + sum_j state[j] * tap[j]) from the old state."""
    mem.log(mem.conv_reads, channels, block)
    taps, window = mem.conv_weight[channels], mem.conv_state[channels]  # [n, K], [n, K-1]
    return _silu(mem.mixed[channels] * taps[:, -1] + (window * taps[:, :-1]).sum(axis=1))


def advance_conv_state(mem: Memory, channels: np.ndarray, block: int) -> None:
    mem.log(mem.conv_reads, channels, block)
    mem.log(mem.conv_writes, channels, block)
    mem.conv_state[channels] = np.concatenate([mem.conv_state[channels, 1:], mem.mixed[channels, None]], axis=1)


def thread_columns(y: int) -> tuple[np.ndarray, np.ndarray]:
    """(part, col) of each thread of block column y, as the kernel derives them."""
    tid = np.arange(THREADS)
    lane = tid % 32
    return lane // COLS_PER_WARP, y * COLS_PER_BLOCK + (tid // 32) * COLS_PER_WARP + lane % COLS_PER_WARP


def run_block(mem: Memory, d: Dims, h: int, y: int) -> None:
    """One block up to its arrival: conv, its state columns, its o written un-normalised."""
    block, hk = h * (d.dv // COLS_PER_BLOCK) + y, h // (d.hv // d.hk)
    qk = conv_channels(mem, qk_channels(d, hk), block)
    q, k = qk[: d.dk], qk[d.dk :]
    part, col = thread_columns(y)
    v_channel = 2 * d.hk * d.dk + h * d.dv + col  # [threads]
    v_thread = conv_channels(mem, v_channel, block)
    rows = part[:, None] + KEY_PARTS * np.arange(d.dk // KEY_PARTS)[None, :]  # [threads, Dk / parts]
    cols = np.unique(col)
    assert len(cols) == COLS_PER_BLOCK and (np.bincount(rows.ravel() * d.dv + np.repeat(col, rows.shape[1]),
                                                       minlength=d.dk * d.dv).reshape(d.dk, d.dv)[:, cols] == 1).all()
    advance_conv_state(mem, v_channel[part == 0], block)
    v = v_thread[part == 0][np.argsort(col[part == 0])]  # [cols]
    s = mem.state[h][:, cols].copy()  # [Dk, cols]
    q_hat = q / np.sqrt((q * q).sum() + 1e-6) / np.sqrt(d.dk)
    k_hat = k / np.sqrt((k * k).sum() + 1e-6)
    s *= np.exp(-np.exp(mem.A_log[h]) * np.logaddexp(0.0, mem.a[h] + mem.dt_bias[h]))
    beta = 1.0 / (1.0 + np.exp(-mem.b[h]))
    s += np.outer(k_hat, beta * (v - k_hat @ s))
    mem.state[h][:, cols] = s
    mem.state_writes[h][:, cols] += 1
    mem.out[h * d.dv + cols] = q_hat @ s


def finish_group(mem: Memory, d: Dims, hk: int, block: int, qk_state: bool = True) -> None:
    """The group's last block: its q/k conv state (unless the racy variant wrote it), the norm."""
    if qk_state:
        advance_conv_state(mem, qk_channels(d, hk), block)
    group = d.hv // d.hk
    for h in range(hk * group, (hk + 1) * group):
        row = slice(h * d.dv, (h + 1) * d.dv)
        x = mem.out[row]
        mem.out[row] = x / np.sqrt((x * x).mean() + mem.eps) * mem.norm_weight * _silu(mem.z[row])


def run_launch(mem: Memory, d: Dims, order: np.ndarray, racy: bool = False) -> None:
    """Blocks in `order` (block = h * (Dv / 32) + y), each to completion: one legal schedule.
    `racy`: q/k state written by the group's first block at once (the ownership to avoid)."""
    mem.state_writes = np.zeros(mem.state.shape, np.int32)
    per_head = d.dv // COLS_PER_BLOCK
    for block in order.tolist():
        h, y = divmod(block, per_head)
        hk = h // (d.hv // d.hk)
        run_block(mem, d, h, y)
        if racy and block == hk * d.group_blocks:
            advance_conv_state(mem, qk_channels(d, hk), block)
        mem.arrivals[hk] += 1
        if mem.arrivals[hk] == d.group_blocks:
            mem.arrivals[hk] = 0
            finish_group(mem, d, hk, block, qk_state=not racy)


def races(mem: Memory, d: Dims) -> list[str]:
    """Conv-state entries not written exactly once, or read by another block after the write."""
    found = []
    for c in range(d.channels):
        writes = mem.conv_writes.get(c, [])
        if len(writes) != 1:
            found.append(f"channel {c} written {len(writes)} times")
            continue
        (t_write, writer), = writes
        late = [blk for t, blk in mem.conv_reads.get(c, []) if t > t_write and blk != writer]
        if late:
            found.append(f"channel {c} read by block {late[0]} after block {writer} wrote it")
    return found


def _memory(d: Dims, rng: np.random.Generator) -> Memory:
    f = lambda *s, scale=1.0: (rng.standard_normal(s) * scale).astype(np.float32)  # noqa: E731
    return Memory(f(d.channels), f(d.hv * d.dv), f(d.hv), f(d.hv, scale=2), f(d.channels, d.width, scale=0.5),
                  f(d.channels, d.width - 1), np.log(rng.uniform(1, 16, d.hv)).astype(np.float32),
                  f(d.hv, scale=0.5), 1 + f(d.dv, scale=0.1), f(d.hv, d.dk, d.dv, scale=0.1),
                  np.full(d.hv * d.dv, np.nan, np.float32), np.zeros(d.hk, np.int64))


@pytest.mark.parametrize("model", MODELS)
def test_emulated_kernel_matches_the_three_ops_and_owns_each_state_entry_once(model: str, rng: np.random.Generator) -> None:
    d = Dims.of(model)
    mem = _memory(d, rng)
    ref = NumpyBackend()
    ref_conv, ref_state = mem.conv_state.copy(), mem.state.copy()
    blocks = d.hv * (d.dv // COLS_PER_BLOCK)
    for _ in range(3):  # several tokens in a row: states carried, counters back at zero each time
        mem.mixed, mem.z = rng.standard_normal(d.channels).astype(np.float32), rng.standard_normal(d.hv * d.dv).astype(np.float32)
        mem.a, mem.b = rng.standard_normal(d.hv).astype(np.float32), (2 * rng.standard_normal(d.hv)).astype(np.float32)
        mem.out[:] = np.nan
        mem.conv_reads, mem.conv_writes = {}, {}
        x = DeltaNetInputs(mem.mixed[None].copy(), mem.z.reshape(1, d.hv, d.dv).copy(), mem.a[None].copy(), mem.b[None].copy())
        layer = DeltaNetOperands(mem.conv_weight, mem.A_log, mem.dt_bias, mem.norm_weight, EPS, ref_conv, ref_state, d.hk)
        expected = ref.gated_delta_net(x, layer)  # [1, Hv, Dv]; updates ref_conv, ref_state
        run_launch(mem, d, rng.permutation(blocks))
        assert races(mem, d) == []
        assert (mem.state_writes == 1).all(), "a recurrent state entry not written exactly once"
        assert (mem.arrivals == 0).all(), "counters not reset for the next launch / graph replay"
        np.testing.assert_allclose(mem.out.reshape(1, d.hv, d.dv), expected, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(mem.conv_state, ref_conv, rtol=0, atol=0)
        np.testing.assert_allclose(mem.state, ref_state, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("model", MODELS)
def test_a_fixed_qk_state_owner_is_caught_as_a_race(model: str, rng: np.random.Generator) -> None:
    d = Dims.of(model)
    mem = _memory(d, rng)
    blocks = d.hv * (d.dv // COLS_PER_BLOCK)
    order = np.arange(blocks)  # each group's first block runs first: the others read after its write
    run_launch(mem, d, order, racy=True)
    found = races(mem, d)
    assert found and all("after block" in line for line in found)
    assert len(found) == d.hk * 2 * d.dk
