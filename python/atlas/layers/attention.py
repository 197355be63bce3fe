"""Full attention: gated query, per-head q/k RMSNorm, partial rotary, GQA over a KV cache, o_proj.

Without a dump the head norms, rotary and attention run as one backend op (`full_attention`: the
CUDA backend may fuse the norms, rotary and cache write into one kernel); with a dump attached as
their ops, so the rotated q and k (.q, .k) can be emitted, except where the backend fuses."""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.base import AttentionInputs, AttentionOperands, Backend, KVCache, Tensor, compose_full_attention
from .norm import RMSNorm
from .rotary import Rotary
from .split_linear import SplitLinear
from .step import Step


@dataclass(frozen=True)
class AttentionDims:
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class AttentionWeights:
    qgkv: SplitLinear  # parts q [Hq*D], gate [Hq*D] (the halves of q_proj), k [Hkv*D], v [Hkv*D]
    o: Tensor  # [H, Hq*D]
    q_norm: RMSNorm  # [D]
    k_norm: RMSNorm  # [D]


@dataclass(frozen=True)
class Attention:
    weights: AttentionWeights
    dims: AttentionDims
    rotary: Rotary

    def cache_shape(self, capacity: int) -> tuple[int, int, int]:
        return (capacity, self.dims.num_kv_heads, self.dims.head_dim)

    def new_state(self, backend: Backend, capacity: int) -> KVCache:
        shape = self.cache_shape(capacity)
        return KVCache(backend.zeros(shape, "bf16"), backend.zeros(shape, "bf16"))

    def __call__(self, step: Step, x: Tensor, cache: KVCache, name: str) -> Tensor:
        be, w, d = step.backend, self.weights, self.dims
        tokens = x.shape[0]
        q, gate, k, v = w.qgkv(be, x)  # [T, Hq*D] x 2, [T, Hkv*D] x 2
        q = q.reshape(tokens, d.num_heads, d.head_dim)  # [T, Hq, D]
        k = k.reshape(tokens, d.num_kv_heads, d.head_dim)  # [T, Hkv, D]
        v = step.emit(f"{name}.v", v.reshape(tokens, d.num_kv_heads, d.head_dim))  # [T, Hkv, D]
        operands = self.operands(cache)
        if step.dump is None:  # the gate goes in too: a fused form applies it in its last kernel
            inputs = AttentionInputs(q, k, v, step.positions, gate.reshape(q.shape))
            gated = be.full_attention(inputs, operands).reshape(tokens, d.num_heads * d.head_dim)  # [T, Hq*D]
            return be.linear(gated, w.o)  # [T, H]
        inputs = AttentionInputs(q, k, v, step.positions)
        if be.fuses_full_attention(cache):
            out = be.full_attention(inputs, operands)  # [T, Hq, D]
        else:  # the ops apart, the rotated q and k emitted
            out = compose_full_attention(be, inputs, operands, lambda part, t: step.emit(f"{name}.{part}", t))
        out = step.emit(f"{name}.core", out.reshape(tokens, d.num_heads * d.head_dim))
        gated = step.emit(f"{name}.gated", be.sigmoid_mul(out, gate))  # [T, Hq*D]
        return be.linear(gated, w.o)  # [T, H]

    def operands(self, cache: KVCache) -> AttentionOperands:
        w, r = self.weights, self.rotary
        return AttentionOperands(w.q_norm.weight, w.k_norm.weight, w.q_norm.eps, w.k_norm.eps, r.inv_freq, r.scaling,
                                 cache, self.dims.head_dim**-0.5)
