"""RMSNorm weights as the kernels use them (zero-centred checkpoints are stored as 1 + w)."""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.base import Tensor
from .step import Step


@dataclass(frozen=True)
class RMSNorm:
    weight: Tensor  # [D]
    eps: float

    def __call__(self, step: Step, x: Tensor) -> Tensor:
        return step.backend.rms_norm(x, self.weight, self.eps)

    def add(self, step: Step, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(norm(x + residual), x + residual)."""
        return step.backend.add_rms_norm(x, residual, self.weight, self.eps)
