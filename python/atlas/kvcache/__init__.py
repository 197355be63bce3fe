"""Quantized KV cache levels (bf16, fp8, nvfp4, turbo8, turbo4, turbo3): numpy reference codecs,
the per-layer plan of `--kv-cache-dtype` / `--kv-high-precision-layers`, and the numpy storage.

Names are imported lazily, so `atlas.kvcache.names` (used by the CLI) does not load numpy."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "KVLevel": "level", "bytes_per_vector": "level", "round_trip": "level",
    "LEVELS": "levels", "get_level": "levels", "LEVEL_NAMES": "names",
    "KVCacheOptions": "options", "describe": "options", "parse_high_precision": "options",
    "QuantizedRows": "storage", "new_states": "storage",
}  # fmt: skip
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
