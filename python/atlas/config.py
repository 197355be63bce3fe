"""config.json -> ModelSpec (the typed view of a checkpoint's text model)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

LayerType = Literal["linear_attention", "full_attention"]


@dataclass(frozen=True)
class ModelSpec:
    model_type: str  # "qwen3_5_moe" or "qwen3_5_moe_text" as found in the file
    nested: bool  # True when the text config sits under "text_config"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[LayerType, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int  # head_dim * partial_rotary_factor
    rope_theta: float
    attention_bias: bool
    # linear attention (Gated DeltaNet)
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # mixture of experts
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    hidden_act: str
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = field(default=())
    torch_dtype: str = "bfloat16"  # dtype named by the checkpoint ("dtype" or "torch_dtype")
