"""What every layer needs for one forward step: the backend, the positions and the dump hook."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..backends.base import Backend, Tensor

Dump = Callable[[str, Tensor], None]


@dataclass(frozen=True)
class Step:
    backend: Backend
    positions: Tensor  # [T] i32, consecutive
    dump: Dump | None = None  # receives every named intermediate, e.g. "layer.3.attn_out"

    def emit(self, name: str, tensor: Tensor) -> Tensor:
        if self.dump is not None:
            self.dump(name, tensor)
        return tensor
