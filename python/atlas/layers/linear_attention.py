"""Gated DeltaNet: projections, causal conv with carried state, the gated delta rule, gated norm.

Without a dump the conv, delta rule and gated norm run as one backend op (`gated_delta_net`: the
CUDA backend may fuse a decode step into one kernel); with a dump attached as the three ops, so
their intermediates (.conv, .core) can be emitted, except where the backend fuses: a dump then
checks the kernel that serves, and has only its output (.gated_norm) for that step."""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.base import Backend, DeltaNetInputs, DeltaNetOperands, Tensor, compose_gated_delta_net
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
        be, d = step.backend, self.dims
        tokens = x.shape[0]
        parts = self.weights.in_proj(be, x)  # [T, C], [T, Hv*Dv], [T, Hv], [T, Hv]
        mixed, z, b, a = (step.emit(f"{name}.{part}", t) for part, t in zip(("qkv", "z", "b", "a"), parts))
        inputs = DeltaNetInputs(mixed, z.reshape(tokens, d.num_v_heads, d.v_head_dim), a, b)
        if step.dump is None or be.fuses_gated_delta_net(tokens):
            normed = be.gated_delta_net(inputs, self.operands(state))  # [T, Hv, Dv]
        else:  # the three ops apart, the conv output and the delta rule's emitted
            normed = compose_gated_delta_net(be, inputs, self.operands(state),
                                             lambda part, t: step.emit(f"{name}.{part}", t))
        normed = step.emit(f"{name}.gated_norm", normed.reshape(tokens, d.num_v_heads * d.v_head_dim))
        return be.linear(normed, self.weights.out)  # [T, H]

    def operands(self, state: DeltaNetState) -> DeltaNetOperands:
        w = self.weights
        return DeltaNetOperands(w.conv, w.A_log, w.dt_bias, w.norm.weight, w.norm.eps, state.conv, state.recurrent,
                                self.dims.num_k_heads)
