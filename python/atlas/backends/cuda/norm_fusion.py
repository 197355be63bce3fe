"""ATLAS_NORM=fused: a decode token's residual add + RMSNorm taken into the kernel that reads it.

Each layer's two norms are launches of their own on the decode step's critical path, between the
kernel that writes the layer's update and the GEMV or router that reads the normed row: a launch
boundary and a load / reduce / store chain each, 80 per Qwen3.6 step. Under the fused form
add_rms_norm of one row is deferred (CudaRuntime.defer), and when the next launch is a consumer
that can take it (a wide bf16, fp8 or nvfp4 GEMV over the row, the router), that kernel gets the norm's
params too: every block computes the normed row itself (norm.cuh stage_add_rms_norm: the norm
kernel's code and thread layout, so the same bits) and its first block writes the norm's outputs,
so the later readers (the rest of the layer, the next norm) find them as before. Any other next
operation issues the norm as it was. Opt-in until the device has timed it (bench/launch_settings.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from atlas.kernel_params import dense as kp

from .ops_common import FormSwitch, ceil_div
from .runtime import DeferredLaunch

if TYPE_CHECKING:
    from .ops_dense import GemvGeometry
    from .runtime import CudaRuntime
    from .tensor import DeviceTensor

NORM_ENV = "ATLAS_NORM"
NORM_FORMS = ("separate", "fused")
NORM_SWITCH = FormSwitch(NORM_ENV, "norm form", NORM_FORMS)
NORM_KERNEL = "atlas_add_rms_norm"
# A GEMV block that takes the norm in stages three rows (x, residual, the norm's weight) where it
# staged one: 16 KB more of L2 reads per block at Qwen3.6's hidden 2048, an eighth of a wide
# block's weight bytes. Up to this many blocks per SM (in_proj: ~3 on an H200; the lm_head's ~59
# are past it) that costs less than the launch it saves. The router's ~33 blocks always pay.
MAX_GEMV_BLOCKS_PER_SM = 4


def defer_add_rms_norm(rt: CudaRuntime, params: kp.RmsNormParams, threads: int, tensors: tuple[DeviceTensor, ...]) -> None:
    """Queue atlas_add_rms_norm of one row (params.rows == 1) for a consumer to take in.
    tensors: (out, sum_out, x, residual, weight)."""
    out, total, *inputs = tensors
    rt.defer(DeferredLaunch(NORM_KERNEL, (1, 1, 1), (threads, 1, 1), params, (out, total), tuple(inputs)))


def take_norm_into_gemv(rt: CudaRuntime, x: DeviceTensor, n: int, shape: GemvGeometry) -> tuple[kp.RmsNormParams, int] | None:
    """For one token's GEMV of n rows over x: the deferred norm whose output is x, taken, and the
    wide shape's block count, when that shape is the one the GEMV would run and its blocks are few
    enough (MAX_GEMV_BLOCKS_PER_SM); None: the GEMV runs plain (the narrow shape has 4x the blocks)."""
    blocks = ceil_div(n, shape.wide_rows)
    if blocks < shape.wide_min_waves * rt.sm_count or blocks > MAX_GEMV_BLOCKS_PER_SM * rt.sm_count:
        return None
    norm = take_norm(rt, x, shape.threads)
    return None if norm is None else (norm, blocks)


def take_norm(rt: CudaRuntime, x: DeviceTensor, threads: int) -> kp.RmsNormParams | None:
    """The deferred norm whose output is x, for a consumer with blocks of `threads` threads that
    stages x whole: taken (its caller launches the consumer's norm entry next), or None (x is not
    waiting, or this consumer cannot take it: the caller launches its plain entry, which issues
    the norm first)."""
    launch = rt.deferred_writing(x)
    if launch is None or launch.kernel != NORM_KERNEL or launch.block[0] != threads:
        return None  # the norm's bits hold with its own block size only
    rt.take_deferred(launch)
    return launch.params
