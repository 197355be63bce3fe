"""The decoder stack: embedding, pre-norm residual layers (token mixer + FFN), final norm, lm_head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..backends.base import Backend, Tensor
from .embedding import Embedding, LMHead
from .norm import RMSNorm
from .step import Step


class TokenMixer(Protocol):
    def new_state(self, backend: Backend, capacity: int) -> Any: ...

    def __call__(self, step: Step, x: Tensor, state: Any, name: str) -> Tensor: ...


class FeedForward(Protocol):
    def __call__(self, step: Step, x: Tensor, name: str) -> Tensor: ...


@dataclass(frozen=True)
class DecoderLayer:
    input_norm: RMSNorm
    mixer: TokenMixer  # Attention or GatedDeltaNet
    post_norm: RMSNorm
    ffn: FeedForward  # SparseMoe or Mlp


@dataclass(frozen=True)
class CausalLM:
    embed: Embedding
    layers: tuple[DecoderLayer, ...]
    final_norm: RMSNorm
    lm_head: LMHead

    def forward(self, step: Step, ids: Tensor, states: list[Any]) -> Tensor:
        """ids [T] i32 -> final-normed hidden states [T, H]; states are updated in place."""
        residual = step.emit("embed", self.embed(step, ids))  # [T, H]
        update: Tensor | None = None
        for i, layer in enumerate(self.layers):
            name = f"layer.{i}"
            if update is None:
                normed = layer.input_norm(step, residual)
            else:
                normed, residual = layer.input_norm.add(step, update, residual)
                step.emit(f"layer.{i - 1}.out", residual)
            step.emit(f"{name}.input_norm", normed)
            mixed = step.emit(f"{name}.attn_out", layer.mixer(step, normed, states[i], f"{name}.attn"))
            normed, residual = layer.post_norm.add(step, mixed, residual)
            step.emit(f"{name}.post_norm", normed)
            update = step.emit(f"{name}.mlp_out", layer.ffn(step, normed, f"{name}.mlp"))
        assert update is not None, "a model has at least one layer"
        normed, residual = self.final_norm.add(step, update, residual)
        step.emit(f"layer.{len(self.layers) - 1}.out", residual)
        return step.emit("final_norm", normed)

    def logits(self, step: Step, hidden: Tensor) -> Tensor:
        return step.emit("logits", self.lm_head(step, hidden))  # [T, V]
