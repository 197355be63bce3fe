"""Argument builders for ops that take a layer's operands as one object."""

from __future__ import annotations

from typing import Any

from atlas.backends.base import DeltaNetOperands


def delta_rule_operands(A_log: Any, dt_bias: Any, state: Any, num_k_heads: int) -> DeltaNetOperands:
    """The operands `Backend.gated_delta_rule` reads; those of the conv and the gated norm stay empty."""
    return DeltaNetOperands(conv_weight=None, A_log=A_log, dt_bias=dt_bias, norm_weight=None, norm_eps=0.0,
                            conv_state=None, recurrent_state=state, num_k_heads=num_k_heads)
