"""Device memory a run will hold, counted from checkpoint headers before anything is allocated.

Per planned tensor (models/qwen3_5_moe.model_plan; the MTP head's too when it will be loaded),
what the CUDA backend uploads:
  - a quantized matrix [N, K] in the kernels' layout (quant_weights.py), not the checkpoint's:
    fp8: N*K e4m3 codes + an f32 scale per 128 columns *per row* (the 128x128 block scales are
    repeated down the rows); nvfp4: N*K/2 packed codes + an e4m3 scale per 16 + an f32 row scale
    (weight_scale_2 on every row; input_scale is not uploaded);
  - any other matrix bf16 (conv1d [C, 1, K] as [C, K]), vectors (norms, A_log, dt_bias) f32;
  - each rounded up to the persistent pool's 256-byte allocations.
Beside the weights: the KV caches and DeltaNet states Engine.reset allocates, and the step arena's
first block (Engine.reset makes a quantized level's caches directly in its storage).
Not counted: upload temporaries the pool keeps after loading (a stack built block by block on the
device, as the shared expert stacked as expert E is, leaves its blocks cached for reuse or freed
at the next trim). For a bf16 Qwen3.6 that transient is one routed gate_up stack (1 GiB), more
than select.py's headroom: the loader, not this count, should avoid it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...quant.fp8_block import block_grid
from ...quant.nvfp4 import GROUP_SIZE
from .memory import ALIGN, GIB
from .ops_common import ceil_div
from .ops_kv import cache_bytes
from .quant_weights import FP8_BLOCK
from .runtime import RuntimeOptions
from ..run_plan import RunPlan

if TYPE_CHECKING:
    from ...config import ModelSpec
    from ...safetensors import Checkpoint

BF16_BYTES = 2
F32_BYTES = 4


@dataclass(frozen=True)
class DeviceFootprint:
    weights: int
    kv_cache: int
    states: int  # DeltaNet conv + recurrent states, f32
    arena: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.states + self.arena

    def describe(self) -> str:
        parts = (("weights", self.weights), ("KV cache", self.kv_cache), ("DeltaNet states", self.states),
                 ("step arena", self.arena))
        return " + ".join(f"{label} {size / GIB:.2f}" for label, size in parts) + " GiB"


def _allocation(nbytes: int) -> int:
    return ceil_div(max(nbytes, 1), ALIGN) * ALIGN


def quantized_bytes(method: str, rows: int, k: int) -> int:
    """Device bytes of a quantized [rows, k] matrix in quant_weights.py's layout."""
    if method == "fp8":  # the scale grid of one-row, FP8_BLOCK-column blocks
        return rows * k + F32_BYTES * math.prod(block_grid((rows, k), (1, FP8_BLOCK)))
    if method == "nvfp4":
        return rows * k // 2 + rows * (k // GROUP_SIZE) + F32_BYTES * rows
    raise ValueError(f"no device layout for quantization {method!r} (fp8, nvfp4)")


def float_bytes(shape: tuple[int, ...]) -> int:
    """Device bytes of an unquantized tensor: matrices (and stacks) bf16, vectors f32."""
    return math.prod(shape) * (BF16_BYTES if len(shape) >= 2 else F32_BYTES)


def weight_bytes(spec: ModelSpec, checkpoint: Checkpoint, load_mtp: bool = True) -> int:
    """Device bytes of every tensor the loader uploads for this checkpoint."""
    from ...models.qwen3_5_moe import detect_layout, model_plan
    from ...models.qwen3_5_moe_mtp import checkpoint_mtp_plan
    from ...quant.stored import QuantizedTensors

    plan = model_plan(detect_layout(spec, checkpoint))
    if load_mtp:
        plan.update(checkpoint_mtp_plan(spec, checkpoint))
    quantized = QuantizedTensors.of(checkpoint)
    total = _allocation(F32_BYTES * spec.rotary_dim // 2)  # the rope frequency table
    for name, shape in plan.items():
        if quantized.holds(name):
            total += _allocation(quantized_bytes(quantized.scheme.method, *quantized.shape(name)))
        else:
            total += _allocation(float_bytes(shape))
    return total


def kv_cache_bytes(spec: ModelSpec, run: RunPlan, mtp_layers: int = 0) -> int:
    """K and V of every full-attention layer at its level (the MTP head's bf16)."""
    shape = (run.max_seq_len, spec.num_key_value_heads, spec.head_dim)
    bf16_pair = 2 * _allocation(BF16_BYTES * math.prod(shape))
    total = mtp_layers * bf16_pair
    for level in run.kv_cache.plan(spec.layer_types, spec.head_dim, "cuda"):
        if level is None:
            continue
        total += bf16_pair if level == "bf16" else 2 * _allocation(cache_bytes(level, shape))
    return total


def state_bytes(spec: ModelSpec) -> int:
    """Each linear-attention layer's conv state [C, K-1] and recurrent state [Hv, Dk, Dv], f32."""
    from ...models.qwen3_5_moe import delta_net_dims

    d = delta_net_dims(spec)
    conv = _allocation(F32_BYTES * d.conv_channels * (d.conv_kernel - 1))
    recurrent = _allocation(F32_BYTES * d.num_v_heads * d.k_head_dim * d.v_head_dim)
    layers = sum(1 for kind in spec.layer_types if kind == "linear_attention")
    return layers * (conv + recurrent)


def device_footprint(spec: ModelSpec, checkpoint: Checkpoint, run: RunPlan | None = None) -> DeviceFootprint:
    """`run` defaults to `atlas run`'s: the default context, the bf16 KV cache, the MTP head."""
    from ...models.qwen3_5_moe_mtp import has_mtp_head

    run = run or RunPlan()
    mtp = int(run.load_mtp and has_mtp_head(checkpoint))
    return DeviceFootprint(weight_bytes(spec, checkpoint, run.load_mtp), kv_cache_bytes(spec, run, mtp),
                           state_bytes(spec) * run.state_copies(), RuntimeOptions().arena_bytes)
