"""The Qwen3.5 / 3.6 MTP head (`mtp.*`, beside `model.*`): fc [H, 2H], pre_fc_norm_embedding,
pre_fc_norm_hidden, one full-attention + MoE decoder layer (`mtp.layers.0.*`, experts fused or per
expert) and `mtp.norm`; it shares embed_tokens and lm_head with the main model. Read only for
speculative decoding, every tensor rounded to bf16 (the head is kept in bf16 on every backend).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..backends.base import Backend
from ..config import ModelSpec
from ..layers.decoder import CausalLM, DecoderLayer
from ..layers.mtp import MtpHead
from ..loader import Shape, WeightReader, check_tensor
from ..safetensors import Checkpoint
from .qwen3_5_moe import attention_plan, build_attention, build_moe, centred_norm, moe_plan


def round_to_bf16(array: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bf16 (ties to even), still float32."""
    return np.asarray(array, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


class Bf16RoundedReader(WeightReader):
    """Every tensor rounded to bf16 as read, so the numpy backend computes with the weights a
    bf16 GPU copy holds."""

    def array(self, name: str) -> np.ndarray:
        return round_to_bf16(super().array(name))


MTP_PREFIX = "mtp."  # top level, beside model.* (vLLM's qwen3_5_mtp reads the same names)


def has_mtp_head(checkpoint: Checkpoint) -> bool:
    return f"{MTP_PREFIX}fc.weight" in checkpoint


def mtp_plan(s: ModelSpec, fused: bool) -> dict[str, Shape]:
    """The MTP head's tensors: fc [H, 2H], three norms, one full-attention + MoE layer."""
    h, layer = s.hidden_size, f"{MTP_PREFIX}layers.0."
    plan: dict[str, Shape] = {
        f"{MTP_PREFIX}fc.weight": (h, 2 * h),
        f"{MTP_PREFIX}pre_fc_norm_embedding.weight": (h,),
        f"{MTP_PREFIX}pre_fc_norm_hidden.weight": (h,),
        f"{MTP_PREFIX}norm.weight": (h,),
        f"{layer}input_layernorm.weight": (h,),
        f"{layer}post_attention_layernorm.weight": (h,),
    }
    plan.update(attention_plan(s, layer))
    plan.update(moe_plan(s, layer, fused))
    return plan


def mtp_fused(checkpoint: Checkpoint) -> bool:
    """The head's experts are stored as stacks (else one tensor per expert)."""
    return f"{MTP_PREFIX}layers.0.mlp.experts.gate_up_proj" in checkpoint


def checkpoint_mtp_plan(spec: ModelSpec, checkpoint: Checkpoint) -> dict[str, Shape]:
    """The head's tensors as this checkpoint stores them; {} when it has no head."""
    return mtp_plan(spec, mtp_fused(checkpoint)) if has_mtp_head(checkpoint) else {}


def check_mtp_head(spec: ModelSpec, checkpoint: Checkpoint) -> None:
    """Every tensor of the head is there with its shape and a readable dtype (when it has one)."""
    for name, shape in checkpoint_mtp_plan(spec, checkpoint).items():
        check_tensor(checkpoint, name, shape)


def load_mtp_head(spec: ModelSpec, checkpoint: Checkpoint, backend: Backend, model: CausalLM) -> MtpHead:
    """The MTP head (weights rounded to bf16), sharing the model's embedding and lm_head."""
    layer, fused = f"{MTP_PREFIX}layers.0.", mtp_fused(checkpoint)
    reader = Bf16RoundedReader(checkpoint, backend, mtp_plan(spec, fused))
    eps, h = spec.rms_norm_eps, spec.hidden_size
    try:
        fc = reader.array(f"{MTP_PREFIX}fc.weight")  # [H, 2H]: embedding columns, then hidden
        decoder = DecoderLayer(
            input_norm=centred_norm(reader, f"{layer}input_layernorm.weight", eps),
            mixer=build_attention(reader, spec, layer, model.rotary),
            post_norm=centred_norm(reader, f"{layer}post_attention_layernorm.weight", eps),
            ffn=build_moe(reader, spec, layer, fused),
        )
        return MtpHead(
            embed=model.embed,
            embed_norm=centred_norm(reader, f"{MTP_PREFIX}pre_fc_norm_embedding.weight", eps),
            hidden_norm=centred_norm(reader, f"{MTP_PREFIX}pre_fc_norm_hidden.weight", eps),
            fc_embed=reader.upload(fc[:, :h]),
            fc_hidden=reader.upload(fc[:, h:]),
            layer=decoder,
            norm=centred_norm(reader, f"{MTP_PREFIX}norm.weight", eps),
            lm_head=model.lm_head,
        )
    finally:
        reader.close()
