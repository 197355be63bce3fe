"""`--kv-cache-dtype` and `--kv-high-precision-layers`: which level each full-attention layer stores.

Only full-attention layers have a KV cache (the linear-attention layers keep a fixed-size state).
High-precision layers are counted among the full-attention layers, from each end:
  auto -> 1: the first and the last full-attention layer stay bf16 (with a single full-attention
          layer, as in atlas-demo, that layer is both, so auto quantizes nothing there);
  N    -> the first N and the last N full-attention layers stay bf16 (0: every layer uses the
          chosen level; 2N >= their count: all stay bf16).
bf16 is the backend's own cache, unchanged: bf16 on CUDA, float32 in the numpy reference (the
reference stays the fp32 oracle); the other levels store packed codes and scales (storage.py; on
CUDA one buffer of the same fields, backends/cuda/ops_kv.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import AtlasError
from .levels import get_level
from .names import DEFAULT_LEVEL, LEVEL_NAMES

AUTO_HIGH_PRECISION = 1
QUANTIZED_BACKENDS = ("numpy", "cuda")  # cuda: kernels/include/atlas/kv_quant.cuh


def parse_high_precision(value: str | int) -> int:
    """'auto' -> 1; 'N' or N (N >= 0) -> N."""
    if isinstance(value, int) and not isinstance(value, bool):
        count = value
    elif isinstance(value, str) and value.strip() == "auto":
        return AUTO_HIGH_PRECISION
    elif isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        count = int(value.strip())
    else:
        count = -1
    if count < 0:
        raise AtlasError(
            f"--kv-high-precision-layers must be 'auto' or a non-negative integer, got {value!r}"
        )
    return count


@dataclass(frozen=True)
class KVCacheOptions:
    dtype: str = DEFAULT_LEVEL  # one of LEVEL_NAMES
    high_precision_layers: str | int = "auto"

    def check(self) -> None:
        if self.dtype not in LEVEL_NAMES:
            raise AtlasError(
                f"--kv-cache-dtype must be one of {', '.join(LEVEL_NAMES)}, got {self.dtype!r}"
            )
        parse_high_precision(self.high_precision_layers)

    def plan(self, layer_types: list[str], head_dim: int, backend_name: str = "numpy") -> list[str | None]:
        """The level of each layer: a level name for full-attention layers, None for the others.
        Every problem (bad value, head_dim, a backend without these levels) is raised here."""
        self.check()
        full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
        keep = parse_high_precision(self.high_precision_layers)
        kept = set(full[:keep]) | set(full[len(full) - keep :]) if keep else set()
        plan: list[str | None] = [None] * len(layer_types)
        for i in full:
            plan[i] = DEFAULT_LEVEL if i in kept else self.dtype
        if any(p == self.dtype != DEFAULT_LEVEL for p in plan):
            get_level(self.dtype).layout(head_dim)
            if backend_name not in QUANTIZED_BACKENDS:
                raise AtlasError(
                    f"--kv-cache-dtype {self.dtype} runs on the {' and '.join(QUANTIZED_BACKENDS)} backends only; "
                    "use one of them or --kv-cache-dtype bf16"
                )
        return plan


def describe(plan: list[str | None]) -> str:
    """'fp8 on layers 7, 11; bf16 on layers 3, 15' (full-attention layers only)."""
    by_level: dict[str, list[int]] = {}
    for i, level in enumerate(plan):
        if level is not None:
            by_level.setdefault(level, []).append(i)
    return "; ".join(f"{lvl} on layers {', '.join(map(str, ids))}" for lvl, ids in by_level.items())
