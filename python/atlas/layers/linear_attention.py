"""Gated DeltaNet: projections, causal conv with carried state, the gated delta rule, gated norm."""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.base import Backend, Tensor
from .norm import RMSNorm
from .split_linear import SplitLinear
from .step import Step


@dataclass(frozen=True)
class DeltaNetDims:
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


@dataclass(frozen=True)
class DeltaNetWeights:
    in_proj: SplitLinear  # parts in_proj_qkv [C], in_proj_z [Hv*Dv], in_proj_b [Hv], in_proj_a [Hv]
    conv: Tensor  # [C, K]
    A_log: Tensor  # [Hv]
    dt_bias: Tensor  # [Hv]
    norm: RMSNorm  # [Dv], used as stored (not zero-centred)
    out: Tensor  # [H, Hv*Dv]


@dataclass
class DeltaNetState:
    conv: Tensor  # [C, K-1], the previous K-1 conv inputs, oldest first
    recurrent: Tensor  # [Hv, Dk, Dv]


@dataclass(frozen=True)
class GatedDeltaNet:
    weights: DeltaNetWeights
    dims: DeltaNetDims

    def new_state(self, backend: Backend, capacity: int) -> DeltaNetState:
        d = self.dims
        return DeltaNetState(
            backend.zeros((d.conv_channels, d.conv_kernel - 1), "f32"),
            backend.zeros((d.num_v_heads, d.k_head_dim, d.v_head_dim), "f32"),
        )

    def __call__(self, step: Step, x: Tensor, state: DeltaNetState, name: str) -> Tensor:
        be, w, d = step.backend, self.weights, self.dims
        tokens = x.shape[0]
        mixed, z, b, a = w.in_proj(be, x)  # [T, C], [T, Hv*Dv], [T, Hv], [T, Hv]
        z = z.reshape(tokens, d.num_v_heads, d.v_head_dim)  # [T, Hv, Dv]
        mixed = step.emit(f"{name}.conv", be.causal_conv1d(mixed, w.conv, state.conv))  # [T, C]
        core = be.gated_delta_rule(mixed, a, b, w.A_log, w.dt_bias, state.recurrent, d.num_k_heads)
        step.emit(f"{name}.core", core)  # [T, Hv, Dv]
        normed = be.gated_rms_norm(core, z, w.norm.weight, w.norm.eps)  # [T, Hv, Dv]
        normed = step.emit(f"{name}.gated_norm", normed.reshape(tokens, d.num_v_heads * d.v_head_dim))
        return be.linear(normed, w.out)  # [T, H]
