"""Several linears of one input, fused row-wise (nano-vllm's QKVParallelLinear idea): a layer's
input projections are stored as one weight per storage format, run as one `linear_split` each,
and handed back in their original order."""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.base import Backend, Tensor


@dataclass(frozen=True)
class WeightGroup:
    weight: Tensor  # [sum(widths), K]
    widths: tuple[int, ...]  # rows of each part, in row order
    parts: tuple[int, ...]  # the position of each part among the SplitLinear's outputs


@dataclass(frozen=True)
class SplitLinear:
    """Outputs 0..n-1, computed by the groups (one group when every part has the same storage)."""

    groups: tuple[WeightGroup, ...]

    def __post_init__(self) -> None:
        order = sorted(i for g in self.groups for i in g.parts)
        if order != list(range(len(order))) or any(len(g.widths) != len(g.parts) for g in self.groups):
            raise ValueError(f"SplitLinear groups do not cover parts 0..n-1 once each: {[g.parts for g in self.groups]}")

    @classmethod
    def single(cls, weight: Tensor, widths: tuple[int, ...]) -> SplitLinear:
        """One weight holding every part, in output order."""
        return cls((WeightGroup(weight, widths, tuple(range(len(widths)))),))

    @property
    def widths(self) -> tuple[int, ...]:
        by_part = {i: w for g in self.groups for i, w in zip(g.parts, g.widths)}
        return tuple(by_part[i] for i in range(len(by_part)))

    def __call__(self, backend: Backend, x: Tensor) -> list[Tensor]:
        """x [T, K] -> one [T, width] tensor per part."""
        outputs: dict[int, Tensor] = {}
        for group in self.groups:
            outputs.update(zip(group.parts, backend.linear_split(x, group.weight, group.widths)))
        return [outputs[i] for i in range(len(outputs))]
