"""Quantized KV cache levels (bf16, fp8, nvfp4, turbo8, turbo4, turbo3): numpy reference codecs,
the per-layer plan of `--kv-cache-dtype` / `--kv-high-precision-layers`, and the numpy storage."""

from __future__ import annotations

from .level import KVLevel, bytes_per_vector, round_trip
from .levels import LEVEL_NAMES, LEVELS, get_level
from .options import KVCacheOptions, describe, parse_high_precision
from .storage import QuantizedRows, apply_kv_levels

__all__ = [
    "KVLevel", "bytes_per_vector", "round_trip", "LEVEL_NAMES", "LEVELS", "get_level",
    "KVCacheOptions", "describe", "parse_high_precision", "QuantizedRows", "apply_kv_levels",
]
