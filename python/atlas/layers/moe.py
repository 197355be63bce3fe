"""Sparse MoE: softmax top-k router, SiLU-gated experts, shared expert scaled by a sigmoid gate.

When the shared expert has the routed experts' size, the loader stacks it as expert E (and its
gate as router row E): the router adds it as slot k with weight sigmoid(gate logit), and one
moe_experts call runs all k + 1 slots (decode: 4 launches per block instead of 9)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backends.base import Backend, Tensor
from .mlp import Mlp
from .step import Step


@dataclass(frozen=True)
class SharedExpert:
    """The shared expert run on its own (its size differs from the routed experts')."""

    mlp: Mlp
    gate: Tensor  # [1, H]


@dataclass(frozen=True)
class SparseMoe:
    router: Tensor  # [E, H]; [E + 1, H] with the stacked shared expert's gate as row E
    gate_up: Tensor  # [E (+ 1), 2I, H], gate rows first
    down: Tensor  # [E (+ 1), H, I]
    shared: SharedExpert | None  # None: the shared expert is stacked as expert E
    top_k: int
    renormalize: bool

    def __call__(self, step: Step, x: Tensor, name: str) -> Tensor:
        if self.shared is None:
            return self._stacked(step, x, name)
        be = step.backend
        if step.dump is not None:  # diagnostics only: the router op keeps its logits to itself
            step.emit(f"{name}.router_logits", be.linear(x, self.router))  # [T, E]
        ids, weights = be.router(x, self.router, self.top_k, self.renormalize)  # [T, k] each
        ids = step.emit(f"{name}.router_ids", ids)
        weights = step.emit(f"{name}.router_weights", weights)
        routed = step.emit(f"{name}.routed", be.moe_experts(x, ids, weights, self.gate_up, self.down))  # [T, H]
        shared = step.emit(f"{name}.shared", self.shared.mlp(step, x, f"{name}.shared"))  # [T, H]
        gate_logit = be.linear(x, self.shared.gate)  # [T, 1]
        return be.add_sigmoid_scaled(routed, shared, gate_logit)  # [T, H]

    def _stacked(self, step: Step, x: Tensor, name: str) -> Tensor:
        be = step.backend
        routing = be.router(x, self.router, self.top_k, self.renormalize, shared_expert=True)  # [T, k + 1] each
        if step.dump is not None:
            routing = self._emit_routing(step, x, routing, name)
        out = be.moe_experts(x, *routing, self.gate_up, self.down)  # [T, H]
        if step.dump is not None:
            self._emit_parts(step, x, routing, name)
        return out

    def _emit_routing(self, step: Step, x: Tensor, routing: tuple[Tensor, Tensor], name: str) -> tuple[Tensor, Tensor]:
        """The separate path's router names from the stacked routing (dumps only, never in a
        captured step) -> the routing [T, k + 1] with its routed slots as emitted (or fed)."""
        be, k = step.backend, self.top_k
        logits = be.to_numpy(be.linear(x, self.router))  # [T, E + 1]
        ids, weights = (be.to_numpy(t) for t in routing)  # [T, k + 1] each
        step.emit(f"{name}.router_logits", be.upload(logits[:, :-1], "f32"))  # [T, E]
        routed_ids = be.to_numpy(step.emit(f"{name}.router_ids", be.upload(ids[:, :k], "i32")))  # [T, k]
        routed_weights = be.to_numpy(step.emit(f"{name}.router_weights", be.upload(weights[:, :k], "f32")))
        ids = np.concatenate([routed_ids, ids[:, k:]], axis=-1)  # [T, k + 1]
        weights = np.concatenate([routed_weights, weights[:, k:]], axis=-1)
        return be.upload(ids, "i32"), be.upload(weights, "f32")

    def _emit_parts(self, step: Step, x: Tensor, routing: tuple[Tensor, Tensor], name: str) -> None:
        """The routed slots and the shared slot (at weight 1), each through moe_experts."""
        be, k = step.backend, self.top_k
        ids, weights = (be.to_numpy(t) for t in routing)  # [T, k + 1] each
        routed_ids, routed_weights = be.upload(ids[:, :k], "i32"), be.upload(weights[:, :k], "f32")
        step.emit(f"{name}.routed", be.moe_experts(x, routed_ids, routed_weights, self.gate_up, self.down))
        step.emit(f"{name}.shared", self._shared_alone(be, x, ids))  # [T, H]

    def _shared_alone(self, be: Backend, x: Tensor, ids: np.ndarray) -> Tensor:
        """The shared slot at weight 1, the routed slots (distinct experts) at weight 0: the k + 1
        slot call the stacked path makes, since the CUDA tuples instantiate the decode down GEMV
        for k and k + 1 slots only (a one-slot call had no kernel)."""
        weights = np.zeros(ids.shape, np.float32)  # [T, k + 1]
        weights[:, -1] = 1.0
        return be.moe_experts(x, be.upload(ids, "i32"), be.upload(weights, "f32"), self.gate_up, self.down)
