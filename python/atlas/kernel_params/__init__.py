"""The kernel ABI: one ctypes params struct per kernel, passed by value.

The build renders `atlas_params.cuh` from ALL_PARAMS, and the CUDA backend packs the same
structs, so the C and Python layouts cannot drift apart.
"""

from __future__ import annotations

import ctypes

from . import delta_decode, dense, linear_moe, quant

ALL_PARAMS: tuple[type[ctypes.Structure], ...] = (
    *dense.ALL_PARAMS, *linear_moe.ALL_PARAMS, *delta_decode.ALL_PARAMS, *quant.ALL_PARAMS
)
