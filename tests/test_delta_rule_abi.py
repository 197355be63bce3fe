"""CPU check of the recurrent gated delta rule kernel (delta_rule.cuh gated_delta_rule: the default
decode and prefill form), no GPU needed.

The op wrapper's launch is recorded; a numpy emulation then runs each block of its grid through the
token loop as the kernel does: q, k of the key head staged in the shared buffers q_s / k_s (token t
in buffer t % kBuffers, one barrier per token), the per-warp L2 norms by the xor butterfly, each
thread's state rows part + kKeyParts * r of its column in kChains chains, the column's partial sums
meeting through the xor shuffles of column_sum. Every shared access is logged with its barrier
epoch. The emulation must equal the numpy backend's gated_delta_rule (output and state), write every
output and state entry once, read only entries written for its own token in an earlier epoch, and
have no two threads touch one shared entry in one epoch with a write among them. A single-buffered
loop (the race the double buffer avoids) and a column sum over the wrong lanes must fail it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pytest

from atlas.backends.cuda import ops_linear_moe as ops
from atlas.backends.numpy_backend import NumpyBackend

from _abi import MODELS, REPO, RecordingRuntime, header_constant
from _operands import delta_rule_operands
from test_delta_decode_abi import COLS_PER_BLOCK, COLS_PER_WARP, KEY_PARTS, THREADS, Dims

HEADER = (REPO / "kernels/include/atlas/delta_rule.cuh").read_text()
CHAINS = header_constant("delta_rule.cuh", "kChains")
BUFFERS = int(re.search(r"__shared__ float q_s\[(\d+)\]\[Dk\];", HEADER)[1])
L2_EPS = np.float32(1e-6)


@dataclass(frozen=True)
class Variant:
    """The kernel as written, or a mutation the checks must catch."""

    buffers: int = BUFFERS
    sum_offsets: tuple[int, ...] = tuple(COLS_PER_WARP << i for i in range(KEY_PARTS.bit_length() - 1))


@dataclass
class SharedLog:
    """q_s / k_s accesses as rows (epoch, thread, location); location = (buffer * 2 + array) * Dk + i."""

    writes: list[np.ndarray] = field(default_factory=list)
    reads: list[np.ndarray] = field(default_factory=list)
    version: dict[int, int] = field(default_factory=dict)  # location -> token last written
    stale: list[tuple[int, int]] = field(default_factory=list)  # (token, location) read before its write

    def access(self, kind: str, epoch: int, threads: np.ndarray, locations: np.ndarray) -> None:
        """threads [n] each touching locations [n, m]."""
        rows = np.stack(np.broadcast_arrays(epoch, threads[:, None], locations), axis=-1).reshape(-1, 3)
        (self.writes if kind == "write" else self.reads).append(rows)

    def races(self) -> list[tuple[int, int]]:
        """(epoch, location) where a thread wrote what another thread read or wrote in that epoch."""
        writes, reads = np.concatenate(self.writes), np.concatenate(self.reads)
        span = int(max(writes[:, 2].max(), reads[:, 2].max())) + 1
        keys = writes[:, 0] * span + writes[:, 2]
        order = np.argsort(keys, kind="stable")
        keys, writers = keys[order], writes[order, 1]
        found = set((keys[1:][(keys[1:] == keys[:-1]) & (writers[1:] != writers[:-1])]).tolist())
        read_keys = reads[:, 0] * span + reads[:, 2]
        at = np.clip(np.searchsorted(keys, read_keys), 0, len(keys) - 1)
        found |= set(read_keys[(keys[at] == read_keys) & (writers[at] != reads[:, 1])].tolist())
        return sorted((key // span, key % span) for key in found)


def butterfly(values: np.ndarray, offsets: tuple[int, ...]) -> np.ndarray:
    """__shfl_xor_sync sums over each warp of a block's [threads] values (thread ids xor offset)."""
    tid = np.arange(values.shape[0])
    for offset in offsets:
        values = values + values[tid ^ offset]
    return values


def inv_l2_norm(x_s: np.ndarray, dk: int) -> np.ndarray:
    """inv_l2_norm<Dk> in every thread: lane-strided squares, then the warp's butterfly."""
    lane = np.arange(THREADS) % 32
    squares = np.zeros(THREADS, np.float32)
    for i in range(0, dk, 32):
        index = i + lane
        inside = index < dk
        squares = np.where(inside, squares + x_s[np.minimum(index, dk - 1)] ** 2, squares)
    return (1.0 / np.sqrt(butterfly(squares, (16, 8, 4, 2, 1)) + L2_EPS)).astype(np.float32)


def chain_sum(terms: np.ndarray) -> np.ndarray:
    """[threads, rows] products -> kChains chains (row r in chain r % kChains), summed pairwise."""
    chains = [terms[:, c::CHAINS].sum(axis=1, dtype=np.float32) for c in range(CHAINS)]
    return (chains[0] + chains[1]) + (chains[2] + chains[3])


@dataclass
class Launch:
    mixed: np.ndarray  # [T, width]
    a: np.ndarray  # [T, Hv]
    b: np.ndarray  # [T, Hv]
    A_log: np.ndarray  # [Hv]
    dt_bias: np.ndarray  # [Hv]
    state: np.ndarray  # [Hv, Dk, Dv], in place
    out: np.ndarray  # [T, Hv, Dv]
    out_writes: np.ndarray  # [T, Hv, Dv]
    state_writes: np.ndarray  # [Hv, Dk, Dv]


def stage(x: Launch, d: Dims, h: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """load_inputs: q, k element threadIdx.x of the key head (threads < Dk)."""
    hk = h // (d.hv // d.hk)
    q = x.mixed[t, hk * d.dk : (hk + 1) * d.dk]
    k = x.mixed[t, d.hk * d.dk + hk * d.dk : d.hk * d.dk + (hk + 1) * d.dk]
    return q, k


def run_block(x: Launch, d: Dims, h: int, y: int, v: Variant, log: SharedLog | None) -> None:
    tid = np.arange(THREADS)
    lane, part = tid % 32, (tid % 32) // COLS_PER_WARP
    col = y * COLS_PER_BLOCK + (tid // 32) * COLS_PER_WARP + lane % COLS_PER_WARP
    rows = part[:, None] + KEY_PARTS * np.arange(d.dk // KEY_PARTS)[None, :]  # [threads, kRows]
    s = x.state[h][rows, col[:, None]].copy()  # [threads, kRows]
    shared = np.full((v.buffers, 2, d.dk), np.nan, np.float32)
    writers = tid[tid < d.dk]
    neg_a = -np.exp(x.A_log[h])
    for t in range(x.mixed.shape[0]):
        buf = t % v.buffers
        shared[buf, 0, writers], shared[buf, 1, writers] = stage(x, d, h, t)
        if log is not None:
            buffer_locs = (buf * 2 + np.arange(2)) * d.dk  # q, k
            log.access("write", t, writers, buffer_locs[None, :] + writers[:, None])
            log.version.update((loc, t) for loc in (buffer_locs[None, :] + writers[:, None]).ravel().tolist())
            # after token t's barrier (epoch t + 1) every warp's norm reads all Dk of both arrays
            everything = np.arange(buf * 2 * d.dk, (buf * 2 + 2) * d.dk)
            log.access("read", t + 1, tid, np.broadcast_to(everything, (THREADS, everything.size)))
            log.stale.extend((t, loc) for loc in everything.tolist() if log.version.get(loc) != t)
        q, k = shared[buf, 0], shared[buf, 1]
        q_scale = inv_l2_norm(q, d.dk) / np.sqrt(np.float32(d.dk))
        k_scale = inv_l2_norm(k, d.dk)
        decay = np.exp(neg_a * np.logaddexp(np.float32(0), x.a[t, h] + x.dt_bias[h]))
        beta = 1 / (1 + np.exp(-x.b[t, h]))
        value = x.mixed[t, 2 * d.hk * d.dk + h * d.dv + col]  # [threads]
        s *= decay
        kv = butterfly(chain_sum(s * k[rows]), v.sum_offsets) * k_scale
        delta = beta * (value - kv) * k_scale
        s += k[rows] * delta[:, None]
        o = butterfly(chain_sum(s * q[rows]), v.sum_offsets) * q_scale
        mine = part == 0
        x.out[t, h, col[mine]] = o[mine]
        x.out_writes[t, h, col[mine]] += 1
    x.state[h][rows, col[:, None]] = s
    np.add.at(x.state_writes[h], (rows, np.broadcast_to(col[:, None], rows.shape)), 1)


def recorded_grid(d: Dims, tokens: int) -> tuple[int, int, int]:
    rt = RecordingRuntime()
    f = lambda *s: rt.empty(s, "f32")  # noqa: E731
    ops.gated_delta_rule(rt, f(tokens, d.channels), f(tokens, d.hv), f(tokens, d.hv),
                         delta_rule_operands(f(d.hv), f(d.hv), f(d.hv, d.dk, d.dv), d.hk), chunked=False)
    (launch,) = rt.launches
    assert launch.kernel == "atlas_gated_delta_rule" and launch.block == (THREADS, 1, 1)
    p = launch.params
    assert (p.num_tokens, p.num_k_heads, p.num_v_heads, p.k_head_dim, p.v_head_dim) == (tokens, d.hk, d.hv, d.dk, d.dv)
    return launch.grid


@dataclass
class Case:
    d: Dims
    mixed: np.ndarray
    a: np.ndarray
    b: np.ndarray
    A_log: np.ndarray
    dt_bias: np.ndarray
    state: np.ndarray

    @classmethod
    def draw(cls, rng: np.random.Generator, d: Dims, tokens: int) -> Case:
        n = lambda *s, scale=1.0: (rng.standard_normal(s) * scale).astype(np.float32)  # noqa: E731
        return cls(d, n(tokens, d.channels), n(tokens, d.hv), n(tokens, d.hv, scale=2),
                   np.log(rng.uniform(1, 16, d.hv)).astype(np.float32), n(d.hv, scale=0.5), n(d.hv, d.dk, d.dv, scale=0.1))

    def emulate(self, variant: Variant) -> tuple[Launch, SharedLog]:
        d, tokens = self.d, self.mixed.shape[0]
        x = Launch(self.mixed, self.a, self.b, self.A_log, self.dt_bias, self.state.copy(),
                   np.full((tokens, d.hv, d.dv), np.nan, np.float32), np.zeros((tokens, d.hv, d.dv), int),
                   np.zeros(self.state.shape, int))
        grid = recorded_grid(d, tokens)
        assert grid == (d.hv, d.dv // COLS_PER_BLOCK, 1)
        log = SharedLog()
        for h in range(grid[0]):
            for y in range(grid[1]):
                run_block(x, d, h, y, variant, log if h == 0 and y == 0 else None)
        return x, log

    def reference(self) -> tuple[np.ndarray, np.ndarray]:
        state = self.state.copy()
        out = NumpyBackend().gated_delta_rule(self.mixed, self.a, self.b,
                                              delta_rule_operands(self.A_log, self.dt_bias, state, self.d.hk))
        return out, state


@pytest.mark.parametrize("model", MODELS)
def test_the_token_loop_equals_the_reference_without_races(model: str, rng: np.random.Generator) -> None:
    d = Dims.of(model)
    for tokens in (1, 3):
        case = Case.draw(rng, d, tokens)
        got, log = case.emulate(Variant())
        want, want_state = case.reference()
        assert (got.out_writes == 1).all() and (got.state_writes == 1).all()
        np.testing.assert_allclose(got.out, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
        np.testing.assert_allclose(got.state, want_state, rtol=1e-4, atol=1e-5 * np.abs(want_state).max())
        assert log.races() == [] and log.stale == []


def test_the_checks_catch_a_single_buffer_and_a_wrong_column_sum(rng: np.random.Generator) -> None:
    case = Case.draw(rng, Dims(2, 4, 64, 64, 4), 3)
    _, log = case.emulate(Variant(buffers=1))
    assert log.races(), "a single q_s / k_s buffer is rewritten while other warps still read it"
    got, _ = case.emulate(Variant(sum_offsets=(1, 2)))
    want, _ = case.reference()
    assert not np.allclose(got.out, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
