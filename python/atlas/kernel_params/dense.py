"""Params structs of the dense kernels (embedding, norms, linear, rotary, attention, sampling).

Pointer fields are device addresses (c_void_p -> void*); the kernel documents the element type.
Anything that changes per decode token (ids, positions) is read by the kernels from device memory,
so a captured CUDA graph stays valid; the scalar fields here are fixed for a given step shape.
"""

from __future__ import annotations

import ctypes

c_ptr = ctypes.c_void_p
c_i32 = ctypes.c_int32
c_f32 = ctypes.c_float


class EmbeddingParams(ctypes.Structure):
    """atlas_embedding_{bf16,f32}: out[t, :] = table[ids[t], :] (zeros for an id outside [0, vocab))."""

    _fields_ = [
        ("table", c_ptr),  # [vocab, hidden] bf16 or f32
        ("ids", c_ptr),  # [tokens] i32
        ("out", c_ptr),  # [tokens, hidden] f32
        ("tokens", c_i32),
        ("hidden", c_i32),
        ("vocab", c_i32),
    ]


class RmsNormParams(ctypes.Structure):
    """atlas_rms_norm / atlas_add_rms_norm: one block per row of `dim` f32 values."""

    _fields_ = [
        ("x", c_ptr),  # [rows, dim] f32
        ("residual", c_ptr),  # [rows, dim] f32 (add_rms_norm only)
        ("weight", c_ptr),  # [dim] f32
        ("out", c_ptr),  # [rows, dim] f32: rms_norm(x (+ residual)) * weight
        ("sum_out", c_ptr),  # [rows, dim] f32: x + residual (add_rms_norm only)
        ("rows", c_i32),
        ("dim", c_i32),
        ("eps", c_f32),
    ]


class AddParams(ctypes.Structure):
    """atlas_add: out = x + y over n f32 elements."""

    _fields_ = [("x", c_ptr), ("y", c_ptr), ("out", c_ptr), ("n", c_i32)]


class SiluMulParams(ctypes.Structure):
    """atlas_silu_mul: gate_up [rows, 2*width] (gate first) -> out [rows, width] f32."""

    _fields_ = [("gate_up", c_ptr), ("out", c_ptr), ("rows", c_i32), ("width", c_i32)]


class SigmoidMulParams(ctypes.Structure):
    """atlas_sigmoid_mul: out = x * sigmoid(gate) over n f32 elements."""

    _fields_ = [("x", c_ptr), ("gate", c_ptr), ("out", c_ptr), ("n", c_i32)]


class NonfiniteCountParams(ctypes.Structure):
    """atlas_nonfinite_count: out[0] = the NaN and infinite values among n f32 (one block)."""

    _fields_ = [("x", c_ptr), ("out", c_ptr), ("n", c_i32)]  # out: [1] i32


class LinearParams(ctypes.Structure):
    """atlas_gemv_t{1..8} / atlas_gemv_narrow_t{1..8} (tokens <= 8) and atlas_gemm_bf16
    (tokens > 8): out = x @ weight.T."""

    _fields_ = [
        ("x", c_ptr),  # [tokens, k] f32, rows 16-byte aligned (k % 8 == 0)
        ("weight", c_ptr),  # [n, k] bf16
        ("out", c_ptr),  # [tokens, n] f32
        ("tokens", c_i32),
        ("n", c_i32),
        ("k", c_i32),
        ("prefetch_blocks", c_i32),  # GEMV: its first blocks pull their weight rows into L2 before pdl_enter
    ]


class LinearNormParams(ctypes.Structure):
    """atlas_gemv_norm_t1 / atlas_gemv_norm_narrow_t1 (one token, ATLAS_NORM=fused): the linear
    of add_rms_norm's output with the norm taken in. Each block computes norm's row 0 (dim == k)
    itself and block 0 writes norm.out and norm.sum_out as atlas_add_rms_norm would; linear.x is
    unused."""

    _fields_ = [("linear", LinearParams), ("norm", RmsNormParams)]


class HeadNormRopeParams(ctypes.Structure):
    """atlas_head_norm_rope: one warp per (token, head); dynamic smem = warps * head_dim * 4."""

    _fields_ = [
        ("x", c_ptr),  # [tokens, heads, head_dim] f32
        ("weight", c_ptr),  # [head_dim] f32
        ("positions", c_ptr),  # [tokens] i32
        ("inv_freq", c_ptr),  # [rotary_dim / 2] f32: pair i turns by position * inv_freq[i]
        ("out", c_ptr),  # [tokens, heads, head_dim] f32
        ("tokens", c_i32),
        ("heads", c_i32),
        ("head_dim", c_i32),
        ("rotary_dim", c_i32),
        ("scaling", c_f32),  # cos and sin are multiplied by it (YaRN's attention factor)
        ("eps", c_f32),
    ]


class AttentionPrepParams(ctypes.Structure):
    """atlas_attention_prep: atlas_head_norm_rope of q and of k, then atlas_kv_cache_write of the
    rotated k and of v, in one launch: one warp per (token, q head), then per (token, kv head);
    dynamic smem = warps * head_dim * 4."""

    _fields_ = [
        ("q", c_ptr),  # [tokens, q_heads, head_dim] f32
        ("k", c_ptr),  # [tokens, kv_heads, head_dim] f32
        ("v", c_ptr),  # [tokens, kv_heads, head_dim] f32
        ("q_weight", c_ptr),  # [head_dim] f32
        ("k_weight", c_ptr),  # [head_dim] f32
        ("positions", c_ptr),  # [tokens] i32
        ("inv_freq", c_ptr),  # [rotary_dim / 2] f32
        ("q_out", c_ptr),  # [tokens, q_heads, head_dim] f32
        ("k_cache", c_ptr),  # [capacity, kv_heads, head_dim] bf16
        ("v_cache", c_ptr),  # [capacity, kv_heads, head_dim] bf16
        ("tokens", c_i32),
        ("q_heads", c_i32),
        ("kv_heads", c_i32),
        ("head_dim", c_i32),
        ("rotary_dim", c_i32),
        ("capacity", c_i32),
        ("scaling", c_f32),
        ("q_eps", c_f32),
        ("k_eps", c_f32),
    ]


class KvCacheWriteParams(ctypes.Structure):
    """atlas_kv_cache_write: cache[positions[t], h, :] = bf16(k[t, h, :]) for k and v."""

    _fields_ = [
        ("k", c_ptr),  # [tokens, kv_heads, head_dim] f32
        ("v", c_ptr),  # [tokens, kv_heads, head_dim] f32
        ("k_cache", c_ptr),  # [capacity, kv_heads, head_dim] bf16
        ("v_cache", c_ptr),  # [capacity, kv_heads, head_dim] bf16
        ("positions", c_ptr),  # [tokens] i32
        ("tokens", c_i32),
        ("kv_heads", c_i32),
        ("head_dim", c_i32),
        ("capacity", c_i32),
    ]


class AttentionParams(ctypes.Structure):
    """atlas_attention: grid (num_splits, kv_heads, row tiles); each block attends its rows
    (token, q head of this kv head) over cache keys [split * span, (split + 1) * span), causal by
    positions; span = 32 * ceil(live / (32 * splits)) with live = positions[tokens-1] + 1 read
    on the device. With ml == NULL (one split) it writes the normalised output [tokens, q_heads, D];
    otherwise per split the normalised partial o [splits, tokens, q_heads, D] and (max, sum)
    in ml [splits, tokens, q_heads, 2] for atlas_attention_combine.
    atlas_attention_prefill_mma takes the same struct with ml == NULL: grid (row tiles of 64,
    kv_heads), keys [0, largest position of its rows + 1), output [tokens, q_heads, D]."""

    _fields_ = [
        ("q", c_ptr),  # [tokens, q_heads, head_dim] f32
        ("k_cache", c_ptr),  # [capacity, kv_heads, head_dim] bf16
        ("v_cache", c_ptr),  # [capacity, kv_heads, head_dim] bf16
        ("positions", c_ptr),  # [tokens] i32, consecutive
        ("out", c_ptr),  # f32, see above
        ("ml", c_ptr),  # f32 or NULL
        ("tokens", c_i32),
        ("q_heads", c_i32),
        ("kv_heads", c_i32),
        ("head_dim", c_i32),  # must equal the compiled atlas::model::head_dim
        ("capacity", c_i32),
        ("scale", c_f32),
    ]


class AttentionCombineParams(ctypes.Structure):
    """atlas_attention_combine: one block per (token, q head) merges the live splits."""

    _fields_ = [
        ("partial", c_ptr),  # [splits, tokens, q_heads, head_dim] f32
        ("ml", c_ptr),  # [splits, tokens, q_heads, 2] f32
        ("positions", c_ptr),  # [tokens] i32
        ("out", c_ptr),  # [tokens, q_heads, head_dim] f32
        ("gate", c_ptr),  # [tokens, q_heads, head_dim] f32: out times sigmoid(gate), the output gate; null: ungated
        ("tokens", c_i32),
        ("q_heads", c_i32),
        ("head_dim", c_i32),
        ("capacity", c_i32),
        ("num_splits", c_i32),  # the attention grid's x
    ]


class ArgmaxParams(ctypes.Structure):
    """atlas_argmax_partial (grid (chunks, rows)) then atlas_argmax_final (grid (rows,))."""

    _fields_ = [
        ("logits", c_ptr),  # [rows, vocab] f32
        ("partial_value", c_ptr),  # [rows, chunks] f32
        ("partial_index", c_ptr),  # [rows, chunks] i32
        ("out", c_ptr),  # [rows] i32
        ("rows", c_i32),
        ("vocab", c_i32),
        ("chunk", c_i32),  # logits per partial block
        ("chunks", c_i32),
    ]


class SampleParams(ctypes.Structure):
    """atlas_sample: one block draws one token from logits [1, vocab] (base.py's sort-free rule);
    the split form's five launches (atlas_sample_units ... atlas_sample_pick) the same draw."""

    _fields_ = [
        ("logits", c_ptr),  # [vocab] f32
        ("probs", c_ptr),  # [vocab] f32 scratch: softmax(logits / temperature)
        ("scratch", c_ptr),  # [SAMPLE_SCRATCH_BYTES] the split form's per-unit sums and candidates; null for one block
        ("out", c_ptr),  # [1] i32
        ("vocab", c_i32),
        ("top_k", c_i32),  # 0 = off
        ("temperature", c_f32),  # > 0
        ("top_p", c_f32),  # (0, 1]
        ("uniform", c_f32),  # [0, 1)
        ("min_p", c_f32),  # [0, 1]; 0 = off
    ]


class PenalizeParams(ctypes.Structure):
    """atlas_penalize (grid ceil(vocab / 256)): out = logits with logit_bias, the ending ids'
    mask, repetition, presence and frequency penalties applied (atlas.sampling.penalize_row)."""

    _fields_ = [
        ("logits", c_ptr),  # [vocab] f32
        ("out", c_ptr),  # [vocab] f32
        ("counts", c_ptr),  # [vocab] i32: times each token was generated
        ("flags", c_ptr),  # [vocab] i32: 1 in the prompt, 2 ends a generation
        ("bias", c_ptr),  # [vocab] f32 logit_bias, or null
        ("vocab", c_i32),
        ("mask_ends", c_i32),  # 1: the ending ids at -inf (fewer than min_tokens generated)
        ("repetition", c_f32),  # > 0; 1 = off
        ("presence", c_f32),
        ("frequency", c_f32),
    ]


class TopIdsParams(ctypes.Structure):
    """atlas_top_ids (one block of 1024): the ids of the k largest logits, descending."""

    _fields_ = [
        ("logits", c_ptr),  # [vocab] f32
        ("ids", c_ptr),  # [k] i32: -1 past what it lists
        ("vocab", c_i32),
        ("k", c_i32),  # 1..1024
    ]


class LogprobParams(ctypes.Structure):
    """atlas_logprob_rows (a block of 1024 per row): what a row's token log-probabilities need."""

    _fields_ = [
        ("logits", c_ptr),  # [rows, vocab] f32
        ("tokens", c_ptr),  # [rows] i32: the token each row scores (in 0..vocab-1)
        ("lse", c_ptr),  # [rows, 2] f32: log-sum-exp as hi + lo
        ("picked", c_ptr),  # [rows] f32: the token's logit (NaN as -inf)
        ("ranks", c_ptr),  # [rows] i32: the logits at or above the token's (NaN as -inf), itself included
        ("ids", c_ptr),  # [rows, k] i32: the top k ids, -1 past what is listed
        ("values", c_ptr),  # [rows, k] f32: their logits
        ("rows", c_i32),
        ("vocab", c_i32),
        ("k", c_i32),  # 0..1024
        ("temperature", c_f32),  # the log-sum-exp is of logits / temperature (below FLT_MIN: FLT_MIN)
    ]


class CountTokenParams(ctypes.Structure):
    """atlas_count_token (one warp): counts[*token] += 1 for a token inside [0, vocab)."""

    _fields_ = [
        ("counts", c_ptr),  # [vocab] i32
        ("token", c_ptr),  # [1] i32
        ("vocab", c_i32),
    ]


ALL_PARAMS: tuple[type[ctypes.Structure], ...] = (
    EmbeddingParams,
    RmsNormParams,
    AddParams,
    SiluMulParams,
    SigmoidMulParams,
    NonfiniteCountParams,
    LinearParams,
    LinearNormParams,
    HeadNormRopeParams,
    AttentionPrepParams,
    KvCacheWriteParams,
    AttentionParams,
    AttentionCombineParams,
    ArgmaxParams,
    SampleParams,
    PenalizeParams,
    CountTokenParams,
    TopIdsParams,
    LogprobParams,
)
