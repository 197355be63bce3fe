"""The decoder stack: embedding, pre-norm residual layers (token mixer + FFN), final norm, lm_head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..backends.base import Backend, Tensor
from .embedding import Embedding, LMHead
from .norm import RMSNorm
from .rotary import Rotary
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
    rotary: Rotary  # the frequency table every attention layer (and the MTP head's) reads

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
            update, residual = self._layer_body(step, i, step.emit(f"{name}.input_norm", normed), residual, states[i])
        assert update is not None, "a model has at least one layer"
        normed, residual = self.final_norm.add(step, update, residual)
        step.emit(f"layer.{len(self.layers) - 1}.out", residual)
        return step.emit("final_norm", normed)

    def _layer_body(self, step: Step, i: int, normed: Tensor, residual: Tensor, state: Any) -> tuple[Tensor, Tensor]:
        """Layer i after its input norm -> (the FFN's output [T, H], the residual it adds to [T, H])."""
        layer, name = self.layers[i], f"layer.{i}"
        mixed = step.emit(f"{name}.attn_out", layer.mixer(step, normed, state, f"{name}.attn"))
        normed, residual = layer.post_norm.add(step, mixed, residual)
        normed = step.emit(f"{name}.post_norm", normed)
        return step.emit(f"{name}.mlp_out", layer.ffn(step, normed, f"{name}.mlp")), residual

    def run_layer(self, step: Step, i: int, residual: Tensor, state: Any) -> None:
        """Layer i alone on a given residual stream [T, H] (its input, `layer.{i-1}.out` of some
        run), emitting its intermediates and `layer.{i}.out`; atlas.cross_check isolates each
        layer with it."""
        normed = step.emit(f"layer.{i}.input_norm", self.layers[i].input_norm(step, residual))
        update, residual = self._layer_body(step, i, normed, residual, state)
        step.emit(f"layer.{i}.out", self.final_norm.add(step, update, residual)[1])

    def logits(self, step: Step, hidden: Tensor) -> Tensor:
        return step.emit("logits", self.lm_head(step, hidden))  # [T, V]
