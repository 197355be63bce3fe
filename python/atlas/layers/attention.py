"""Full attention: gated query, per-head q/k RMSNorm, partial rotary, GQA over a KV cache, o_proj."""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.base import Backend, KVCache, Tensor
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
        v = v.reshape(tokens, d.num_kv_heads, d.head_dim)  # [T, Hkv, D]
        q = step.emit(f"{name}.q", self._norm_rope(step, q, w.q_norm))
        k = step.emit(f"{name}.k", self._norm_rope(step, k, w.k_norm))
        v = step.emit(f"{name}.v", v)
        out = be.attention(q, k, v, cache, step.positions, d.head_dim**-0.5)  # [T, Hq, D]
        out = step.emit(f"{name}.core", out.reshape(tokens, d.num_heads * d.head_dim))
        gated = step.emit(f"{name}.gated", be.sigmoid_mul(out, gate))  # [T, Hq*D]
        return be.linear(gated, w.o)  # [T, H]

    def _norm_rope(self, step: Step, x: Tensor, norm: RMSNorm) -> Tensor:
        r = self.rotary
        return step.backend.head_norm_rope(x, norm.weight, step.positions, r.inv_freq, r.scaling, norm.eps)
