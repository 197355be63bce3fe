"""The float32 numpy reference backend: every op of backends/base.py, vectorised over tokens/heads."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ..quant.stored import QuantizedWeight
from ..sampling import choose_token, penalize_row, top_order
from .base import (
    AttentionInputs,
    AttentionOperands,
    DeltaNetInputs,
    DeltaNetOperands,
    KVCache,
    NO_TOKEN,
    LogprobTensors,
    PenaltyOperands,
    ReadyArray,
    SamplingParams,
    StorageDType,
    Tensor,
    check_split_widths,
    compose_full_attention,
    compose_gated_delta_net,
    kernel_temperature,
)
from .host_weights import HostMatrix, HostQuantized, compact, dense, expert_matrix, matmul_t, row_parts

DecodeStep = Callable[[Tensor, Tensor], Tensor]

CHUNK_SIZE = 64
RECURRENT_MAX_TOKENS = 8  # decode and speculative verify steps: cheaper than one padded chunk
QUERY_BLOCK = 256
L2_EPS = 1e-6


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(np.float32(0.0), x)


def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + np.float32(eps))


def _l2norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True) + np.float32(L2_EPS))


def rope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray, scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """positions [T], inv_freq [R/2] -> cos, sin [T, R] (rotate-half layout: frequencies repeated
    twice), each times `scaling`. The angles are float32 products, as transformers computes them:
    at long contexts the rounding of the angle matters more than the accuracy of cos/sin."""
    angles = positions.astype(np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]  # [T, R/2]
    angles = np.concatenate([angles, angles], axis=-1)  # [T, R]
    return np.cos(angles) * np.float32(scaling), np.sin(angles) * np.float32(scaling)


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _attend(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, positions: np.ndarray, scale: float
) -> np.ndarray:
    """q [T, Hq, D], keys/values [L, Hkv, D] (cache rows 0..L-1) -> causal GQA attention [T, Hq, D]."""
    tokens, q_heads, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(tokens, kv_heads, q_heads // kv_heads, dim).transpose(1, 2, 0, 3)  # [Hkv, g, T, D]
    scores = grouped @ keys.transpose(1, 2, 0)[:, None] * np.float32(scale)  # [Hkv, g, T, L]
    hidden = np.arange(keys.shape[0])[None, :] > positions[:, None]  # [T, L]
    scores = np.where(hidden, -np.inf, scores)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = probs @ values.transpose(1, 0, 2)[:, None]  # [Hkv, g, T, D]
    return out.transpose(2, 0, 1, 3).reshape(tokens, q_heads, dim)


def _split_qkv(mixed_qkv: np.ndarray, num_k_heads: int, state_shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """mixed [T, 2*Hk*Dk + Hv*Dv] -> q, k [Hv, T, Dk] (l2-normed, q scaled, repeated per value
    head), v [Hv, T, Dv]."""
    value_heads, k_dim, v_dim = state_shape
    tokens = mixed_qkv.shape[0]
    key_width = num_k_heads * k_dim
    q = mixed_qkv[:, :key_width].reshape(tokens, num_k_heads, k_dim)
    k = mixed_qkv[:, key_width : 2 * key_width].reshape(tokens, num_k_heads, k_dim)
    v = mixed_qkv[:, 2 * key_width :].reshape(tokens, value_heads, v_dim)
    repeat = value_heads // num_k_heads
    q = np.repeat(_l2norm(q), repeat, axis=1) * np.float32(k_dim**-0.5)  # [T, Hv, Dk]
    k = np.repeat(_l2norm(k), repeat, axis=1)  # [T, Hv, Dk]
    return q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2)


@dataclass(frozen=True)
class DeltaInputs:
    q: np.ndarray  # [Hv, T, Dk], l2-normed and scaled
    k: np.ndarray  # [Hv, T, Dk], l2-normed
    v: np.ndarray  # [Hv, T, Dv]
    g: np.ndarray  # [Hv, T], log decay
    beta: np.ndarray  # [Hv, T]


def delta_rule_recurrent(x: DeltaInputs, state: np.ndarray) -> np.ndarray:
    """One token at a time; state [Hv, Dk, Dv] is updated in place. -> o [Hv, T, Dv]."""
    q, k, v, g, beta = x.q, x.k, x.v, x.g, x.beta
    out = np.empty_like(v)
    for t in range(q.shape[1]):
        state *= np.exp(g[:, t])[:, None, None]
        predicted = np.einsum("hk,hkv->hv", k[:, t], state)  # [Hv, Dv]
        delta = (v[:, t] - predicted) * beta[:, t, None]  # [Hv, Dv]
        state += k[:, t, :, None] * delta[:, None, :]
        out[:, t] = np.einsum("hk,hkv->hv", q[:, t], state)
    return out


def _chunked_views(x: np.ndarray, padded: int) -> np.ndarray:
    """[Hv, T, ...] -> zero-padded to `padded` tokens, then [Hv, n, CHUNK, ...]."""
    pad = [(0, 0), (0, padded - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
    x = np.pad(x, pad)
    return x.reshape(x.shape[0], padded // CHUNK_SIZE, CHUNK_SIZE, *x.shape[2:])


def _unit_lower_solve(system: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Solve (I + strict_lower(system)) X = rhs, batched over leading dims."""
    lower = np.tril(system, -1) + np.eye(system.shape[-1], dtype=system.dtype)
    return np.linalg.solve(lower, rhs).astype(np.float32)


def delta_rule_chunked(x: DeltaInputs, state: np.ndarray) -> np.ndarray:
    """Same contract as delta_rule_recurrent, computed per chunk of 64 tokens with the UT transform."""
    tokens = x.q.shape[1]
    padded = -(-tokens // CHUNK_SIZE) * CHUNK_SIZE
    q, k, v = (_chunked_views(t, padded) for t in (x.q, x.k, x.v))  # [Hv, n, C, D*]
    g, beta = (_chunked_views(t, padded) for t in (x.g, x.beta))  # [Hv, n, C]
    cum = np.cumsum(g, axis=-1)  # [Hv, n, C]
    future = np.triu(np.ones((CHUNK_SIZE, CHUNK_SIZE), dtype=bool), 1)
    pair_decay = np.exp(np.where(future, -np.inf, cum[..., :, None] - cum[..., None, :]))  # [Hv, n, C, C]
    k_beta = k * beta[..., None]
    ut_system = (k_beta @ k.swapaxes(-1, -2)) * pair_decay
    intra = (q @ k.swapaxes(-1, -2)) * pair_decay  # [Hv, n, C, C]
    new_values = _unit_lower_solve(ut_system, v * beta[..., None])  # [Hv, n, C, Dv]
    k_cumdecay = _unit_lower_solve(ut_system, k_beta * np.exp(cum)[..., None])  # [Hv, n, C, Dk]
    q_decayed = q * np.exp(cum)[..., None]
    k_to_end = k * np.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = np.exp(cum[..., -1])  # [Hv, n]
    out = np.empty_like(new_values)
    for i in range(q.shape[1]):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state  # [Hv, C, Dv]
        out[:, i] = q_decayed[:, i] @ state + intra[:, i] @ v_new
        state *= chunk_decay[:, i, None, None]
        state += k_to_end[:, i].swapaxes(-1, -2) @ v_new
    return out.reshape(out.shape[0], padded, -1)[:, :tokens]


C = TypeVar("C", bound=type)


def quiet_float_errors(cls: C) -> C:
    """Every public op of cls under np.errstate(all="ignore"): NaN and infinity flow through the
    reference ops as through the GPU's (Engine.finite_row reports them in one line) instead of
    printing numpy's RuntimeWarnings."""
    for name, op in list(vars(cls).items()):
        if callable(op) and not name.startswith("_") and not isinstance(op, type):
            setattr(cls, name, quietly(op))
    return cls


_QUIET = threading.local()  # .on: inside a quiet call on this thread (np.errstate is per context too)


def quietly(op: Callable[..., Any]) -> Callable[..., Any]:
    """op under np.errstate(all="ignore"), entered once however deep the calls nest (a decode
    step's ~60 ops run inside the step's one: entering costs ~2 us a time)."""
    @functools.wraps(op)
    def run(*args: Any, **kwargs: Any) -> Any:
        if getattr(_QUIET, "on", False):
            return op(*args, **kwargs)
        _QUIET.on = True
        try:
            with np.errstate(all="ignore"):
                return op(*args, **kwargs)
        finally:
            _QUIET.on = False

    return run


@quiet_float_errors
class NumpyBackend:
    """Reference backend: computes in float32 (int32 for ids) on the host. Matrices uploaded with
    the bf16 hint stay as stored (bf16, or packed when quantized: host_weights.py) and are
    converted to float32 inside the ops that read them."""

    name = "numpy"
    keeps_stored_floats = True  # the loader hands bf16 / f16 matrices over unconverted
    runs_ahead = False  # a step ends before its call returns: one queued ahead would only be wasted at the end

    # --- memory -------------------------------------------------------------------------------
    def upload(self, array: np.ndarray, dtype: StorageDType) -> Tensor:
        if dtype == "bf16" and array.ndim >= 2 and array.dtype.kind not in "iub":
            return compact(array)
        target = np.int32 if dtype == "i32" else np.float32
        return np.array(array, dtype=target, order="C", copy=True)

    def upload_quantized(self, weight: QuantizedWeight) -> Tensor:
        return HostQuantized((weight,))

    def upload_quantized_rows(
        self, weights: Sequence[QuantizedWeight], rows: np.ndarray | None, experts: int
    ) -> Tensor:
        return HostQuantized(tuple(weights), None if rows is None else np.asarray(rows), experts)

    def zeros(self, shape: tuple[int, ...], dtype: StorageDType) -> Tensor:
        return np.zeros(shape, dtype=np.int32 if dtype == "i32" else np.float32)

    def to_numpy(self, t: Tensor) -> np.ndarray:
        array = dense(t) if isinstance(t, (HostMatrix, HostQuantized)) else np.asarray(t)
        return array.astype(np.int32 if np.issubdtype(array.dtype, np.integer) else np.float32)

    def read_later(self, t: Tensor) -> ReadyArray:
        return ReadyArray(self.to_numpy(t))

    def rows(self, t: Tensor, start: int, stop: int) -> Tensor:
        return t[start:stop]

    def cache_rows(self, cache: Any, stop: int) -> dict[str, np.ndarray]:
        if isinstance(cache, np.ndarray):  # a plain cache keeps the rows as attention wrote them
            return {"rows": cache[:stop].copy()}
        return cache.stored_rows(stop)  # a quantized level's (atlas.kvcache.storage.QuantizedRows)

    def write_cache_rows(self, cache: Any, fields: dict[str, np.ndarray]) -> None:
        if isinstance(cache, np.ndarray):
            rows = fields["rows"]
            cache[: len(rows)] = rows
        else:
            cache.write_stored_rows(fields)

    def close(self) -> None:
        pass  # host arrays go with their last reference

    # --- dense ops ----------------------------------------------------------------------------
    def embedding(self, table: Tensor, ids: Tensor) -> Tensor:
        if isinstance(table, HostMatrix):
            return table.take(ids)  # [T, H]: only the rows read are converted
        return dense(table)[ids]

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return _rms(x, eps) * weight

    def add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        total = x + residual
        return _rms(total, eps) * weight, total

    def add(self, x: Tensor, y: Tensor) -> Tensor:
        return x + y

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        return matmul_t(x, weight)

    def linear_split(self, x: Tensor, weight: Tensor, widths: Sequence[int]) -> list[Tensor]:
        """One matmul per part: BLAS may round a column block of a wider product differently, and
        the reference must not depend on how the loader grouped the parts (storage, backend hooks)."""
        check_split_widths(weight.shape, widths)
        bounds = np.cumsum([0, *widths]).tolist()
        return [matmul_t(x, part) for part in row_parts(weight, bounds)]  # [T, width] each

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        half = gate_up.shape[-1] // 2
        return _silu(gate_up[..., :half]) * gate_up[..., half:]

    def nonfinite_count(self, x: Tensor) -> Tensor:
        return np.array([np.count_nonzero(~np.isfinite(x))], dtype=np.int32)

    def sigmoid_mul(self, x: Tensor, gate: Tensor) -> Tensor:
        return x * _sigmoid(gate)

    # --- full attention -----------------------------------------------------------------------
    def head_norm_rope(
        self, x: Tensor, weight: Tensor, positions: Tensor, inv_freq: Tensor, scaling: float, eps: float
    ) -> Tensor:
        normed = _rms(x, eps) * weight  # [T, heads, D]
        cos, sin = rope_cos_sin(positions, inv_freq, scaling)  # [T, R]
        rotary_dim = cos.shape[-1]
        rot = normed[..., :rotary_dim]
        rotated = rot * cos[:, None, :] + _rotate_half(rot) * sin[:, None, :]
        return np.concatenate([rotated, normed[..., rotary_dim:]], axis=-1)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache, positions: Tensor, scale: float) -> Tensor:
        start = int(positions[0])
        end = start + q.shape[0]
        k_cache, v_cache = cache.k, cache.v  # [S, Hkv, D]
        k_cache[start:end] = k
        v_cache[start:end] = v
        outputs = []
        for i in range(0, q.shape[0], QUERY_BLOCK):  # bounds the [Hkv, g, block, L] score tensor
            block = positions[i : i + QUERY_BLOCK]
            visible = int(block[-1]) + 1
            outputs.append(_attend(q[i : i + QUERY_BLOCK], k_cache[:visible], v_cache[:visible], block, scale))
        return np.concatenate(outputs)

    def full_attention(self, x: AttentionInputs, layer: AttentionOperands) -> Tensor:
        return compose_full_attention(self, x, layer)

    def fuses_full_attention(self, cache: KVCache) -> bool:
        return False

    # --- linear attention (Gated DeltaNet) ----------------------------------------------------
    def causal_conv1d(self, x: Tensor, weight: Tensor, conv_state: Tensor) -> Tensor:
        tokens = x.shape[0]
        weight = dense(weight)  # [C, K]
        width = weight.shape[1]
        window = np.concatenate([conv_state.T, x], axis=0)  # [K-1+T, C]
        out = np.zeros_like(x)
        for tap in range(width):
            out += window[tap : tap + tokens] * weight[:, tap]
        conv_state[...] = window[tokens:].T
        return _silu(out)

    def gated_delta_rule(self, mixed_qkv: Tensor, a: Tensor, b: Tensor, layer: DeltaNetOperands) -> Tensor:
        state = layer.recurrent_state  # [Hv, Dk, Dv]
        q, k, v = _split_qkv(mixed_qkv, layer.num_k_heads, state.shape)  # [Hv, T, D*]
        g = (-np.exp(layer.A_log) * _softplus(a + layer.dt_bias)).T  # [Hv, T]
        beta = _sigmoid(b).T  # [Hv, T]
        rule = delta_rule_recurrent if q.shape[1] <= RECURRENT_MAX_TOKENS else delta_rule_chunked
        out = rule(DeltaInputs(q, k, v, g.astype(np.float32), beta.astype(np.float32)), state)  # [Hv, T, Dv]
        return np.ascontiguousarray(out.transpose(1, 0, 2))

    def gated_rms_norm(self, x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
        return _rms(x, eps) * weight * _silu(z)

    def gated_delta_net(self, x: DeltaNetInputs, layer: DeltaNetOperands) -> Tensor:
        return compose_gated_delta_net(self, x, layer)

    def fuses_gated_delta_net(self, tokens: int) -> bool:
        return False

    # --- mixture of experts -------------------------------------------------------------------
    def router(
        self, x: Tensor, weight: Tensor, top_k: int, renormalize: bool, *, shared_expert: bool = False
    ) -> tuple[Tensor, Tensor]:
        experts = weight.shape[0] - int(shared_expert)
        weight = dense(weight)  # [E (+1), H]
        logits = x @ weight[:experts].T  # [T, E]
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k].astype(np.int32)  # [T, k]
        weights = np.take_along_axis(probs, ids, axis=-1)
        if renormalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        if shared_expert:  # the product the unstacked shared gate computes: x @ gate.T, gate [1, H]
            ids = np.concatenate([ids, np.full((x.shape[0], 1), experts, np.int32)], axis=-1)  # [T, k + 1]
            weights = np.concatenate([weights, _sigmoid(x @ weight[experts:].T)], axis=-1)
        return ids, weights.astype(np.float32)

    def moe_experts(self, x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
        out = np.zeros_like(x)  # [T, H]
        for expert in np.unique(ids[ids >= 0]):  # -1: an empty slot, not expert E - 1
            tokens, slots = np.nonzero(ids == expert)
            hidden = self.silu_mul(x[tokens] @ expert_matrix(gate_up, expert).T)  # [n, I]
            expert_out = hidden @ expert_matrix(down, expert).T  # [n, H]
            out[tokens] += expert_out * weights[tokens, slots, None]  # a token picks an expert once
        return out

    def add_sigmoid_scaled(self, x: Tensor, y: Tensor, gate_logit: Tensor) -> Tensor:
        return x + _sigmoid(gate_logit) * y

    # --- sampling -----------------------------------------------------------------------------
    def argmax(self, logits: Tensor) -> Tensor:
        finite = np.where(np.isnan(logits), -np.inf, logits)  # NaN never wins, as on the GPU
        picks = np.argmax(finite, axis=-1)  # [R]
        return np.where(np.isnan(logits).all(axis=-1), NO_TOKEN, picks).astype(np.int32)  # [R]

    def sample(self, logits: Tensor, params: SamplingParams, uniform: float) -> Tensor:
        return np.array([choose_token(logits[0], params, uniform)], dtype=np.int32)

    def penalize(self, logits: Tensor, operands: PenaltyOperands, params: SamplingParams, mask_ends: bool) -> Tensor:
        row = penalize_row(logits[0], operands.counts, operands.flags, operands.bias, params, mask_ends)
        return row[None]  # [1, V]

    def count_token(self, counts: Tensor, token: Tensor) -> None:
        counts[int(token[0])] += 1

    def logprob_rows(self, logits: Tensor, tokens: Tensor, top: int, temperature: float = 1.0) -> LogprobTensors:
        z = np.where(np.isnan(logits), -np.inf, logits).astype(np.float64)  # [R, V]
        peak = z.max(axis=-1)  # [R]
        finite = np.isfinite(peak)
        t = kernel_temperature(temperature)  # LogprobParams.temperature is f32
        total = np.exp((z - peak[:, None]) / t).sum(-1)  # [R]; a row whose peak is not finite is reported as it
        lse = np.where(finite, peak / t + np.log(total), peak)  # [R]
        hi = lse.astype(np.float32)  # [R]
        lo = np.where(np.isfinite(hi), lse - hi.astype(np.float64), 0.0).astype(np.float32)  # [R]
        ids = np.stack([self.top_ids(row[None], top) for row in logits]) if top else np.zeros((len(logits), 0), np.int32)
        values = np.take_along_axis(logits, np.maximum(ids, 0), axis=-1).astype(np.float32)  # [R, k]
        picked = z[np.arange(len(z)), tokens]  # [R]
        ranks = (z >= picked[:, None]).sum(-1).astype(np.int32)  # [R]
        return LogprobTensors(np.stack([hi, lo], -1), picked.astype(np.float32), ranks, ids, values)

    def top_ids(self, logits: Tensor, k: int) -> Tensor:
        row = logits[0]  # [V]
        listed = np.flatnonzero(~np.isnan(row))  # [V'] NaN never
        order = listed[top_order(row[listed].astype(np.float64), k)]  # descending, ties the lower id first
        return np.concatenate([order, np.full(k - order.size, -1)]).astype(np.int32)  # [k]

    # --- execution ----------------------------------------------------------------------------
    def make_decode_step(self, step: DecodeStep) -> DecodeStep:
        return quietly(step)
