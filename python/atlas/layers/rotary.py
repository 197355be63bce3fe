"""Partial rotary embedding settings (mrope with equal text positions reduces to plain rope)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rotary:
    rotary_dim: int  # head_dim * partial_rotary_factor: the leading dims that rotate
    theta: float
