"""CPU emulations of kernel arithmetic and index math (no GPU needed).

Each test re-states, in numpy, what a kernel computes, in the kernel's own order (its tiles,
splits, rounding recipe), and compares it with the float32 reference backend, so a wrong
recipe or tiling shows up here before the device runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from atlas.backends.base import KVCache, SamplingParams
from atlas.backends.numpy_backend import DeltaInputs, NumpyBackend, delta_rule_recurrent, rope_cos_sin
from atlas.layers.rotary import default_inv_freq
from atlas.sampling import choose_token, draw_uniform


def rope_angles_as_kernel(positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """rope.cuh: angle = f32(position) * inv_freq[i], rounded to float32."""
    return positions.astype(np.float32)[:, None] * inv_freq[None, :]  # [T, R/2]


def test_rope_angle_recipe_matches_the_reference_bit_for_bit(rng: np.random.Generator) -> None:
    positions = np.concatenate([rng.integers(0, 262_144, size=200), [0, 1, 262_143]]).astype(np.int32)
    for rotary_dim, theta in ((64, 10_000_000.0), (16, 10_000.0), (128, 1_000_000.0)):
        inv_freq = default_inv_freq(rotary_dim, theta)  # [R/2]
        angles = rope_angles_as_kernel(positions, inv_freq)  # [T, R/2]
        scaling = float(rng.uniform(1.0, 1.5))
        cos, sin = rope_cos_sin(positions, inv_freq, scaling)  # [T, R]
        want = np.cos(np.concatenate([angles, angles], axis=-1)) * np.float32(scaling)
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
        np.testing.assert_array_equal(default_inv_freq(rotary_dim, theta), inv_freq.numpy())
        freqs = inv_freq[:, None].float() @ torch.from_numpy(positions)[None, :].float()  # [R/2, T]
        np.testing.assert_array_equal(rope_angles_as_kernel(positions, default_inv_freq(rotary_dim, theta)), freqs.T.numpy())


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


# --- attention.cuh: split-K blocks, 32-key tiles, online softmax, combine -------------------------
ATTN_KEYS = 32


def _attention_block(q: np.ndarray, keys: np.ndarray, values: np.ndarray, positions: np.ndarray,
                     block: tuple[int, int, int, int], shape: tuple[int, int, int]) -> dict[int, tuple]:
    """attention_block for block (split x, kv head y, row tile z) of `splits` splits with W*R rows:
    {q head row token*Hq+head: (out, m, l)} for the rows it stores."""
    x, y, z, splits = block
    rows_per_block, capacity, dim = shape
    tokens, q_heads, _ = q.shape
    group = q_heads // keys.shape[1]
    live = max(min(int(positions[-1]) + 1, capacity), 0)
    span = ATTN_KEYS * max(-(-live // (ATTN_KEYS * splits)), 1)
    key_begin, row0 = x * span, z * rows_per_block
    if key_begin >= live or row0 >= tokens * group:
        return {}
    last_token = min((row0 + rows_per_block - 1) // group, tokens - 1)
    key_end = min(key_begin + span, int(positions[last_token]) + 1, live)
    stored = {}
    for row in range(row0, min(row0 + rows_per_block, tokens * group)):
        token, head = row // group, y * group + row % group
        m, l, acc = -np.inf, 0.0, np.zeros(dim)
        for key0 in range(key_begin, key_end, ATTN_KEYS):
            key = np.arange(key0, key0 + ATTN_KEYS)
            visible = (key < key_end) & (key <= positions[token])
            dots = keys[np.minimum(key, capacity - 1), y] @ (q[token, head] / np.sqrt(dim))
            score = np.where(visible, dots, -np.inf)
            m_new = max(m, score.max())
            if m_new == -np.inf:
                continue
            prob, alpha = np.exp(score - m_new), np.exp(m - m_new)
            l, m = l * alpha + prob.sum(), m_new
            acc = acc * alpha + prob @ np.where(visible[:, None], values[np.minimum(key, capacity - 1), y], 0)
        stored[token * q_heads + head] = (acc / l if l > 0 else acc * 0, m, l)
    return stored


def emulate_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """ops_dense.attention's launches (decode: splits from the capacity + combine; prefill: one split)."""
    tokens, q_heads, dim = q.shape
    capacity, kv_heads, _ = k_cache.shape
    decode = tokens <= 4
    splits = min(-(-capacity // ATTN_KEYS), 256) if decode else 1
    rows_per_block = 4 if decode else 16
    tiles = -(-tokens * (q_heads // kv_heads) // rows_per_block)
    partial: dict[tuple[int, int], tuple] = {}
    for x in range(splits):
        for y in range(kv_heads):
            for z in range(tiles):
                block = _attention_block(q, k_cache, v_cache, positions, (x, y, z, splits),
                                         (rows_per_block, capacity, dim))
                partial.update({(x, row): stored for row, stored in block.items()})
    live = max(min(int(positions[-1]) + 1, capacity), 0)
    span = ATTN_KEYS * max(-(-live // (ATTN_KEYS * splits)), 1)
    live_splits = min(-(-live // span), splits)  # attention_combine reads only these
    out = np.zeros((tokens * q_heads, dim))
    for row in range(tokens * q_heads):
        parts = [partial[(s, row)] for s in range(live_splits)]  # KeyError: a split left a row unwritten
        m_max = max(m for _, m, _ in parts)
        weights = [np.exp(m - m_max) * l if m != -np.inf else 0.0 for _, m, l in parts]
        out[row] = sum(w * o for w, (o, _, _) in zip(weights, parts)) / sum(weights)
    return out.reshape(tokens, q_heads, dim)


def test_attention_split_tiling_equals_the_reference(rng: np.random.Generator) -> None:
    q_heads, kv_heads, dim = 4, 2, 8
    for tokens, capacity in ((1, 1024), (3, 100), (4, 4096), (5, 300), (37, 200)):
        start = int(rng.integers(0, capacity - tokens + 1))
        positions = np.arange(start, start + tokens, dtype=np.int32)
        q = rng.standard_normal((tokens, q_heads, dim)).astype(np.float32)
        k, v = (rng.standard_normal((tokens, kv_heads, dim)).astype(np.float32) for _ in range(2))
        k_cache, v_cache = (rng.standard_normal((capacity, kv_heads, dim)).astype(np.float32) for _ in range(2))
        want = NumpyBackend().attention(q, k, v, KVCache(k_cache, v_cache), positions, dim**-0.5)  # writes the caches
        got = emulate_attention(q, k_cache, v_cache, positions)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"T={tokens} S={capacity} start={start}")


# --- moe.cuh: moe_route + grouped GEMM tiles (gate/up row interleave) + combine --------------------
BM, BN = 64, 64


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def emulate_moe_route(ids: np.ndarray, experts: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """counts [E], offsets [E+1], perm: slot ids grouped by expert, in an arbitrary (atomic) order."""
    flat = ids.ravel()
    valid = (flat >= 0) & (flat < experts)
    counts = np.bincount(flat[valid], minlength=experts)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    perm = np.full(flat.size, -1)
    for e in range(experts):
        slots = np.nonzero(flat == e)[0]
        perm[offsets[e]:offsets[e + 1]] = rng.permutation(slots)
    return counts, offsets, perm


def _b_tile_rows(n0: int, n_out: int, gate_up: bool) -> tuple[np.ndarray, np.ndarray]:
    """b_tile_column: weight row (within the expert) of each B smem row, and whether it is in range."""
    r = np.arange(BN)
    if not gate_up:
        return n0 + r, n0 + r < n_out
    col = n0 + (r // 32) * 16 + r % 16
    return col + np.where(r % 32 >= 16, n_out, 0), col < n_out


@dataclass(frozen=True)
class GroupedCall:
    a: np.ndarray  # [rows, K]
    weight: np.ndarray  # [E, N or 2N, K]
    route: tuple[np.ndarray, ...]
    top_k: int
    gate_up: bool
    route_weights: np.ndarray  # [T, k]


def _store_tile(c: GroupedCall, out: np.ndarray, tile: tuple[int, int, int], slot: np.ndarray, acc: np.ndarray) -> None:
    """store_tile: gate_up rows to the expert-major act rows (warp column half wn: gate cols, then
    up cols); down rows to y[slot] scaled by the routing weight."""
    e, m0, n0 = tile
    n_out = out.shape[1]
    offsets = c.route[1]
    for r in np.nonzero(slot >= 0)[0]:
        if c.gate_up:
            for wn in range(2):
                cols = n0 + wn * 16 + np.arange(16)
                act = _silu(acc[r, wn * 32:wn * 32 + 16]) * acc[r, wn * 32 + 16:wn * 32 + 32]
                out[offsets[e] + m0 + r, cols[cols < n_out]] = act[cols < n_out]
        else:
            cols = n0 + np.arange(BN)
            out[slot[r], cols[cols < n_out]] = c.route_weights.ravel()[slot[r]] * acc[r, cols < n_out]


def emulate_grouped_gemm(c: GroupedCall, out: np.ndarray) -> None:
    counts, offsets, perm = c.route
    n_out = out.shape[1]
    width = BN // 2 if c.gate_up else BN
    m_tiles = -(-(len(perm) // c.top_k) // BM)  # grid y = ceil(T / BM)
    for n0 in range(0, n_out, width):
        w_rows, in_range = _b_tile_rows(n0, n_out, c.gate_up)
        for e in range(c.weight.shape[0]):
            b_tile = np.where(in_range[:, None], c.weight[e][np.where(in_range, w_rows, 0)], 0)  # [BN, K]
            for by in range(m_tiles):
                for m0 in range(by * BM, counts[e], m_tiles * BM):
                    m = np.arange(m0, m0 + BM)
                    slot = np.where(m < counts[e], perm[offsets[e] + np.minimum(m, counts[e] - 1)], -1)
                    a_row = np.where(slot < 0, -1, slot // c.top_k if c.gate_up else offsets[e] + m)
                    acc = np.where(a_row[:, None] >= 0, c.a[np.maximum(a_row, 0)], 0) @ b_tile.T  # [BM, BN]
                    _store_tile(c, out, (e, m0, n0), slot, acc)


def test_grouped_moe_tiling_equals_the_reference(rng: np.random.Generator) -> None:
    experts, top_k, hidden, inter = 6, 3, 48, 40  # n_out not a multiple of the tiles
    tokens = 150  # the hot expert 2 serves every token: three M tiles
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    gate_up = (rng.standard_normal((experts, 2 * inter, hidden)) / np.sqrt(hidden)).astype(np.float32)
    down = (rng.standard_normal((experts, hidden, inter)) / np.sqrt(inter)).astype(np.float32)
    others = [e for e in range(experts) if e != 2]
    ids = np.array([[2, *rng.permutation(others)[: top_k - 1]] for _ in range(tokens)], dtype=np.int32)
    spare = next(e for e in others if e not in ids[7])
    ids[7, 1] = -1  # an invalid slot contributes nothing
    weights = rng.uniform(0.1, 1, (tokens, top_k)).astype(np.float32)
    route = emulate_moe_route(ids, experts, rng)
    act = np.full((tokens * top_k, inter), np.nan)
    emulate_grouped_gemm(GroupedCall(x, gate_up, route, top_k, True, weights), act)
    y = np.zeros((tokens * top_k, hidden))  # zeroed by the wrapper
    emulate_grouped_gemm(GroupedCall(act, down, route, top_k, False, weights), y)
    got = y.reshape(tokens, top_k, hidden).sum(axis=1)  # moe_combine, slot order
    ref_ids, ref_weights = ids.copy(), weights.copy()
    ref_ids[7, 1], ref_weights[7, 1] = spare, 0.0  # the reference: an unused expert with weight 0
    want = NumpyBackend().moe_experts(x, ref_ids, ref_weights, gate_up, down)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# --- gemm.cuh / moe.cuh: mma.sync m16n8k16 and ldmatrix fragments (PTX ISA layouts) --------------
LANES = np.arange(32)
GROUP, IN_GROUP = LANES // 4, LANES % 4  # groupID, threadID_in_group


def ldmatrix_x4(tile: np.ndarray, address: Callable[[int], tuple[int, int]]) -> np.ndarray:
    """ldmatrix.m8n8.x4.b16: lanes 8i..8i+7 give the row starts of matrix i; every lane receives
    row lane/4, columns 2*(lane%4) + {0, 1} of each matrix. -> [4 regs, 32 lanes, 2]."""
    regs = np.empty((4, 32, 2), tile.dtype)
    for i in range(4):
        for lane in LANES:
            row, col = address(8 * i + GROUP[lane])
            regs[i, lane] = tile[row, col + 2 * IN_GROUP[lane]:col + 2 * IN_GROUP[lane] + 2]
    return regs


def mma_16816(acc: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """acc [32, 4] += A @ B from fragments a [4, 32, 2] (A 16x16 row-major), b [2, 32, 2] (B 16x8)."""
    a_mat, b_mat = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in LANES:
        g, c = GROUP[lane], 2 * IN_GROUP[lane]
        a_mat[g, c:c + 2], a_mat[g + 8, c:c + 2] = a[0, lane], a[1, lane]
        a_mat[g, c + 8:c + 10], a_mat[g + 8, c + 8:c + 10] = a[2, lane], a[3, lane]
        b_mat[c:c + 2, g], b_mat[c + 8:c + 10, g] = b[0, lane], b[1, lane]
    d = a_mat @ b_mat
    for lane in LANES:
        g, c = GROUP[lane], 2 * IN_GROUP[lane]
        acc[lane] += [d[g, c], d[g, c + 1], d[g + 8, c], d[g + 8, c + 1]]


def test_gemm_fragments_compute_x_times_w_transposed(rng: np.random.Generator) -> None:
    """gemm_compute's ldmatrix addresses and gemm_store_out's (row, col) for one 64x128x32 tile."""
    bm, bn, bk = 64, 128, 32
    a_s, b_s = rng.standard_normal((bm, bk + 8)), rng.standard_normal((bn, bk + 8))  # padded rows
    out = np.full((bm, bn), np.nan)
    for warp in range(4):
        warp_m, warp_n = warp // 2, warp % 2
        acc = np.zeros((2, 8, 32, 4))
        for ks in (0, 16):
            af = [ldmatrix_x4(a_s, lambda l, mt=mt: (warp_m * 32 + mt * 16 + l % 16, ks + (l // 16) * 8))
                  for mt in range(2)]
            for np_ in range(4):
                bf = ldmatrix_x4(b_s, lambda l: (warp_n * 64 + np_ * 16 + l % 8 + (l // 16) * 8, ks + ((l // 8) % 2) * 8))
                for mt in range(2):
                    mma_16816(acc[mt, 2 * np_], af[mt], bf[:2])
                    mma_16816(acc[mt, 2 * np_ + 1], af[mt], bf[2:])
        for mt in range(2):
            for nt in range(8):
                for e in range(4):
                    rows = warp_m * 32 + mt * 16 + LANES // 4 + (e // 2) * 8
                    cols = warp_n * 64 + nt * 8 + (LANES % 4) * 2 + e % 2
                    out[rows, cols] = acc[mt, nt, :, e]
    np.testing.assert_allclose(out, a_s[:, :bk] @ b_s[:, :bk].T, rtol=1e-10, atol=1e-10)


def test_grouped_moe_fragments_compute_a_times_b_transposed(rng: np.random.Generator) -> None:
    """moe.cuh mma_tile's smem_word fragment loads and store_tile's (row, col) for a 64x64x32 tile."""
    a_s, b_s = rng.standard_normal((64, 40)), rng.standard_normal((64, 40))
    word = lambda tile, rows, cols: np.stack([tile[rows, cols], tile[rows, cols + 1]], -1)  # noqa: E731
    out = np.full((64, 64), np.nan)
    for warp in range(4):
        row0, col0, k_lane = (warp // 2) * 32 + LANES // 4, (warp % 2) * 32 + LANES // 4, (LANES % 4) * 2
        acc = np.zeros((2, 4, 32, 4))
        for kk in (0, 16):
            a = [np.stack([word(a_s, row0 + mi * 16 + dr, kk + k_lane + dc) for dr, dc in ((0, 0), (8, 0), (0, 8), (8, 8))])
                 for mi in range(2)]
            b = [np.stack([word(b_s, col0 + nj * 8, kk + k_lane + dc) for dc in (0, 8)]) for nj in range(4)]
            for mi in range(2):
                for nj in range(4):
                    mma_16816(acc[mi, nj], a[mi], b[nj])
        for mi in range(2):
            for half in range(2):
                rows = (warp // 2) * 32 + mi * 16 + half * 8 + LANES // 4
                for nj in range(4):
                    for q in range(2):
                        out[rows, (warp % 2) * 32 + nj * 8 + (LANES % 4) * 2 + q] = acc[mi, nj, :, half * 2 + q]
    np.testing.assert_allclose(out, a_s[:, :32] @ b_s[:, :32].T, rtol=1e-10, atol=1e-10)


def test_attention_transpose_reduce_gives_lane_j_the_total_of_key_j(rng: np.random.Generator) -> None:
    """transpose_reduce: 5 butterfly stages (Width 16..1) over part[lane][32 keys]."""
    part = rng.standard_normal((32, 32))  # [lane, key] partial dot products
    values = part.copy()
    for width in (16, 8, 4, 2, 1):
        upper = (LANES & width) != 0  # [32]
        send = np.where(upper[:, None], values[:, :width], values[:, width:2 * width])
        keep = np.where(upper[:, None], values[:, width:2 * width], values[:, :width])
        values = keep + send[LANES ^ width]  # __shfl_xor_sync(send, width)
    np.testing.assert_allclose(values[:, 0], part.sum(axis=0), rtol=1e-12)


# --- sampling.cuh: sort-free sample (bisection over float bit patterns) ---------------------------
def _tally(probs: np.ndarray, threshold: float, floor: float, mass: bool) -> float:
    kept = probs[(probs >= threshold) & (probs >= floor)]
    return float(kept.astype(np.float64).sum()) if mass else float(kept.size)


def _bisect(probs: np.ndarray, goal: float, floor: float, mass: bool, pmax: np.float32) -> float:
    """sample_bisect: the largest float t in [0, pmax] with tally(t) >= goal."""
    lo, hi = 0, int(pmax.view(np.uint32)) + 1
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        if _tally(probs, float(np.uint32(mid).view(np.float32)), floor, mass) >= goal:
            lo = mid
        else:
            hi = mid
    return float(np.uint32(lo).view(np.float32))


def sample_probs(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.float32]:
    """sample_softmax: probs [V] f32 and the largest p."""
    temperature = np.float32(params.temperature)  # SampleParams.temperature is f32
    temperature = temperature if temperature > np.finfo(np.float32).tiny else np.finfo(np.float32).tiny
    z = np.where(np.isnan(logits), np.float32(-np.inf), logits)  # sample_logit
    zmax = z.max()
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.where(z == zmax, np.float32(1), np.exp((z - zmax) / temperature)).astype(np.float32)
    total = e.sum(dtype=np.float32)
    return (e / total).astype(np.float32), np.float32(1) / total


SAMPLE_THREADS = 1024  # sampling.cuh kSampleThreads
SAMPLE_CANDIDATES = 4096  # kSampleCandidates
TOP_P_BOUND_RANK = 896  # kTopPBoundRank


def kth_thread_max(probs: np.ndarray, k: int) -> float:
    """block_kth_largest over the threads' own largest p (a thread without entries reports 0)."""
    maxima = np.zeros(SAMPLE_THREADS, dtype=np.float32)
    np.maximum.at(maxima, np.arange(probs.size) % SAMPLE_THREADS, probs)
    return float(np.sort(maxima)[::-1][k - 1])


def emulate_fast_sample(logits: np.ndarray, params: SamplingParams, uniform: float) -> int | None:
    """sample's fast path (None where the full path runs): the bound from the threads' own largest
    p and min_p, or for top_p alone a guessed bound the candidates' mass must confirm; the entries
    >= it in index order, the same bisections and draw over them alone."""
    probs, pmax = sample_probs(logits, params)
    by_k = 0 < params.top_k < probs.size and params.top_k <= SAMPLE_THREADS
    certain = by_k or params.min_p > 0
    top_p = np.float32(params.top_p)
    if not certain and not top_p < 1.0:
        return None
    bound = float(np.float32(params.min_p) * pmax) if params.min_p > 0 else 0.0
    if by_k:
        bound = max(bound, kth_thread_max(probs, params.top_k))
    if not certain:
        bound = kth_thread_max(probs, TOP_P_BOUND_RANK)
    kept_index = np.nonzero(probs >= bound)[0]
    if kept_index.size > SAMPLE_CANDIDATES:
        return None
    candidates = probs[kept_index]
    row_mass = _tally(probs, 0.0, 0.0, True)
    if not certain and _tally(candidates, 0.0, 0.0, True) < float(top_p) * row_mass:
        return None
    floor = 0.0
    if by_k and kept_index.size >= params.top_k:
        floor = _bisect(candidates, float(params.top_k), 0.0, False, pmax)
    if params.min_p > 0:
        floor = max(floor, float(np.float32(params.min_p) * pmax))
    if top_p < 1.0:
        kept = _tally(candidates, 0.0, floor, True) if certain else row_mass
        floor = max(floor, _bisect(candidates, float(top_p) * kept, floor, True, pmax))
    masses = np.where(candidates >= floor, candidates, 0).astype(np.float64)
    target = float(np.float32(uniform)) * _tally(candidates, 0.0, floor, True)
    above = np.nonzero((masses > 0) & (np.cumsum(masses) > target))[0]
    return int(kept_index[above[0] if above.size else np.nonzero(masses > 0)[0][-1]])


def emulate_sample(logits: np.ndarray, params: SamplingParams, uniform: float) -> int:
    probs, pmax = sample_probs(logits, params)
    floor = 0.0
    if 0 < params.top_k < probs.size:
        floor = _bisect(probs, float(params.top_k), 0.0, False, pmax)
    if params.min_p > 0:
        floor = max(floor, float(np.float32(params.min_p) * pmax))  # SampleParams.min_p is f32
    top_p = np.float32(params.top_p)
    if top_p < 1.0:
        kept = _tally(probs, 0.0, floor, True)
        floor = max(floor, _bisect(probs, float(top_p) * kept, floor, True, pmax))
    masses = np.where(probs >= floor, probs, 0).astype(np.float64)
    target = float(np.float32(uniform)) * _tally(probs, 0.0, floor, True)  # SampleParams.uniform is f32
    above = np.nonzero((masses > 0) & (np.cumsum(masses) > target))[0]  # sample_draw
    return int(above[0]) if above.size else int(np.nonzero(masses > 0)[0][-1])


def test_sort_free_sample_equals_the_reference_choice(rng: np.random.Generator) -> None:
    settings = [SamplingParams(0.7, 0, 1.0), SamplingParams(1.0, 40, 1.0), SamplingParams(1.0, 0, 0.9),
                SamplingParams(1.5, 50, 0.5), SamplingParams(0.8, 1, 1.0), SamplingParams(1.0, 0, 0.05),
                SamplingParams(1.0, 0, 1.0, min_p=0.05), SamplingParams(0.7, 20, 0.95, min_p=0.2),
                SamplingParams(1.0, 0, 1.0, min_p=1.0)]
    for params in settings:
        for _ in range(4):
            logits = (rng.standard_normal(3000) * 4).astype(np.float32)
            logits[rng.integers(0, 3000, 5)] = logits.max()  # ties at the top
            uniform = draw_uniform(rng)  # a float32, as the engine draws it
            assert emulate_sample(logits, params, uniform) == choose_token(logits, params, uniform), params
            assert emulate_fast_sample(logits, params, uniform) in (None, choose_token(logits, params, uniform)), params


def test_fast_sample_path_keeps_the_full_paths_thresholds(rng: np.random.Generator) -> None:
    """Over a Qwen-sized row: the fast path runs for top_k, min_p and top_p settings and picks the
    reference's token; it does not for plain temperature sampling (nothing cuts the row), when the
    bound leaves more entries than the buffer holds (a flat row), nor for top_p alone when the
    entries above the guessed bound carry less than top_p of the mass (a long, nearly flat tail)."""
    vocab = 248_320
    peaked = (rng.standard_normal(vocab) * 3).astype(np.float32)
    tail = (rng.standard_normal(vocab) * 0.01).astype(np.float32)  # [V] the mass is in the tail
    tail[rng.choice(vocab, 1000, replace=False)] += 2.0
    cases = [(SamplingParams(1.0, 20, 0.95, presence_penalty=1.5), peaked, True),
             (SamplingParams(0.6, 20, 0.95), peaked, True), (SamplingParams(0.7, 200, 1.0), peaked, True),
             (SamplingParams(1.0, 0, 1.0, min_p=0.05), peaked, True), (SamplingParams(0.6, 0, 0.8), peaked, True),
             (SamplingParams(0.6, 0, 0.95), peaked, True), (SamplingParams(1.0, 0, 1e-9), peaked, True),
             (SamplingParams(1.0, 0, 0.95), peaked, False),  # at T 1 the top 95 % spans ~20K entries
             (SamplingParams(1.0, 0, 1.0), peaked, False), (SamplingParams(1.0, 20, 0.95), np.zeros_like(peaked), False),
             (SamplingParams(1.0, 0, 0.9), np.zeros_like(peaked), False), (SamplingParams(1.0, 0, 0.9), tail, False),
             (SamplingParams(1.0, 2000, 1.0), peaked, False)]
    for params, logits, runs in cases:
        for _ in range(2):
            uniform = draw_uniform(rng)  # a float32, as the engine draws it
            fast = emulate_fast_sample(logits, params, uniform)
            assert (fast is not None) == runs, params
            if runs:
                assert fast == choose_token(logits, params, uniform), params
            assert emulate_sample(logits, params, uniform) == choose_token(logits, params, uniform), params


def test_sort_free_sample_extremes_equal_the_reference_choice(rng: np.random.Generator) -> None:
    """logits / T overflowing (tiny T on large logits), T rounding to a denormal or 0 in float32,
    top_p rounding to 0, NaN and +inf logits: same token as the reference, never an index past
    the vocabulary or a NaN draw."""
    cases = [(SamplingParams(1e-30, 0, 1.0), "large"), (SamplingParams(1e-45, 5, 1.0), "plain"),
             (SamplingParams(1e-60, 0, 0.9), "plain"), (SamplingParams(1.0, 0, 1e-50), "plain"),
             (SamplingParams(1.0, 3, 1e-50), "plain"), (SamplingParams(0.9, 20, 0.95), "nan"),
             (SamplingParams(1.0, 0, 1.0), "inf"), (SamplingParams(0.5, 4, 0.5), "dead")]
    for params, kind in cases:
        for _ in range(4):
            logits = (rng.standard_normal(3000) * 4).astype(np.float32)
            if kind == "large":
                logits *= np.float32(1e10)
            elif kind in ("nan", "inf"):
                logits[rng.choice(3000, size=7, replace=False)] = np.nan if kind == "nan" else np.inf
            elif kind == "dead":
                logits[:] = -np.inf
            uniform = draw_uniform(rng)  # a float32, as the engine draws it
            token = emulate_sample(logits, params, uniform)
            assert 0 <= token < 3000 and not np.isnan(logits[token])
            assert token == choose_token(logits, params, uniform), (params, kind)

# --- conv1d.cuh: token chunks per block, window from x or the state, state written by chunk 0 ------
def emulate_causal_conv1d(x: np.ndarray, weight: np.ndarray, state: np.ndarray) -> np.ndarray:
    tokens, channels = x.shape
    width = weight.shape[1]
    old = state.copy()  # chunk 0 reads the state before it writes it; other chunks never read it
    input_at = lambda c, i: x[i, c] if i >= 0 else old[c, width - 1 + i]  # noqa: E731
    out = np.full_like(x, np.nan)
    for t_begin in range(0, tokens, 64):  # grid.y
        for c in range(channels):
            window = [input_at(c, t_begin - (width - 1) + j) for j in range(width - 1)]
            for t in range(t_begin, min(t_begin + 64, tokens)):
                acc = x[t, c] * weight[c, width - 1] + sum(window[j] * weight[c, j] for j in range(width - 1))
                out[t, c] = acc / (1 + np.exp(-acc))
                window = window[1:] + [x[t, c]]
    for c in range(channels):  # write_new_state (blockIdx.y == 0)
        state[c] = [input_at(c, tokens - (width - 1) + j) for j in range(width - 1)]
    return out


def test_conv1d_chunks_and_state_equal_the_reference(rng: np.random.Generator) -> None:
    channels, width = 6, 4
    for tokens in (1, 2, 64, 65, 150):
        x = rng.standard_normal((tokens, channels)).astype(np.float32)
        weight = rng.standard_normal((channels, width)).astype(np.float32)
        state = rng.standard_normal((channels, width - 1)).astype(np.float32)
        want_state, got_state = state.copy(), state.copy()
        want = NumpyBackend().causal_conv1d(x, weight, want_state)
        got = emulate_causal_conv1d(x, weight, got_state)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got_state, want_state)


def test_sample_rounding_rule_accepts_only_neighbours_across_a_boundary(rng: np.random.Generator) -> None:
    """test_gpu_ops' within_rounding_of_draw: the reference's own token; the neighbour when the
    draw sits on their CDF boundary (to 1e-9 of the mass); never a token whose interval is away."""
    from test_gpu_ops import within_rounding_of_draw

    from atlas.backends.base import SamplingParams
    from atlas.sampling import choose_token, softmax_probs

    logits = rng.standard_normal(5000).astype(np.float32)  # every p > 1e-6 of the mass: no token is "near" by size
    params = SamplingParams(1.0, 0, 1.0)
    for uniform in rng.random(20):
        token = choose_token(logits, params, float(uniform))
        assert within_rounding_of_draw(logits, params, float(uniform), token)
        far = (token + 2500) % 5000
        assert not within_rounding_of_draw(logits, params, float(uniform), far)
    cumulative = np.cumsum(softmax_probs(logits, 1.0).astype(np.float64))
    boundary = int(rng.integers(100, 4900))
    uniform = float(cumulative[boundary] / cumulative[-1]) - 1e-9  # just inside `boundary`'s interval
    assert choose_token(logits, params, uniform) == boundary
    assert within_rounding_of_draw(logits, params, uniform, boundary + 1)
    assert not within_rounding_of_draw(logits, params, uniform, boundary + 3)
