"""bf16 checkpoint tensors -> the tensors of a quantized checkpoint (names as published)."""

from __future__ import annotations

from collections.abc import Iterator

import ml_dtypes
import numpy as np

from ..errors import AtlasError
from ..safetensors import Checkpoint
from .exclusions import converts, module_of
from .fp8_block import quantize_fp8_block
from .nvfp4 import quantize_nvfp4
from .scheme import QuantScheme

FUSED_GATE_UP = "mlp.experts.gate_up_proj"
FUSED_DOWN = "mlp.experts.down_proj"
SOURCE_FLOAT_DTYPES = frozenset({"BF16", "F16", "F32"})


def split_fused(name: str, array: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Fused expert stacks -> per-expert weights (gate_up [E, 2I, H] holds the gate rows first)."""
    if name.endswith((FUSED_GATE_UP, FUSED_DOWN)) and array.ndim != 3:
        raise AtlasError(f"tensor {name!r} has shape {list(array.shape)}; a fused expert stack is [experts, rows, "
                         "columns]: fix or re-download the checkpoint")
    if name.endswith(FUSED_GATE_UP):
        base, half = name[: -len("gate_up_proj")], array.shape[1] // 2
        split: list[tuple[str, np.ndarray]] = []
        for e in range(array.shape[0]):
            split += [(f"{base}{e}.gate_proj.weight", array[e, :half]), (f"{base}{e}.up_proj.weight", array[e, half:])]
        return split
    if name.endswith(FUSED_DOWN):
        base = name[: -len("down_proj")]
        return [(f"{base}{e}.down_proj.weight", array[e]) for e in range(array.shape[0])]
    return [(name, array)]


def quantized_parts(name: str, weight: np.ndarray, scheme: QuantScheme) -> list[tuple[str, np.ndarray]]:
    """One [N, K] weight -> its stored parts (weight codes first)."""
    base = name[: -len("weight")]
    w = np.asarray(weight, dtype=np.float32)  # [N, K]
    if not np.isfinite(w).all():
        raise AtlasError(f"tensor {name!r} holds NaN or infinite values, which no scale represents; "
                         "fix or re-download the checkpoint")
    if scheme.method == "fp8":
        q = quantize_fp8_block(w, scheme.block)
        return [(name, q.weight.view(ml_dtypes.float8_e4m3fn)), (f"{base}weight_scale_inv", q.scale_inv)]
    q4 = quantize_nvfp4(w)
    return [
        (name, q4.weight),
        (f"{base}weight_scale", q4.weight_scale.view(ml_dtypes.float8_e4m3fn)),
        (f"{base}weight_scale_2", q4.weight_scale_2),
        (f"{base}input_scale", q4.input_scale),
    ]


def converted_tensors(checkpoint: Checkpoint, name: str, scheme: QuantScheme) -> Iterator[tuple[str, np.ndarray, bool]]:
    """(output name, array, quantized?) for one source tensor."""
    stored = checkpoint.get_raw(name)
    for out_name, array in split_fused(name, stored):
        if not converts(out_name, array.shape, scheme.method):
            yield out_name, array, False
            continue
        if checkpoint.dtype(name) not in SOURCE_FLOAT_DTYPES:
            raise AtlasError(
                f"tensor {name!r} in {checkpoint.source} is {checkpoint.dtype(name)}; "
                "quantize a bf16, f16 or f32 checkpoint"
            )
        for part in quantized_parts(out_name, np.asarray(array, dtype=np.float32), scheme):
            yield (*part, True)


def unconverted_modules(names: list[str]) -> list[str]:
    """Modules whose `.weight` stays unquantized: the published exclusion list."""
    return sorted({module_of(n) for n in names if n.endswith(".weight")})
