"""Token embedding and the output projection (tied or not)."""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.base import Tensor
from .step import Step


@dataclass(frozen=True)
class Embedding:
    table: Tensor  # [V, H]

    def __call__(self, step: Step, ids: Tensor) -> Tensor:
        return step.backend.embedding(self.table, ids)  # [T, H]


@dataclass(frozen=True)
class LMHead:
    weight: Tensor  # [V, H], the embedding table itself when tied

    def __call__(self, step: Step, hidden: Tensor) -> Tensor:
        return step.backend.linear(hidden, self.weight)  # [T, V]
