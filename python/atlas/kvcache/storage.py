"""KV cache storage of the quantized levels for the numpy backend.

`QuantizedRows` stands in for a [S, Hkv, D] cache tensor: a row write (`cache[a:b] = k`, as
NumpyBackend.attention does) encodes the rows with the level into packed fields, and a row read
(`cache[:L]`) returns the decoded float32 rows, so attention sees exactly what the level stores.
Decoded rows are kept beside the packed fields (decoding is deterministic, so they always equal
decode(packed)); `nbytes` counts the packed storage only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import AtlasError
from ..backends.base import KVCache
from ..layers.attention import Attention
from ..layers.decoder import DecoderLayer
from .level import KVLevel
from .levels import get_level
from .names import DEFAULT_LEVEL


class QuantizedRows:
    def __init__(self, level: KVLevel, shape: tuple[int, int, int]) -> None:
        capacity, heads, dim = shape
        self.level = level
        self.shape = shape
        self.fields = {
            name: np.zeros((capacity, heads, *field_shape), dtype=dt)
            for name, (field_shape, dt) in level.layout(dim).items()
        }
        self.decoded = np.zeros(shape, dtype=np.float32)  # [S, Hkv, D]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.fields.values())

    def __setitem__(self, rows: slice, values: np.ndarray) -> None:
        tokens = values.shape[0]
        flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, self.shape[2])  # [T*Hkv, D]
        encoded = self.level.encode(flat)
        for name, array in encoded.items():
            self.fields[name][rows] = array.reshape(tokens, self.shape[1], *array.shape[1:])
        self.decoded[rows] = self.level.decode(encoded).reshape(values.shape)

    def __getitem__(self, rows: slice) -> np.ndarray:
        return self.decoded[rows]

    def stored_rows(self, stop: int) -> dict[str, np.ndarray]:
        """Rows 0..stop-1 as stored: a copy of each packed field [stop, Hkv, ...]."""
        return {name: array[:stop].copy() for name, array in self.fields.items()}

    def write_stored_rows(self, fields: dict[str, np.ndarray]) -> None:
        """The inverse of stored_rows: rows 0.. of each field, and their decoded rows."""
        tokens = len(next(iter(fields.values())))
        for name, array in fields.items():
            self.fields[name][:tokens] = array
        flat = {name: array.reshape(tokens * self.shape[1], *array.shape[2:]) for name, array in fields.items()}
        self.decoded[:tokens] = self.level.decode(flat).reshape(tokens, *self.shape[1:])


def new_states(layers: Sequence[DecoderLayer], backend: Any, capacity: int, plan: list[str | None]) -> list[Any]:
    """One state per layer, as each mixer's `new_state` makes it, except that a full-attention layer
    whose level is not bf16 gets its K and V made directly in that level's storage (QuantizedRows on
    the numpy backend, the backend's own `quantized_kv_cache(level, shape)` on the others): a bf16
    cache made first and swapped out would cost its full size at the peak."""
    states: list[Any] = []
    for layer, level in zip(layers, plan, strict=True):
        if level is None or level == DEFAULT_LEVEL:
            states.append(layer.mixer.new_state(backend, capacity))
            continue
        assert isinstance(layer.mixer, Attention), "the plan marks full-attention layers only"
        shape = layer.mixer.cache_shape(capacity)
        states.append(KVCache(_quantized_cache(backend, level, shape), _quantized_cache(backend, level, shape)))
    return states


def _quantized_cache(backend: Any, level: str, shape: tuple[int, int, int]) -> Any:
    if backend.name == "numpy":
        return QuantizedRows(get_level(level), shape)
    if hasattr(backend, "quantized_kv_cache"):
        return backend.quantized_kv_cache(level, shape)
    raise AtlasError(f"KV cache level {level} has no {backend.name} storage; use --kv-cache-dtype bf16")
