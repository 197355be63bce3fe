"""Sparse MoE: softmax top-k router, SiLU-gated experts, shared expert scaled by a sigmoid gate."""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.base import Tensor
from .mlp import Mlp
from .step import Step


@dataclass(frozen=True)
class SparseMoe:
    router: Tensor  # [E, H]
    gate_up: Tensor  # [E, 2I, H], gate rows first
    down: Tensor  # [E, H, I]
    shared: Mlp
    shared_gate: Tensor  # [1, H]
    top_k: int
    renormalize: bool

    def __call__(self, step: Step, x: Tensor, name: str) -> Tensor:
        be = step.backend
        if step.dump is not None:  # diagnostics only: the router op keeps its logits to itself
            step.emit(f"{name}.router_logits", be.linear(x, self.router))  # [T, E]
        ids, weights = be.router(x, self.router, self.top_k, self.renormalize)  # [T, k] each
        step.emit(f"{name}.router_ids", ids)
        step.emit(f"{name}.router_weights", weights)
        routed = be.moe_experts(x, ids, weights, self.gate_up, self.down)  # [T, H]
        step.emit(f"{name}.routed", routed)
        shared = step.emit(f"{name}.shared", self.shared(step, x, f"{name}.shared"))  # [T, H]
        gate_logit = be.linear(x, self.shared_gate)  # [T, 1]
        return be.add_sigmoid_scaled(routed, shared, gate_logit)  # [T, H]
