"""CudaBackend: every op of backends/base.py on the GPU, through the kernel engineers' op
wrappers (ops_dense, ops_linear_moe: `op(rt, ...)` with base.py's arguments)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ...errors import AtlasError
from ..base import (
    AttentionInputs,
    AttentionOperands,
    DeltaNetInputs,
    DeltaNetOperands,
    KVCache,
    LogprobTensors,
    PenaltyOperands,
    PendingArray,
    SamplingParams,
    StorageDType,
    check_split_widths,
    compose_full_attention,
    compose_gated_delta_net,
)
from . import norm_fusion, ops_delta_decode, ops_dense, ops_kv, ops_linear_moe, ops_quant
from .graph import GraphedDecodeStep
from .ops_kv import QuantizedKVCache
from .quant_weights import QuantWeight, from_quantized_weight, stack_rows
from .quant_weights import upload as upload_quant
from .reads import PendingRead
from .runtime import GRAPHS_SWITCH, RUN_AHEAD_SWITCH, CudaRuntime
from .tensor import DeviceTensor
from .upload import Uploader, from_storage


@dataclass(frozen=True)
class StoredRead:
    """A pending read of a tensor's storage, given back as to_numpy gives it."""

    read: PendingRead

    def result(self) -> np.ndarray:
        return from_storage(self.read.result(), self.read.dtype)


class CudaBackend:
    name = "cuda"

    def __init__(self, rt: CudaRuntime, use_graphs: bool | None = None, router: str | None = None,
                 delta_net: str | None = None, attention_prep: str | None = None, norm: str | None = None) -> None:
        """`router` "split" | "fused" (ops_linear_moe.router_form; None: ATLAS_ROUTER decides);
        `delta_net`, `attention_prep` and `norm` "separate" | "fused" the same way
        (ATLAS_DELTANET_DECODE, ATLAS_ATTENTION_PREP, ATLAS_NORM)."""
        self.rt = rt
        self.prefill_attention = ops_dense.prefill_attention_form()  # ATLAS_PREFILL_ATTENTION: "mma" | "simt"
        self.gemm_form = ops_dense.gemm_form(rt)  # ATLAS_GEMM: "mma" | "wgmma" (h200 only)
        self._router_arrivals: DeviceTensor | None = None
        self._delta_arrivals: DeviceTensor | None = None
        self.use_decode_forms(router, delta_net, attention_prep, norm)
        ops_linear_moe.DELTA_RULE_SWITCH.read()  # read per prompt; a bad value is one line now, not at the first
        self.sample_form = ops_dense.SAMPLE_SWITCH.read()  # ATLAS_SAMPLE: "block" | "split"
        self.uploader = Uploader(rt)
        if use_graphs is None:
            use_graphs = GRAPHS_SWITCH.read() == "1"
        self.use_graphs = use_graphs and rt.driver.graphs
        if use_graphs and not rt.driver.graphs:
            print(f"atlas: {rt.driver.binding} cannot capture CUDA graphs; decoding without them",
                  file=sys.stderr)
        self._ids_carry: DeviceTensor | None = None
        self.runs_ahead = RUN_AHEAD_SWITCH.read() == "1"  # ATLAS_RUN_AHEAD: the decode loop queues a step ahead

    def use_decode_forms(self, router: str | None = None, delta_net: str | None = None,
                         attention_prep: str | None = None, norm: str | None = None) -> None:
        """The decode ops' forms: `router` "split" | "fused", `delta_net`, `attention_prep` and
        `norm` "separate" | "fused" (None: ATLAS_ROUTER, ATLAS_DELTANET_DECODE,
        ATLAS_ATTENTION_PREP, ATLAS_NORM decide). A fused form's arrival counters are allocated on
        its first use and kept (a captured graph holds their address). bench/launch_settings.py
        switches the forms between decode graph captures."""
        self.router_form = ops_linear_moe.router_form(router)
        self.delta_net_form = ops_delta_decode.decode_form(delta_net)
        self.attention_prep_form = ops_dense.ATTENTION_PREP_SWITCH.read(attention_prep)
        self.norm_form = norm_fusion.NORM_SWITCH.read(norm)
        if self.router_form == "fused" and self._router_arrivals is None:
            self._router_arrivals = ops_linear_moe.router_arrivals(self.rt)
        if self.delta_net_form == "fused" and self._delta_arrivals is None:
            self._delta_arrivals = ops_delta_decode.decode_arrivals(self.rt)

    def describe(self) -> str:
        info = self.rt.info
        graphs = "CUDA graphs" if self.use_graphs else "no CUDA graphs"
        fused = (("router", self.router_form == "fused"), ("attention prep", self.attention_prep_form == "fused"),
                 ("norms", self.norm_form == "fused"))
        forms = "".join(f", fused {name}" for name, on in fused if on)
        forms += ", split sampling" if self.sample_form == "split" else ""
        launch = ", programmatic launches" if self.rt.programmatic else ""
        launch += ", L2 weight prefetch" if self.rt.prefetch else ""
        return (f"{info.name} (cc {info.cc[0]}.{info.cc[1]}, {info.sm_count} SMs), "
                f"{self.rt.image.label}, {self.rt.driver.binding}, {graphs}{forms}{launch}")

    # --- memory -------------------------------------------------------------------------------
    def upload(self, array: np.ndarray, dtype: StorageDType) -> DeviceTensor:
        return self.uploader.upload(array, dtype)

    def zeros(self, shape: tuple[int, ...], dtype: StorageDType) -> DeviceTensor:
        return self.rt.zeros(tuple(shape), dtype)

    def to_numpy(self, t: DeviceTensor) -> np.ndarray:
        return from_storage(self.rt.read(t), t.dtype)

    def read_later(self, t: DeviceTensor) -> PendingArray:
        return StoredRead(self.rt.read_later(t))

    def rows(self, t: DeviceTensor, start: int, stop: int) -> DeviceTensor:
        return t.rows(start, stop)

    def cache_rows(self, cache: DeviceTensor | QuantizedKVCache, stop: int) -> dict[str, np.ndarray]:
        if isinstance(cache, QuantizedKVCache):
            return ops_kv.stored_rows(self.rt, cache, stop)
        return {"rows": self.rt.read(cache.rows(0, stop)).view(ml_dtypes.bfloat16)}  # bf16 kept as bf16

    def write_cache_rows(self, cache: DeviceTensor | QuantizedKVCache, fields: dict[str, np.ndarray]) -> None:
        if isinstance(cache, QuantizedKVCache):
            ops_kv.write_stored_rows(self.rt, cache, fields)
            return
        rows = fields["rows"]
        if rows.dtype != ml_dtypes.bfloat16 or rows.shape[1:] != cache.shape[1:]:
            raise AtlasError(f"cache rows {rows.shape} {rows.dtype} do not fit a bf16 cache {cache.shape}")
        self.rt.write(cache.rows(0, len(rows)), rows.view(np.uint16))

    def close(self) -> None:
        self.rt.close()

    def copy(self, dst: DeviceTensor, src: DeviceTensor) -> None:
        """dst[...] = src, device to device in stream order (speculative decoding's state
        snapshots and the hidden states it carries across steps)."""
        self.rt.copy(dst, src)

    def begin_step(self, ids: DeviceTensor) -> DeviceTensor:
        """Recycle the step arena. ids that live in the arena (the previous step's argmax) are
        first moved to a persistent buffer so the new step cannot overwrite them."""
        if self.rt.capturing or ids.owner is not None:
            self.rt.reset_step()
            return ids
        carry = self._ids_carry
        if carry is None or carry.shape != ids.shape:
            carry = self._ids_carry = self.rt.persistent(ids.shape, "i32")
        self.rt.copy(carry, ids)
        self.rt.reset_step()
        return carry

    # --- dense ops ----------------------------------------------------------------------------
    def embedding(self, table: DeviceTensor, ids: DeviceTensor) -> DeviceTensor:
        """A lookup in the weight table starts a forward pass, so it begins the step (arena
        reset); a table in the arena (a step tensor) is gathered without one."""
        if table.owner is not None:
            ids = self.begin_step(ids)
        return ops_dense.embedding(self.rt, table, ids)

    def rms_norm(self, x: DeviceTensor, weight: DeviceTensor, eps: float) -> DeviceTensor:
        return ops_dense.rms_norm(self.rt, x, weight, eps)

    def add_rms_norm(self, x: DeviceTensor, residual: DeviceTensor, weight: DeviceTensor,
                     eps: float) -> tuple[DeviceTensor, DeviceTensor]:
        return ops_dense.add_rms_norm(self.rt, x, residual, weight, eps, defer=self.norm_form == "fused")

    def add(self, x: DeviceTensor, y: DeviceTensor) -> DeviceTensor:
        return ops_dense.add(self.rt, x, y)

    def linear(self, x: DeviceTensor, weight: DeviceTensor | QuantWeight) -> DeviceTensor:
        if isinstance(weight, QuantWeight):
            return ops_quant.linear(self.rt, x, weight)
        return ops_dense.linear(self.rt, x, weight, gemm_with=self.gemm_form)

    def linear_split(self, x: DeviceTensor, weight: DeviceTensor | QuantWeight,
                     widths: Sequence[int]) -> list[DeviceTensor]:
        """Decode (one token): one GEMV, its [1, N] output cut into views. More tokens: a column
        block of a [T, N] output is not contiguous, so one linear per part on a row view of the
        weight (prefill GEMMs are compute-bound; launches are not what they cost). A view starts
        4 * (its column offset) bytes into the 256-byte aligned output: the model's parts start at
        multiples of 4 columns, which keeps its consumers' float4 loads (kv_quant's of v) aligned."""
        check_split_widths(weight.shape, widths)
        bounds = np.cumsum([0, *widths]).tolist()
        if x.numel == x.shape[-1]:
            out = self.linear(x, weight)  # [1, N]
            return [out.elements(a, b).reshape(*x.shape[:-1], b - a) for a, b in zip(bounds, bounds[1:])]
        return [self.linear(x, weight.rows(a, b)) for a, b in zip(bounds, bounds[1:])]

    def upload_quantized(self, weight: Any) -> QuantWeight:
        """The loader's hook: a checkpoint's fp8 / nvfp4 matrix, uploaded packed (quant_weights.py)."""
        try:
            host = from_quantized_weight(weight)
        except ValueError as err:
            raise AtlasError(f"{weight.name}: {err}; the GPU kernels cannot run this checkpoint") from None
        return upload_quant(self.uploader, host)

    def upload_quantized_rows(self, weights: Sequence[Any], rows: np.ndarray | None, experts: int) -> QuantWeight:
        """The loader's `packed`: quantized matrices stacked by rows (gate + up, experts, a fused
        projection), then the `rows` selection (q / gate rows of q_proj), uploaded packed;
        experts > 0: [E, rows / E, K]."""
        try:
            host = stack_rows([from_quantized_weight(w) for w in weights])
        except ValueError as err:
            raise AtlasError(f"{weights[0].name}: {err}; the GPU kernels cannot run this checkpoint") from None
        return upload_quant(self.uploader, host if rows is None else host.take_rows(rows), experts)

    def upload_stacked(self, blocks: Sequence[np.ndarray], dtype: StorageDType) -> DeviceTensor:
        """The loader's stacks (the shared expert as expert E): blocks concatenated along dim 0,
        each uploaded through `upload` (which the benchmarks hook to fill their synthetic weights
        on the device) and copied into place, so no host copy of the whole stack is made."""
        shape = (sum(int(b.shape[0]) for b in blocks), *blocks[0].shape[1:])
        out = self.rt.persistent(shape, dtype)
        row = 0
        for block in blocks:
            part = self.upload(block, dtype)
            self.rt.copy(out.rows(row, row + part.shape[0]), part)
            row += part.shape[0]
            self.rt.synchronize()  # `part` may be freed and its memory reused at once
        return out

    def silu_mul(self, gate_up: DeviceTensor) -> DeviceTensor:
        return ops_dense.silu_mul(self.rt, gate_up)

    def sigmoid_mul(self, x: DeviceTensor, gate: DeviceTensor) -> DeviceTensor:
        return ops_dense.sigmoid_mul(self.rt, x, gate)

    def nonfinite_count(self, x: DeviceTensor) -> DeviceTensor:
        return ops_dense.nonfinite_count(self.rt, x)

    # --- full attention -----------------------------------------------------------------------
    def head_norm_rope(self, x: DeviceTensor, weight: DeviceTensor, positions: DeviceTensor,
                       inv_freq: DeviceTensor, scaling: float, eps: float) -> DeviceTensor:
        return ops_dense.head_norm_rope(self.rt, x, weight, positions, inv_freq, scaling, eps)

    def attention(self, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, cache: KVCache,
                  positions: DeviceTensor, scale: float) -> DeviceTensor:
        """cache.k / cache.v: bf16 DeviceTensors or QuantizedKVCache levels (both of one kind)."""
        if isinstance(cache.k, QuantizedKVCache) and isinstance(cache.v, QuantizedKVCache):
            return ops_kv.attention(self.rt, q, k, v, cache, positions, scale, prefill=self.prefill_attention)
        return ops_dense.attention(self.rt, q, k, v, cache, positions, scale,
                                   prefill=self.prefill_attention)

    def full_attention(self, x: AttentionInputs, layer: AttentionOperands) -> DeviceTensor:
        """With `attention_prep` "fused" over bf16 caches: atlas_attention_prep, then attention;
        otherwise the three ops in a row."""
        if self.fuses_full_attention(layer.cache):
            return ops_dense.fused_attention(self.rt, x, layer, prefill=self.prefill_attention)
        return compose_full_attention(self, x, layer)

    def fuses_full_attention(self, cache: KVCache) -> bool:
        return self.attention_prep_form == "fused" and not isinstance(cache.k, QuantizedKVCache)

    def quantized_kv_cache(self, level: str, shape: tuple[int, int, int]) -> QuantizedKVCache:
        """A K or V cache [S, Hkv, D] at a quantized --kv-cache-dtype level (atlas.kvcache.storage)."""
        return ops_kv.quantized_cache(self.rt, level, shape)

    # --- linear attention ---------------------------------------------------------------------
    def causal_conv1d(self, x: DeviceTensor, weight: DeviceTensor, conv_state: DeviceTensor) -> DeviceTensor:
        return ops_linear_moe.causal_conv1d(self.rt, x, weight, conv_state)

    def gated_delta_rule(self, mixed_qkv: DeviceTensor, a: DeviceTensor, b: DeviceTensor,
                         layer: DeltaNetOperands) -> DeviceTensor:
        return ops_linear_moe.gated_delta_rule(self.rt, mixed_qkv, a, b, layer)

    def gated_rms_norm(self, x: DeviceTensor, z: DeviceTensor, weight: DeviceTensor, eps: float) -> DeviceTensor:
        return ops_linear_moe.gated_rms_norm(self.rt, x, z, weight, eps)

    def gated_delta_net(self, x: DeltaNetInputs, layer: DeltaNetOperands) -> DeviceTensor:
        """Decode (T == 1) with `delta_net` "fused" (ATLAS_DELTANET_DECODE=fused): one kernel;
        otherwise the three kernels in a row."""
        if self.fuses_gated_delta_net(x.mixed.shape[0]):
            return ops_delta_decode.delta_net_decode(self.rt, x, layer, self._delta_arrivals)
        return compose_gated_delta_net(self, x, layer)

    def fuses_gated_delta_net(self, tokens: int) -> bool:
        return self.delta_net_form == "fused" and tokens == 1

    # --- mixture of experts -------------------------------------------------------------------
    def router(self, x: DeviceTensor, weight: DeviceTensor, top_k: int, renormalize: bool, *,
               shared_expert: bool = False) -> tuple[DeviceTensor, DeviceTensor]:
        return ops_linear_moe.router(self.rt, x, weight, top_k, renormalize, shared_expert=shared_expert,
                                     arrivals=self._router_arrivals if self.router_form == "fused" else None)

    def moe_experts(self, x: DeviceTensor, ids: DeviceTensor, weights: DeviceTensor,
                    gate_up: DeviceTensor | QuantWeight, down: DeviceTensor | QuantWeight) -> DeviceTensor:
        if isinstance(gate_up, QuantWeight) and isinstance(down, QuantWeight):
            return ops_quant.moe_experts(self.rt, x, ids, weights, gate_up, down)
        return ops_linear_moe.moe_experts(self.rt, x, ids, weights, gate_up, down)

    def add_sigmoid_scaled(self, x: DeviceTensor, y: DeviceTensor, gate_logit: DeviceTensor) -> DeviceTensor:
        return ops_linear_moe.add_sigmoid_scaled(self.rt, x, y, gate_logit)

    # --- sampling -----------------------------------------------------------------------------
    def argmax(self, logits: DeviceTensor) -> DeviceTensor:
        return ops_dense.argmax(self.rt, logits)

    def sample(self, logits: DeviceTensor, params: SamplingParams, uniform: float) -> DeviceTensor:
        return ops_dense.sample(self.rt, logits, params, uniform, self.sample_form)

    def penalize(self, logits: DeviceTensor, operands: PenaltyOperands, params: SamplingParams,
                 mask_ends: bool) -> DeviceTensor:
        return ops_dense.penalize(self.rt, logits, operands, params, mask_ends)

    def count_token(self, counts: DeviceTensor, token: DeviceTensor) -> None:
        ops_dense.count_token(self.rt, counts, token)

    def top_ids(self, logits: DeviceTensor, k: int) -> DeviceTensor:
        return ops_dense.top_ids(self.rt, logits, k)

    def logprob_rows(self, logits: DeviceTensor, tokens: DeviceTensor, top: int, temperature: float = 1.0) -> LogprobTensors:
        return ops_dense.logprob_rows(self.rt, logits, tokens, top, temperature)

    # --- execution ----------------------------------------------------------------------------
    def make_decode_step(self, step: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        if not self.use_graphs:
            return step
        return GraphedDecodeStep(self.rt, step)
