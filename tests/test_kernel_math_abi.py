"""CPU emulations of kernel arithmetic and index math (no GPU needed).

Each test re-states, in numpy, what a kernel computes, in the kernel's own order (its tiles,
splits, rounding recipe), and compares it with the float32 reference backend, so a wrong
recipe or tiling shows up here before the device runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from atlas.backends.numpy_backend import DeltaInputs, delta_rule_recurrent, rope_cos_sin


def rope_angles_as_kernel(positions: np.ndarray, rotary_dim: int, theta: float) -> np.ndarray:
    """rope.cuh: exponent = f32(2i) / f32(R); power = f32(pow(double theta, double exponent));
    angle = f32(position) * (1 / power), each step rounded to float32."""
    i = np.arange(rotary_dim // 2)
    exponent = (2 * i).astype(np.float32) / np.float32(rotary_dim)  # [R/2]
    power = np.power(np.float64(np.float32(theta)), exponent.astype(np.float64)).astype(np.float32)
    inv_freq = np.float32(1.0) / power  # [R/2]
    return positions.astype(np.float32)[:, None] * inv_freq[None, :]  # [T, R/2]


def test_rope_angle_recipe_matches_the_reference_bit_for_bit(rng: np.random.Generator) -> None:
    positions = np.concatenate([rng.integers(0, 262_144, size=200), [0, 1, 262_143]]).astype(np.int32)
    for rotary_dim, theta in ((64, 10_000_000.0), (16, 10_000.0), (128, 1_000_000.0)):
        angles = rope_angles_as_kernel(positions, rotary_dim, theta)  # [T, R/2]
        cos, sin = rope_cos_sin(positions, rotary_dim, theta)  # [T, R]
        want = np.cos(np.concatenate([angles, angles], axis=-1))
        np.testing.assert_array_equal(cos, want)
        exact = positions.astype(np.float64)[:, None] * theta ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
        # the f32 recipe is not the exact angle: the kernel must not "improve" on it
        assert np.abs(angles.astype(np.float64) - exact).max() > 1e-4
        assert sin.shape == cos.shape


def test_rope_angle_recipe_matches_transformers(rng: np.random.Generator) -> None:
    torch = __import__("pytest").importorskip("torch")
    positions = rng.integers(0, 262_144, size=300).astype(np.int32)
    for rotary_dim, theta in ((64, 10_000_000.0), (16, 10_000.0)):
        # transformers' default rope init and forward (float32 throughout)
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        freqs = inv_freq[:, None].float() @ torch.from_numpy(positions)[None, :].float()  # [R/2, T]
        np.testing.assert_array_equal(rope_angles_as_kernel(positions, rotary_dim, theta), freqs.T.numpy())


# --- delta_chunked.cuh: chunk_prep + chunk_scan ---------------------------------------------------
CHUNK = 64


@dataclass
class ChunkScratch:
    """The kernels' flat f32 scratch; (head, chunk) block index h * chunks + n, as chunk_index()."""

    chunks: int
    w: np.ndarray  # [Hv * chunks * C * Dk]
    u: np.ndarray  # [Hv * chunks * C * Dv]
    q_decayed: np.ndarray
    k_to_end: np.ndarray
    intra: np.ndarray  # [Hv * chunks * C * C]
    chunk_decay: np.ndarray  # [Hv * chunks]


def _chunk_rows(x: DeltaInputs, h: int, t0: int) -> tuple[np.ndarray, ...]:
    """prep_rows: the chunk's q, k, v rows, g and beta of head h, zeros past T."""
    tokens = x.q.shape[1]
    valid = np.arange(t0, t0 + CHUNK) < tokens  # [C]
    take = np.minimum(np.arange(t0, t0 + CHUNK), tokens - 1)
    rows = [np.where(valid[:, None], t[h, take], 0).astype(np.float32) for t in (x.q, x.k, x.v)]
    g, beta = (np.where(valid, t[h, take], 0).astype(np.float32) for t in (x.g, x.beta))
    return (*rows, g, beta)


def emulate_chunk_prep(x: DeltaInputs) -> ChunkScratch:
    heads, tokens, dk = x.q.shape
    dv = x.v.shape[2]
    chunks = -(-tokens // CHUNK)
    s = ChunkScratch(chunks, *(np.full(heads * chunks * CHUNK * n, np.nan, np.float32) for n in (dk, dv, dk, dk, CHUNK)),
                     np.full(heads * chunks, np.nan, np.float32))
    lower = np.tril(np.ones((CHUNK, CHUNK), dtype=bool), -1)
    for h in range(heads):
        for n in range(chunks):
            q, k, v, g, beta = _chunk_rows(x, h, n * CHUNK)
            cum = np.cumsum(g, dtype=np.float32)  # [C], sequential like the kernel's thread 0
            decay = np.exp(np.minimum(cum[:, None] - cum[None, :], 0))  # masked below, never overflows
            a = np.where(lower, beta[:, None] * (k @ k.T) * decay, 0)  # [C, C]
            intra = np.where(lower | np.eye(CHUNK, dtype=bool), (q @ k.T) * decay, 0)
            rhs = np.concatenate([v * beta[:, None], k * (beta * np.exp(cum))[:, None]], axis=1)  # [C, Dv + Dk]
            x_rows = np.zeros_like(rhs)
            for r in range(CHUNK):  # prep_solve: forward substitution, every column at once
                x_rows[r] = rhs[r] - a[r, :r] @ x_rows[:r]
            at = h * chunks + n
            s.u[at * CHUNK * dv:(at + 1) * CHUNK * dv] = x_rows[:, :dv].ravel()
            s.w[at * CHUNK * dk:(at + 1) * CHUNK * dk] = x_rows[:, dv:].ravel()
            s.q_decayed[at * CHUNK * dk:(at + 1) * CHUNK * dk] = (q * np.exp(cum)[:, None]).ravel()
            s.k_to_end[at * CHUNK * dk:(at + 1) * CHUNK * dk] = (k * np.exp(cum[-1] - cum)[:, None]).ravel()
            s.intra[at * CHUNK * CHUNK:(at + 1) * CHUNK * CHUNK] = intra.ravel()
            s.chunk_decay[at] = np.exp(cum[-1])
    return s


def emulate_chunk_scan(s: ChunkScratch, state: np.ndarray, tokens: int) -> np.ndarray:
    """chunk_scan over the flat scratch; state [Hv, Dk, Dv] updated in place -> out [T, Hv, Dv]."""
    heads, dk, dv = state.shape
    out = np.full((tokens, heads, dv), np.nan, np.float32)
    tile = lambda buf, at, width: buf[at * CHUNK * width:(at + 1) * CHUNK * width].reshape(CHUNK, width)  # noqa: E731
    for h in range(heads):
        for n in range(s.chunks):
            at, t0 = h * s.chunks + n, n * CHUNK
            v_new = tile(s.u, at, dv) - tile(s.w, at, dk) @ state[h]  # [C, Dv]
            chunk_out = tile(s.q_decayed, at, dk) @ state[h] + tile(s.intra, at, CHUNK) @ v_new
            live = min(CHUNK, tokens - t0)
            out[t0:t0 + live, h] = chunk_out[:live]
            state[h] = state[h] * s.chunk_decay[at] + tile(s.k_to_end, at, dk).T @ v_new
    return out


def _delta_inputs(rng: np.random.Generator, heads: int, tokens: int, dk: int, dv: int) -> DeltaInputs:
    def unit(*shape: int) -> np.ndarray:
        x = rng.standard_normal(shape).astype(np.float32)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    g = -np.exp(rng.uniform(-1, 2.5, (heads, 1))) * np.log1p(np.exp(rng.standard_normal((heads, tokens))))
    beta = 1 / (1 + np.exp(-2 * rng.standard_normal((heads, tokens))))
    return DeltaInputs(unit(heads, tokens, dk) * np.float32(dk**-0.5), unit(heads, tokens, dk),
                       rng.standard_normal((heads, tokens, dv)).astype(np.float32), g.astype(np.float32),
                       beta.astype(np.float32))


def test_chunked_delta_kernels_equal_the_recurrent_rule(rng: np.random.Generator) -> None:
    heads, dk, dv = 3, 32, 16
    for tokens in (2, 63, 64, 65, int(rng.integers(130, 260))):
        x = _delta_inputs(rng, heads, tokens, dk, dv)
        state0 = (rng.standard_normal((heads, dk, dv)) * 0.3).astype(np.float32)
        want_state = state0.copy()
        want = delta_rule_recurrent(x, want_state).transpose(1, 0, 2)  # [T, Hv, Dv]
        got_state = state0.copy()
        got = emulate_chunk_scan(emulate_chunk_prep(x), got_state, tokens)
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
        np.testing.assert_allclose(got_state, want_state, rtol=2e-4, atol=2e-4 * np.abs(want_state).max())


def test_chunk_prep_never_overflows_on_fast_decay(rng: np.random.Generator) -> None:
    x = _delta_inputs(rng, 1, 100, 32, 16)
    x = DeltaInputs(x.q, x.k, x.v, np.full_like(x.g, -300.0), x.beta)  # cum reaches -19200 in a chunk
    state = rng.standard_normal((1, 32, 16)).astype(np.float32)
    want_state = state.copy()
    want = delta_rule_recurrent(x, want_state).transpose(1, 0, 2)
    with np.errstate(over="raise", invalid="raise"):
        got = emulate_chunk_scan(emulate_chunk_prep(x), state, 100)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
