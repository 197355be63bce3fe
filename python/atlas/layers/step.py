"""What every layer needs for one forward step: the backend, the positions, the dump hook and
(atlas.cross_check only) the intermediates to feed in place of the step's own."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..backends.base import Backend, Tensor

Dump = Callable[[str, Tensor], None]


@dataclass(frozen=True)
class Step:
    backend: Backend
    positions: Tensor  # [T] i32, consecutive
    dump: Dump | None = None  # receives every named intermediate, e.g. "layer.3.attn_out"
    feed: Mapping[str, Tensor] | None = None  # name -> the tensor the layers go on with instead

    def emit(self, name: str, tensor: Tensor) -> Tensor:
        """Dump `tensor` under `name`; the layers go on with what this returns: `tensor`, or the
        one fed under that name (cross_check isolates each op by feeding another run's inputs)."""
        if self.dump is not None:
            self.dump(name, tensor)
        if self.feed is not None and name in self.feed:
            return self.feed[name]
        return tensor
