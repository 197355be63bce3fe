"""The op interface that model code is written against.

Every backend (numpy reference, CUDA) implements these ops with the same semantics; the numpy
backend computes them in float32 and is the oracle that GPU kernels are tested against.

Letters used in shapes:
  T tokens in this step, H hidden size, V vocab, D head dim, Hq / Hkv query / key-value heads,
  S cache capacity (tokens), C conv channels, K conv kernel width,
  Hk / Hv linear-attention key / value heads, Dk / Dv their head dims,
  E experts, I expert width, k experts per token, N / Kin output / input features of a linear.

All tensors are contiguous and row-major. Ops never modify their inputs, except the state
arguments documented as updated in place (caches, conv and recurrent states).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

Tensor = Any  # backend-native tensor: has .shape and .reshape(*shape) (a view, no copy)
StorageDType = Literal["f32", "bf16", "i32"]
# argmax's and sample's pick from a row of NaN alone (a model state gone NaN): no token. The
# embedding reads a zero row for it, so a GPU's chained decode step stays in bounds until the host
# reads it and stops the generation (Engine.checked).
NO_TOKEN = -1


def kernel_temperature(temperature: float) -> float:
    """The temperature the sampling kernels divide by: float32's, at least its smallest normal (a
    tiny T would round to 0 or a denormal) and at most its largest (a huge T would round to inf,
    and -inf / inf makes a masked token's weight NaN instead of 0), as sampling.cuh clamps it."""
    f32 = np.finfo(np.float32)
    return float(np.float32(min(max(temperature, float(f32.tiny)), float(f32.max))))


class PendingArray(Protocol):
    """Backend.read_later's handle: the host array once the backend has it."""

    def result(self) -> np.ndarray: ...


@dataclass(frozen=True)
class ReadyArray:
    """A PendingArray that was read at once (a backend that computes on the host)."""

    value: np.ndarray

    def result(self) -> np.ndarray:
        return self.value


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; temperature 0 means greedy. Backends' `sample` takes temperature, top_k,
    top_p and min_p; `penalize` the penalties, min_tokens and logit_bias (`adjusts_logits`); only
    structured output and llama.cpp's typical-p, top-n-sigma, XTC, DRY, mirostat and dynatemp
    (`on_host`) pick on the host from logits read back (atlas.sampling)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0 = off: keep the tokens whose p is >= min_p * the largest p
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # subtracted, times its count, from the logit of every generated token
    repetition_penalty: float = 1.0  # 1 = off: a prompt or generated token's logit / r when > 0, else * r
    min_tokens: int = 0  # the tokens that end a generation cannot be picked before this many
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to its logit, OpenAI's logit_bias
    structured: bool = False  # structured output: picks keep to a JSON / schema / regex / choice shape (atlas.structured)
    typical_p: float = 1.0  # 1 = off: keep the tokens whose surprise is nearest the entropy, this much of the mass
    top_n_sigma: float = -1.0  # <= 0 = off: keep the logits >= the largest - n x their standard deviation
    xtc_probability: float = 0.0  # 0 = off: how often XTC cuts all tokens of p >= xtc_threshold but the least likely
    xtc_threshold: float = 0.1  # above 0.5 no two tokens reach it: XTC cuts nothing
    dry_multiplier: float = 0.0  # 0 = off: DRY's penalty on a token that would extend a repeat (atlas.sampling_filters)
    dry_base: float = 1.75  # the penalty grows by this factor per token of repeat past dry_allowed_length
    dry_allowed_length: int = 2  # repeats this long cost nothing
    dry_penalty_last_n: int = -1  # the last n tokens (prompt and generated) searched for repeats; -1: all, 0: off
    dry_breakers: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (head id, tail ids): no repeat reaches back past one
    mirostat: int = 0  # 0 = off; 1, 2: mirostat's own cut in place of top-k / top-p / min_p and the filters
    mirostat_tau: float = 5.0  # the surprise (bits) it aims at
    mirostat_eta: float = 0.1  # how fast its cut follows the surprise of the picks
    dynatemp_range: float = 0.0  # 0 = off: each sampled pick's temperature moves within +- this by its entropy
    dynatemp_exponent: float = 1.0  # the normalised entropy's power in that move

    @property
    def penalized(self) -> bool:
        """Picks depend on the tokens before them (atlas.sampling.Penalties)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1 \
            or self.min_tokens > 0

    @property
    def adjusts_logits(self) -> bool:
        """The logits change before the pick (Backend.penalize): penalties, min_tokens, logit_bias."""
        return self.penalized or bool(self.logit_bias)

    @property
    def raw_greedy(self) -> bool:
        """The argmax of the model's own logits: what speculative decoding's verify passes take."""
        return self.temperature == 0 and not self.adjusts_logits and not self.on_host

    @property
    def xtc_draws(self) -> bool:
        """XTC can cut: each sampled pick draws its chance (llama.cpp's, after min_p and top_p)."""
        return self.temperature > 0 and self.xtc_probability > 0 and self.xtc_threshold <= 0.5

    @property
    def dry(self) -> bool:
        """DRY penalises repeats, greedy picks too (llama.cpp's: after the penalties)."""
        return self.dry_multiplier != 0 and self.dry_base >= 1 and self.dry_penalty_last_n != 0

    @property
    def mirostat_on(self) -> bool:
        return self.temperature > 0 and self.mirostat != 0

    @property
    def host_state(self) -> bool:
        """Picks carry host state from pick to pick: DRY's history, mirostat's mu."""
        return self.dry or self.mirostat_on

    @property
    def host_filters(self) -> bool:
        """A pick applies llama.cpp's DRY, or a sampled one typical-p, top-n-sigma, XTC, mirostat or
        dynatemp (atlas.sampling_filters), which no kernel has: the pick reads the row back."""
        sampled = self.typical_p < 1 or self.top_n_sigma > 0 or self.xtc_draws or self.mirostat_on or self.dynatemp_range > 0
        return self.dry or (self.temperature > 0 and sampled)

    @property
    def on_host(self) -> bool:
        """Structured output (each pick reads the penalized logits back and asks the matcher) or
        host_filters."""
        return self.structured or self.host_filters


@dataclass
class KVCache:
    """A full-attention layer's K and V caches, updated in place by `Backend.attention`: [S, Hkv, D]
    backend tensors, or a quantized --kv-cache-dtype level's storage of that shape."""

    k: Tensor  # [S, Hkv, D]
    v: Tensor  # [S, Hkv, D]


@dataclass(frozen=True)
class PenaltyOperands:
    """One generation's penalty state on the backend (atlas.sampling.Penalties makes it)."""

    counts: Tensor  # [V] i32: times each token was generated (Backend.count_token adds a pick)
    flags: Tensor  # [V] i32: PROMPT_TOKEN | END_TOKEN bits (atlas.sampling)
    bias: Tensor | None  # [V] f32 logit_bias, None without one


@dataclass(frozen=True)
class LogprobTensors:
    """Backend.logprob_rows' answer for [R] rows: what their token log-probabilities need."""

    lse: Tensor  # [R, 2] f32: each row's log-sum-exp as hi + lo (hi not finite: the row's peak is not)
    picked: Tensor  # [R] f32: the logit of the row's token (NaN as -inf)
    ranks: Tensor  # [R] i32: the row's logits at or above the token's (NaN as -inf), itself included
    ids: Tensor  # [R, k] i32: the k largest logits' ids (top_ids' order; -1 past what is listed)
    values: Tensor  # [R, k] f32: their logits


@dataclass(frozen=True)
class AttentionInputs:
    """One step's q, k, v of a full-attention layer, before the head norms and the rotary."""

    q: Tensor  # [T, Hq, D]
    k: Tensor  # [T, Hkv, D]
    v: Tensor  # [T, Hkv, D]
    positions: Tensor  # [T] i32, consecutive
    gate: Tensor | None = None  # [T, Hq, D]: the output gate, attention * sigmoid(gate) (None: ungated)


@dataclass(frozen=True)
class AttentionOperands:
    """A full-attention layer's head norms, rotary table and KV cache as `full_attention` takes them."""

    q_norm: Tensor  # [D] f32
    k_norm: Tensor  # [D] f32
    q_eps: float
    k_eps: float
    inv_freq: Tensor  # [R/2] f32
    rope_scaling: float
    cache: KVCache  # written in place at the step's positions
    scale: float  # the softmax scale, D^-0.5


Emit = Callable[[str, Tensor], Tensor]  # (part, tensor) -> the tensor to go on with: a layer's dump hook


def passed_on(part: str, tensor: Tensor) -> Tensor:
    """The Emit of a composition that no dump watches."""
    return tensor


def compose_full_attention(backend: Backend, x: AttentionInputs, layer: AttentionOperands,
                           emit: Emit = passed_on) -> Tensor:
    """`Backend.full_attention` as its ops: q and k head norm + rotary ("q", "k" emitted), attention,
    the output gate when x has one."""
    q = emit("q", backend.head_norm_rope(x.q, layer.q_norm, x.positions, layer.inv_freq, layer.rope_scaling, layer.q_eps))
    k = emit("k", backend.head_norm_rope(x.k, layer.k_norm, x.positions, layer.inv_freq, layer.rope_scaling, layer.k_eps))
    out = backend.attention(q, k, x.v, layer.cache, x.positions, layer.scale)  # [T, Hq, D]
    return out if x.gate is None else backend.sigmoid_mul(out, x.gate)


@dataclass(frozen=True)
class DeltaNetInputs:
    """One step's inputs of a Gated DeltaNet layer (parts of its fused input projection)."""

    mixed: Tensor  # [T, C] q, k, v before the conv
    z: Tensor  # [T, Hv, Dv]
    a: Tensor  # [T, Hv]
    b: Tensor  # [T, Hv]


@dataclass(frozen=True)
class DeltaNetOperands:
    """A Gated DeltaNet layer's weights and states as `gated_delta_net` takes them."""

    conv_weight: Tensor  # [C, K]
    A_log: Tensor  # [Hv]
    dt_bias: Tensor  # [Hv]
    norm_weight: Tensor  # [Dv]
    norm_eps: float
    conv_state: Tensor  # [C, K-1] f32, updated in place
    recurrent_state: Tensor  # [Hv, Dk, Dv] f32, updated in place
    num_k_heads: int


def compose_gated_delta_net(backend: Backend, x: DeltaNetInputs, layer: DeltaNetOperands,
                            emit: Emit = passed_on) -> Tensor:
    """`Backend.gated_delta_net` as its three ops: conv, delta rule ("conv", "core" emitted), gated norm."""
    mixed = emit("conv", backend.causal_conv1d(x.mixed, layer.conv_weight, layer.conv_state))  # [T, C]
    core = emit("core", backend.gated_delta_rule(mixed, x.a, x.b, layer))  # [T, Hv, Dv]
    return backend.gated_rms_norm(core, x.z, layer.norm_weight, layer.norm_eps)  # [T, Hv, Dv]


def check_split_widths(weight_shape: tuple[int, ...], widths: Sequence[int]) -> None:
    """linear_split's contract on its arguments (ValueError: a wrong call is a bug in the caller)."""
    if len(weight_shape) != 2 or not widths or min(widths) <= 0 or sum(widths) != weight_shape[0]:
        raise ValueError(f"linear_split: widths {list(widths)} do not split a weight of shape {weight_shape} by rows")


@runtime_checkable
class Backend(Protocol):
    name: str

    # --- memory -------------------------------------------------------------------------------
    def upload(self, array: np.ndarray, dtype: StorageDType) -> Tensor:
        """Copy a host array to the backend. `dtype` is the storage hint: the CUDA backend stores
        bf16 matrices; the numpy backend keeps bf16 / f16 matrices as given (float32 ones as bf16
        where exact) and converts them to float32 inside its ops (host_weights.py)."""

    def zeros(self, shape: tuple[int, ...], dtype: StorageDType) -> Tensor:
        """A new zero-filled tensor (caches and states)."""

    def to_numpy(self, t: Tensor) -> np.ndarray:
        """Float data as float32, integer data as int32."""

    # True where the decode loop should queue step N+1 before it reads token N back
    # (atlas.decode_loop): a GPU, whose queued step runs while the host waits for the token.
    runs_ahead: bool

    def read_later(self, t: Tensor) -> PendingArray:
        """to_numpy(t) for a small tensor (a picked id), started now and waited for at result():
        work issued in between runs before the host waits."""

    def rows(self, t: Tensor, start: int, stop: int) -> Tensor:
        """t [T, ...] -> its rows start..stop-1 [stop - start, ...], a view (no copy, no read-back;
        valid while t is)."""

    def cache_rows(self, cache: Any, stop: int) -> dict[str, np.ndarray]:
        """A K or V cache's rows 0..stop-1 exactly as stored, one host array [stop, Hkv, ...] per
        field (a plain cache has one, "rows"; a quantized level's has its packed fields): what a
        saved sequence file holds (atlas.sequence_state)."""

    def write_cache_rows(self, cache: Any, fields: dict[str, np.ndarray]) -> None:
        """The inverse of cache_rows: rows 0.. of `cache` from the arrays cache_rows gave."""

    def close(self) -> None:
        """Give the backend's memory back now (idempotent; its tensors are invalid after). The
        CUDA backend frees its device memory, as it does when collected; host arrays need nothing."""

    # --- dense ops ----------------------------------------------------------------------------
    def embedding(self, table: Tensor, ids: Tensor) -> Tensor:
        """table [V, H], ids [T] i32 -> [T, H]."""

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """x [..., D], weight [D] -> x * rsqrt(mean(x^2) + eps) * weight, over the last dim."""

    def add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        """x, residual [T, H] -> (rms_norm(x + residual), x + residual)."""

    def add(self, x: Tensor, y: Tensor) -> Tensor:
        """Elementwise x + y, same shapes."""

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """x [T, Kin], weight [N, Kin] -> x @ weight.T  [T, N]."""

    def linear_split(self, x: Tensor, weight: Tensor, widths: Sequence[int]) -> list[Tensor]:
        """x [T, Kin], weight [sum(widths), Kin] (several linears of the same input stacked by rows)
        -> [x @ part.T for each row block of `widths` rows], each [T, width], contiguous: one
        linear split by columns. The CUDA backend runs one GEMV at T == 1 (its parts are views of
        that output) and one GEMM per part (on row views of the weight) above."""

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """gate_up [T, 2I] (gate first) -> silu(gate) * up  [T, I]."""

    def sigmoid_mul(self, x: Tensor, gate: Tensor) -> Tensor:
        """x, gate [T, N] -> x * sigmoid(gate)."""

    def nonfinite_count(self, x: Tensor) -> Tensor:
        """x (f32, any shape) -> [1] i32: how many of its values are NaN or infinite (a check that
        reads one int back, not the tensor)."""

    # --- full attention -----------------------------------------------------------------------
    def head_norm_rope(
        self,
        x: Tensor,
        weight: Tensor,
        positions: Tensor,
        inv_freq: Tensor,
        scaling: float,
        eps: float,
    ) -> Tensor:
        """x [T, heads, D] -> per-head RMSNorm (weight [D]), then rotary embedding on the first
        R = 2 * len(inv_freq) dims (rotate-half / NeoX layout: pair (i, i + R/2) turns by the
        float32 angle position * inv_freq[i], inv_freq [R/2] f32) at positions [T] i32, with cos
        and sin multiplied by `scaling`; the remaining dims pass through."""

    def attention(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache, positions: Tensor, scale: float) -> Tensor:
        """q [T, Hq, D]; k, v [T, Hkv, D]; cache.k, cache.v [S, Hkv, D] updated in place at rows
        positions[0] .. positions[0]+T-1 (positions [T] i32 are consecutive). Causal GQA softmax
        attention of each query over cache rows 0 .. its own position. -> [T, Hq, D]."""

    def full_attention(self, x: AttentionInputs, layer: AttentionOperands) -> Tensor:
        """head_norm_rope of x.q and x.k, then attention, times sigmoid(x.gate) when given
        (`compose_full_attention`) -> [T, Hq, D]; a backend may run them as fewer kernels, with the
        same result."""

    def fuses_full_attention(self, cache: KVCache) -> bool:
        """Whether `full_attention` over this cache runs as one fused kernel (then a dump has no .q / .k)."""

    # --- linear attention (Gated DeltaNet) ----------------------------------------------------
    def causal_conv1d(self, x: Tensor, weight: Tensor, conv_state: Tensor) -> Tensor:
        """x [T, C], weight [C, K], conv_state [C, K-1] (the previous K-1 inputs, oldest first),
        updated in place. -> silu(depthwise causal conv) [T, C]."""

    def gated_delta_rule(self, mixed_qkv: Tensor, a: Tensor, b: Tensor, layer: DeltaNetOperands) -> Tensor:
        """mixed_qkv [T, 2*Hk*Dk + Hv*Dv] (q, k, v concatenated, after the conv), a, b [T, Hv];
        of `layer`: A_log, dt_bias [Hv], recurrent_state [Hv, Dk, Dv] f32 updated in place, num_k_heads.
        q, k are L2-normalised per head (eps 1e-6), each key head serves Hv/Hk consecutive value
        heads, q is scaled by Dk^-0.5, g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b);
        per token: S = S*exp(g); S += k (x) (beta * (v - S^T k)); o = S^T q.  -> o [T, Hv, Dv].
        Backends may compute prefill chunked; results must equal the recurrent form."""

    def gated_rms_norm(self, x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
        """x, z [T, Hv, Dv], weight [Dv] -> rms_norm(x) * weight * silu(z) per head."""

    def gated_delta_net(self, x: DeltaNetInputs, layer: DeltaNetOperands) -> Tensor:
        """The three ops above in a row (`compose_gated_delta_net`): causal_conv1d of x.mixed,
        gated_delta_rule, gated_rms_norm with x.z -> [T, Hv, Dv]; both states updated in place.
        A backend may fuse them (CUDA: one decode kernel for T == 1, opt-in) with the same result."""

    def fuses_gated_delta_net(self, tokens: int) -> bool:
        """True when `gated_delta_net` on `tokens` rows runs as one kernel, so the conv and delta
        rule outputs are never written (a dump then shows the fused op's output only)."""

    # --- mixture of experts -------------------------------------------------------------------
    def router(
        self, x: Tensor, weight: Tensor, top_k: int, renormalize: bool, *, shared_expert: bool = False
    ) -> tuple[Tensor, Tensor]:
        """x [T, H], weight [E, H] -> softmax(x @ weight.T) top-k: (ids [T, k] i32 in descending
        probability order, weights [T, k] f32, divided by their sum when `renormalize`).
        `shared_expert`: weight [E + 1, H] with the shared expert's gate as row E; softmax and
        top-k (and the renormalisation) cover the first E logits as above, and one more slot
        (id E, weight sigmoid(logit E)) follows: ids / weights [T, k + 1]."""

    def moe_experts(
        self, x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor
    ) -> Tensor:
        """x [T, H], ids / weights [T, k], gate_up [E, 2I, H], down [E, H, I] ->
        sum_j weights[t, j] * down[e] @ silu_mul(gate_up[e] @ x[t]) with e = ids[t, j]  [T, H].
        A slot with id -1 (the CUDA router's mark for a token whose logits are NaN) adds nothing."""

    def add_sigmoid_scaled(self, x: Tensor, y: Tensor, gate_logit: Tensor) -> Tensor:
        """x, y [T, H], gate_logit [T, 1] -> x + sigmoid(gate_logit) * y (shared expert)."""

    # --- sampling -----------------------------------------------------------------------------
    def argmax(self, logits: Tensor) -> Tensor:
        """logits [T, V] -> [T] i32 (lowest index on ties; NaN reads as -inf; a row of NaN alone
        gives NO_TOKEN). Stays on the device."""

    def sample(self, logits: Tensor, params: SamplingParams, uniform: float) -> Tensor:
        """logits [1, V] -> [1] i32, without sorting, so a GPU computes the same token:
        p = softmax(logits / temperature); keep the tokens whose p is >= the top_k-th largest p
        (ties with it kept; top_k 0 keeps all); of those, keep the tokens whose p is >= t where t is
        the largest threshold such that the kept mass sum(p >= t) reaches top_p * kept mass
        (ties kept); then with c the cumulative sum of the kept p in index order, return the first
        index with c > uniform * c[-1]. `uniform` in [0, 1) comes from the caller's seeded RNG.
        min_p > 0 also drops the tokens whose p is below min_p * the largest p, before top_p.
        A row of NaN alone gives NO_TOKEN."""

    def penalize(self, logits: Tensor, operands: PenaltyOperands, params: SamplingParams, mask_ends: bool) -> Tensor:
        """logits [1, V] -> a new [1, V] (logits untouched: logprobs read them) with, in vLLM's
        order: params.logit_bias added (operands.bias); with `mask_ends` (fewer than min_tokens
        generated) the END_TOKEN ids at -inf; repetition_penalty r on every PROMPT_TOKEN or
        generated token (z / r when z > 0, else z * r); presence_penalty + frequency_penalty *
        count subtracted from each generated token's. float32 steps exactly as
        atlas.sampling.penalize_row (no fused multiply-add)."""

    def count_token(self, counts: Tensor, token: Tensor) -> None:
        """counts [V] i32 += 1 at token [1] i32 (the pick just made, still on the device)."""

    def logprob_rows(self, logits: Tensor, tokens: Tensor, top: int, temperature: float = 1.0) -> LogprobTensors:
        """logits [R, V], tokens [R] i32, top 0..1024 -> what atlas.sampling.token_logprob needs of
        each row, in a few floats (log-sum-exp in double, the token's logit and rank, the top ids
        and logits), so a GPU reads back those instead of the rows. The log-sum-exp is of logits /
        temperature (below float32's smallest normal: that), peak / T + log(sum(exp((z - peak) / T)))."""

    def top_ids(self, logits: Tensor, k: int) -> Tensor:
        """logits [1, V] -> [k] i32: the ids of the k (1..1024) largest logits, descending, ties
        the lower id first, NaN never; -1 past what the backend lists (the CUDA kernel lists none
        when more than 4096 logits crowd the top: the caller reads the row instead)."""

    # --- execution ----------------------------------------------------------------------------
    def make_decode_step(self, step: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
        """Wrap the engine's decode step `step(ids [1] i32, positions [1] i32) -> out`. The
        numpy backend returns `step` itself; the CUDA backend captures it once as a CUDA graph
        and replays it (inputs copied into the captured buffers, outputs returned from them), so
        `step` must allocate only through the backend and read positions from the tensor."""
