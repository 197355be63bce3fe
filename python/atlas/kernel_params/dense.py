"""Params structs of the dense kernels (embedding, norms, linear, rotary, attention, sampling)."""

from __future__ import annotations

import ctypes

ALL_PARAMS: tuple[type[ctypes.Structure], ...] = ()
