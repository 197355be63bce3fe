"""SiLU-gated MLP (the MoE shared expert; a dense FFN for dense families)."""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.base import Tensor
from .step import Step


@dataclass(frozen=True)
class Mlp:
    gate_up: Tensor  # [2I, H], gate rows first
    down: Tensor  # [H, I]

    def __call__(self, step: Step, x: Tensor, name: str) -> Tensor:
        be = step.backend
        hidden = step.emit(f"{name}.act", be.silu_mul(be.linear(x, self.gate_up)))  # [T, I]
        return be.linear(hidden, self.down)  # [T, H]
