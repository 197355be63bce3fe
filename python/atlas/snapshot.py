"""Copies of backend tensors that outlive a step: the DeltaNet states' snapshots (speculative
rollback, prompt-cache checkpoints) and persistent rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .backends.base import Backend, Tensor
from .errors import AtlasError
from .layers.linear_attention import DeltaNetState


def copy_tensor(backend: Backend, dst: Tensor, src: Tensor) -> None:
    """dst[...] = src (same shape): the backend's `copy` op, or numpy's for numpy tensors."""
    copy = getattr(backend, "copy", None)
    if callable(copy):
        copy(dst, src)
    elif isinstance(dst, np.ndarray):
        np.copyto(dst, np.asarray(src))
    else:
        raise AtlasError(
            f"the {backend.name} backend has no copy op, which speculative decoding and the prompt "
            "cache need; run with --no-spec and --prompt-cache 0"
        )


def persist(backend: Backend, t: Tensor) -> Tensor:
    """A copy of a step tensor that outlives the step (GPU step memory is recycled)."""
    out = backend.zeros(tuple(t.shape), "f32")
    copy_tensor(backend, out, t)
    return out


@dataclass
class DeltaNetSnapshot:
    """Copies of every DeltaNet conv + recurrent state (before a verify pass, at a prompt-cache
    checkpoint): the one part of a model's state that cannot be rolled back."""

    backend: Backend
    saved: list[tuple[int, Tensor, Tensor]] = field(default_factory=list)  # (layer, conv, recurrent)

    @classmethod
    def for_states(cls, backend: Backend, states: list[Any]) -> DeltaNetSnapshot:
        saved = [
            (i, backend.zeros(tuple(s.conv.shape), "f32"), backend.zeros(tuple(s.recurrent.shape), "f32"))
            for i, s in enumerate(states)
            if isinstance(s, DeltaNetState)
        ]
        return cls(backend, saved)

    def take(self, states: list[Any]) -> None:
        for i, conv, recurrent in self.saved:
            copy_tensor(self.backend, conv, states[i].conv)
            copy_tensor(self.backend, recurrent, states[i].recurrent)

    def restore(self, states: list[Any]) -> None:
        for i, conv, recurrent in self.saved:
            copy_tensor(self.backend, states[i].conv, conv)
            copy_tensor(self.backend, states[i].recurrent, recurrent)
