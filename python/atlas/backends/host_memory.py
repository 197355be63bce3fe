"""Host memory a numpy-backend run will hold, counted from checkpoint headers before any weight
is read, and checked against MemAvailable: a model too big for the RAM fails in one line instead
of being killed by the OOM killer halfway through loading.

Counted as the numpy backend keeps them (host_weights.py): bf16 / f16 matrices 2 bytes per
parameter, quantized ones packed as stored, float32 ones 4 (the MTP head's bf16-rounded matrices
2), vectors float32; KV caches of the full-attention layers at their level (the bf16 level is
float32 here), DeltaNet conv + recurrent states float32, and a working allowance for the float32
blocks the ops convert and the activations of a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import AtlasError

if TYPE_CHECKING:
    from ..config import ModelSpec
    from ..safetensors import Checkpoint
    from .run_plan import RunPlan

GIB = 1 << 30
F32_BYTES = 4
WORKSPACE_BYTES = 1 * GIB  # converted row blocks / selected experts, activations, the tokenizer
MEMINFO = Path("/proc/meminfo")
STORED_ITEMSIZE = {"BF16": 2, "F16": 2}  # everything else float becomes float32


@dataclass(frozen=True)
class HostFootprint:
    weights: int
    kv_cache: int
    states: int
    workspace: int = WORKSPACE_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.states + self.workspace

    def describe(self) -> str:
        parts = (("weights", self.weights), ("KV cache", self.kv_cache), ("DeltaNet states", self.states),
                 ("working memory", self.workspace))
        return " + ".join(f"{label} {size / GIB:.2f}" for label, size in parts) + " GiB"


def matrix_bytes(dtype: str, shape: tuple[int, ...], mtp: bool) -> int:
    """Host bytes of one unquantized planned tensor on the numpy backend."""
    count = math.prod(shape)
    if len(shape) < 2:
        return F32_BYTES * count
    return count * (2 if mtp else STORED_ITEMSIZE.get(dtype, F32_BYTES))


def host_weight_bytes(spec: ModelSpec, checkpoint: Checkpoint, load_mtp: bool) -> int:
    from ..models.qwen3_5_moe import detect_layout, model_plan
    from ..models.qwen3_5_moe_mtp import checkpoint_mtp_plan
    from ..quant.stored import QuantizedTensors

    plan = {name: (shape, False) for name, shape in model_plan(detect_layout(spec, checkpoint)).items()}
    if load_mtp:
        plan.update({name: (shape, True) for name, shape in checkpoint_mtp_plan(spec, checkpoint).items()})
    quantized = QuantizedTensors.of(checkpoint)
    total = F32_BYTES * (spec.rotary_dim // 2)  # the rope frequency table
    for name, (shape, mtp) in plan.items():
        if name not in checkpoint:
            continue  # the loader names it in its one-line error
        if quantized.holds(name) and not mtp:
            total += quantized.nbytes(name)
        else:
            total += matrix_bytes(checkpoint.dtype(name), shape, mtp)
    return total


def host_kv_bytes(spec: ModelSpec, run: RunPlan, mtp_layers: int) -> int:
    from ..kvcache.level import bytes_per_vector
    from ..kvcache.levels import get_level

    vectors = run.max_seq_len * spec.num_key_value_heads  # per cache
    float_pair = 2 * vectors * spec.head_dim * F32_BYTES
    total = mtp_layers * float_pair
    for level in run.kv_cache.plan(spec.layer_types, spec.head_dim, "numpy"):
        if level is not None:
            total += float_pair if level == "bf16" else 2 * vectors * bytes_per_vector(get_level(level), spec.head_dim)
    return total


def host_state_bytes(spec: ModelSpec) -> int:
    from ..models.qwen3_5_moe import delta_net_dims

    d = delta_net_dims(spec)
    per_layer = F32_BYTES * (d.conv_channels * (d.conv_kernel - 1) + d.num_v_heads * d.k_head_dim * d.v_head_dim)
    return per_layer * sum(1 for kind in spec.layer_types if kind == "linear_attention")


def host_footprint(spec: ModelSpec, checkpoint: Checkpoint, run: RunPlan) -> HostFootprint:
    from ..models.qwen3_5_moe_mtp import has_mtp_head

    mtp = int(run.load_mtp and has_mtp_head(checkpoint))
    return HostFootprint(host_weight_bytes(spec, checkpoint, run.load_mtp), host_kv_bytes(spec, run, mtp),
                         host_state_bytes(spec) * run.state_copies())


def available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """MemAvailable in bytes; None where the kernel does not report it (not Linux)."""
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(":")
        fields = value.split()
        if key == "MemAvailable" and fields and fields[0].isdigit():
            return int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return None


def check_host_memory(footprint: HostFootprint, available: int | None) -> None:
    if available is None or footprint.total <= available:
        return
    fixes = ["run it on a GPU (--device cuda)", "use a quantized checkpoint (python -m atlas.quantize --to nvfp4)"]
    if footprint.kv_cache > footprint.weights // 4:  # only where the cache is worth shrinking
        fixes.append("a smaller KV cache (--kv-cache-dtype turbo4)")
    raise AtlasError(
        f"the model needs {footprint.total / GIB:.1f} GiB of host memory on the CPU backend "
        f"({footprint.describe()}) but only {available / GIB:.1f} GiB is available (MemAvailable); "
        f"{', '.join(fixes)}, or free or add RAM"
    )
