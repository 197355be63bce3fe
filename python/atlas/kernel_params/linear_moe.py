"""Params structs of the linear-attention (conv, delta rule, gated norm) and MoE kernels."""

from __future__ import annotations

import ctypes

ALL_PARAMS: tuple[type[ctypes.Structure], ...] = ()
