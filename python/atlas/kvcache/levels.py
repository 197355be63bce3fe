"""The registry of KV cache levels, by the names `--kv-cache-dtype` takes."""

from __future__ import annotations

from ..errors import AtlasError
from .level import KVLevel
from .names import LEVEL_NAMES
from .plain import Bf16Level, Fp8Level, Nvfp4Level
from .turbo import Turbo8Level, TurboCodebookLevel

LEVELS: dict[str, KVLevel] = {
    "bf16": Bf16Level(),
    "fp8": Fp8Level(),
    "nvfp4": Nvfp4Level(),
    "turbo8": Turbo8Level(),
    "turbo4": TurboCodebookLevel("turbo4", 4),
    "turbo3": TurboCodebookLevel("turbo3", 3),
}
assert tuple(LEVELS) == LEVEL_NAMES, "names.py lists every level, in this order"


def get_level(name: str) -> KVLevel:
    if name not in LEVELS:
        raise AtlasError(f"unknown KV cache dtype {name!r}; choose one of {', '.join(LEVEL_NAMES)}")
    return LEVELS[name]
