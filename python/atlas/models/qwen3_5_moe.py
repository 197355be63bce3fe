"""Qwen3.5 / 3.6 MoE (transformers `qwen3_5_moe`, `qwen3_5_moe_text`): checkpoint names -> layers.

Text weights live under `model.language_model.` (multimodal checkpoints) or `model.`; the vision
tower (`model.visual.*`) is not read; the MTP head (`mtp.*`) only by qwen3_5_moe_mtp.py,
on request (speculative decoding). Experts come fused
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) or per expert
(`mlp.experts.{e}.{gate,up,down}_proj.weight`) and are stacked as gate_up / down either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backends.base import Backend, Tensor
from ..config import ModelSpec
from ..errors import AtlasError
from ..layers.attention import Attention, AttentionDims, AttentionWeights
from ..layers.decoder import CausalLM, DecoderLayer
from ..layers.embedding import Embedding, LMHead
from ..layers.linear_attention import DeltaNetDims, DeltaNetWeights, GatedDeltaNet
from ..layers.mlp import Mlp
from ..layers.moe import SharedExpert, SparseMoe
from ..layers.norm import RMSNorm
from ..layers.rotary import Rotary, model_rotary
from ..loader import RowPart, Shape, WeightReader, check_tensor, find_text_prefix
from ..quant.stored import QuantizedTensors
from ..safetensors import Checkpoint


@dataclass(frozen=True)
class Layout:
    prefix: str  # "model.language_model." or "model."
    fused_experts: bool
    spec: ModelSpec

    def layer(self, i: int) -> str:
        return f"{self.prefix}layers.{i}."


def detect_layout(spec: ModelSpec, checkpoint: Checkpoint) -> Layout:
    prefix = find_text_prefix(checkpoint, "embed_tokens.weight")
    fused = f"{prefix}layers.0.mlp.experts.gate_up_proj" in checkpoint
    layout = Layout(prefix, fused, spec)
    check_counts(layout, checkpoint)
    return layout


def check_counts(layout: Layout, checkpoint: Checkpoint) -> None:
    """The last layer (and, stored per expert, the last expert) is in the checkpoint: a count in
    config.json past what the checkpoint holds is one line before a plan of that size is built."""
    s = layout.spec
    last_layer = f"{layout.layer(s.num_hidden_layers - 1)}input_layernorm.weight"
    last_expert = f"{layout.layer(0)}mlp.experts.{s.num_experts - 1}.down_proj.weight"
    for count, value, name in (("num_hidden_layers", s.num_hidden_layers, last_layer),
                               ("num_experts", s.num_experts, None if layout.fused_experts else last_expert)):
        if name is not None and name not in checkpoint:
            raise AtlasError(f"config.json has {count} = {value} but {checkpoint.source} has no {name!r}; "
                             "the checkpoint is incomplete or does not match its config.json")


def attention_plan(s: ModelSpec, p: str) -> dict[str, Shape]:
    q_width, kv_width = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    return {
        f"{p}self_attn.q_proj.weight": (2 * q_width, s.hidden_size),
        f"{p}self_attn.k_proj.weight": (kv_width, s.hidden_size),
        f"{p}self_attn.v_proj.weight": (kv_width, s.hidden_size),
        f"{p}self_attn.o_proj.weight": (s.hidden_size, q_width),
        f"{p}self_attn.q_norm.weight": (s.head_dim,),
        f"{p}self_attn.k_norm.weight": (s.head_dim,),
    }


def delta_net_dims(s: ModelSpec) -> DeltaNetDims:
    return DeltaNetDims(
        s.linear_num_key_heads, s.linear_num_value_heads, s.linear_key_head_dim,
        s.linear_value_head_dim, s.linear_conv_kernel_dim,
    )  # fmt: skip


def delta_net_plan(s: ModelSpec, p: str) -> dict[str, Shape]:
    d = delta_net_dims(s)
    value_width, heads = d.num_v_heads * d.v_head_dim, d.num_v_heads
    return {
        f"{p}linear_attn.in_proj_qkv.weight": (d.conv_channels, s.hidden_size),
        f"{p}linear_attn.in_proj_z.weight": (value_width, s.hidden_size),
        f"{p}linear_attn.in_proj_b.weight": (heads, s.hidden_size),
        f"{p}linear_attn.in_proj_a.weight": (heads, s.hidden_size),
        f"{p}linear_attn.conv1d.weight": (d.conv_channels, 1, d.conv_kernel),
        f"{p}linear_attn.A_log": (heads,),
        f"{p}linear_attn.dt_bias": (heads,),
        f"{p}linear_attn.norm.weight": (d.v_head_dim,),
        f"{p}linear_attn.out_proj.weight": (s.hidden_size, value_width),
    }


def moe_plan(s: ModelSpec, p: str, fused: bool) -> dict[str, Shape]:
    h, inter, shared = s.hidden_size, s.moe_intermediate_size, s.shared_expert_intermediate_size
    plan = {
        f"{p}mlp.gate.weight": (s.num_experts, h),
        f"{p}mlp.shared_expert.gate_proj.weight": (shared, h),
        f"{p}mlp.shared_expert.up_proj.weight": (shared, h),
        f"{p}mlp.shared_expert.down_proj.weight": (h, shared),
        f"{p}mlp.shared_expert_gate.weight": (1, h),
    }
    if fused:
        plan[f"{p}mlp.experts.gate_up_proj"] = (s.num_experts, 2 * inter, h)
        plan[f"{p}mlp.experts.down_proj"] = (s.num_experts, h, inter)
        return plan
    for e in range(s.num_experts):
        plan[f"{p}mlp.experts.{e}.gate_proj.weight"] = (inter, h)
        plan[f"{p}mlp.experts.{e}.up_proj.weight"] = (inter, h)
        plan[f"{p}mlp.experts.{e}.down_proj.weight"] = (h, inter)
    return plan


def model_plan(layout: Layout) -> dict[str, Shape]:
    """Every tensor the text model reads, with the shape config.json implies."""
    s, top = layout.spec, layout.prefix
    plan: dict[str, Shape] = {f"{top}embed_tokens.weight": (s.vocab_size, s.hidden_size)}
    for i, kind in enumerate(s.layer_types):
        p = layout.layer(i)
        plan[f"{p}input_layernorm.weight"] = (s.hidden_size,)
        plan[f"{p}post_attention_layernorm.weight"] = (s.hidden_size,)
        plan.update(attention_plan(s, p) if kind == "full_attention" else delta_net_plan(s, p))
        plan.update(moe_plan(s, p, layout.fused_experts))
    plan[f"{top}norm.weight"] = (s.hidden_size,)
    if not s.tie_word_embeddings:
        plan["lm_head.weight"] = (s.vocab_size, s.hidden_size)
    return plan


def centred_norm(reader: WeightReader, name: str, eps: float) -> RMSNorm:
    """Zero-centred Qwen3.5 RMSNorm: the checkpoint holds w, the op multiplies by 1 + w."""
    return RMSNorm(reader.upload(1.0 + reader.array(name)), eps)


def query_and_gate(name: str, dims: AttentionDims) -> tuple[RowPart, RowPart]:
    """q_proj [Hq * 2 * D, H] holds per head D query rows, then D gate rows."""
    query_rows = (np.arange(dims.num_heads)[:, None] * 2 * dims.head_dim + np.arange(dims.head_dim)).reshape(-1)
    return RowPart(name, query_rows), RowPart(name, query_rows + dims.head_dim)


def build_attention(reader: WeightReader, s: ModelSpec, p: str, rotary: Rotary) -> Attention:
    dims = AttentionDims(s.num_attention_heads, s.num_key_value_heads, s.head_dim)
    attn = f"{p}self_attn."
    qgkv = reader.split_linear([
        *query_and_gate(f"{attn}q_proj.weight", dims), RowPart(f"{attn}k_proj.weight"), RowPart(f"{attn}v_proj.weight"),
    ])  # fmt: skip
    weights = AttentionWeights(
        qgkv=qgkv,
        o=reader.tensor(f"{attn}o_proj.weight"),
        q_norm=centred_norm(reader, f"{attn}q_norm.weight", s.rms_norm_eps),
        k_norm=centred_norm(reader, f"{attn}k_norm.weight", s.rms_norm_eps),
    )
    return Attention(weights, dims, rotary)


def build_delta_net(reader: WeightReader, s: ModelSpec, p: str) -> GatedDeltaNet:
    dims = delta_net_dims(s)
    la = f"{p}linear_attn."
    weights = DeltaNetWeights(
        in_proj=reader.split_linear([RowPart(f"{la}in_proj_{part}.weight") for part in ("qkv", "z", "b", "a")]),
        conv=reader.upload(reader.array(f"{la}conv1d.weight")[:, 0, :]),  # [C, K]
        A_log=reader.tensor(f"{la}A_log"),
        dt_bias=reader.tensor(f"{la}dt_bias"),
        norm=RMSNorm(reader.tensor(f"{la}norm.weight"), s.rms_norm_eps),
        out=reader.tensor(f"{la}out_proj.weight"),
    )
    return GatedDeltaNet(weights, dims)


def expert_names(s: ModelSpec, p: str, parts: tuple[str, ...]) -> list[str]:
    """Per-expert checkpoint names, expert-major: parts ("gate", "up") -> gate 0, up 0, gate 1, ..."""
    return [f"{p}mlp.experts.{e}.{w}_proj.weight" for e in range(s.num_experts) for w in parts]


def shared_names(p: str, parts: tuple[str, ...]) -> list[str]:
    return [f"{p}mlp.shared_expert.{w}_proj.weight" for w in parts]


def stacked_experts(reader: WeightReader, s: ModelSpec, p: str, fused: bool) -> tuple[np.ndarray, np.ndarray]:
    """(gate_up [E, 2I, H] gate rows first, down [E, H, I]) from either checkpoint layout."""
    if fused:
        return reader.array(f"{p}mlp.experts.gate_up_proj"), reader.array(f"{p}mlp.experts.down_proj")
    experts = range(s.num_experts)
    gate_up = np.stack([
        np.concatenate([reader.array(f"{p}mlp.experts.{e}.gate_proj.weight"),
                        reader.array(f"{p}mlp.experts.{e}.up_proj.weight")])
        for e in experts
    ])  # fmt: skip
    down = np.stack([reader.array(f"{p}mlp.experts.{e}.down_proj.weight") for e in experts])
    return gate_up, down


def upload_stack(reader: WeightReader, blocks: list[np.ndarray]) -> Tensor:
    """Matrix stacks concatenated along dim 0 on the backend: by `upload_stacked` when it has it
    (CUDA: block by block into one allocation, so the host never copies a 2 GB expert stack),
    else one host concatenation."""
    upload_stacked = getattr(reader.backend, "upload_stacked", None)
    if upload_stacked is not None:
        return upload_stacked(blocks, "bf16")
    return reader.upload(np.concatenate(blocks))


def expert_tensors(reader: WeightReader, s: ModelSpec, p: str, fused: bool) -> tuple[Tensor, Tensor]:
    """(gate_up, down) on the backend: packed when the backend takes quantized stacks, else float."""
    if not fused and reader.can_pack(expert_names(s, p, ("gate", "up", "down"))):
        (gate_up,) = reader.packed(expert_names(s, p, ("gate", "up")), experts=s.num_experts)
        (down,) = reader.packed(expert_names(s, p, ("down",)), experts=s.num_experts)
        return gate_up, down
    gate_up_array, down_array = stacked_experts(reader, s, p, fused)
    return reader.upload(gate_up_array), reader.upload(down_array)


def experts_with_shared(reader: WeightReader, s: ModelSpec, p: str, fused: bool) -> tuple[Tensor, Tensor] | None:
    """(gate_up [E + 1, 2I, H], down [E + 1, H, I]) with the shared expert as expert E; None when
    the sizes differ or only one of the two goes to the backend packed (then they run apart)."""
    if s.shared_expert_intermediate_size != s.moe_intermediate_size:
        return None
    routed = [] if fused else expert_names(s, p, ("gate", "up", "down"))
    shared = shared_names(p, ("gate", "up", "down"))
    if routed and reader.can_pack(routed + shared):
        experts = s.num_experts + 1
        (gate_up,) = reader.packed(expert_names(s, p, ("gate", "up")) + shared[:2], experts=experts)
        (down,) = reader.packed(expert_names(s, p, ("down",)) + shared[2:], experts=experts)
        return gate_up, down
    if (routed and reader.can_pack(routed)) or reader.can_pack(shared):
        return None
    gate_up, down = stacked_experts(reader, s, p, fused)  # [E, 2I, H], [E, H, I]
    shared_gate_up = np.concatenate([reader.array(n) for n in shared[:2]])[None]  # [1, 2I, H]
    shared_down = reader.array(shared[2])[None]  # [1, H, I]
    return upload_stack(reader, [gate_up, shared_gate_up]), upload_stack(reader, [down, shared_down])


def shared_gate_up(reader: WeightReader, p: str) -> Tensor:
    names = shared_names(p, ("gate", "up"))
    if reader.can_pack(names):
        return reader.packed(names)[0]
    return reader.upload(np.concatenate([reader.array(n) for n in names]))


def build_moe(reader: WeightReader, s: ModelSpec, p: str, fused: bool) -> SparseMoe:
    """The shared expert stacked as expert E when it can be (one routed slot more), else apart."""
    stacked = experts_with_shared(reader, s, p, fused)
    if stacked is not None:
        gate_rows = [reader.array(f"{p}mlp.gate.weight"), reader.array(f"{p}mlp.shared_expert_gate.weight")]
        return SparseMoe(router=reader.upload(np.concatenate(gate_rows)), gate_up=stacked[0], down=stacked[1],
                         shared=None, top_k=s.num_experts_per_tok, renormalize=s.norm_topk_prob)  # [E + 1, H] router
    gate_up, down = expert_tensors(reader, s, p, fused)
    shared = SharedExpert(
        Mlp(shared_gate_up(reader, p), reader.tensor(shared_names(p, ("down",))[0])),
        gate=reader.tensor(f"{p}mlp.shared_expert_gate.weight"),
    )
    return SparseMoe(router=reader.tensor(f"{p}mlp.gate.weight"), gate_up=gate_up, down=down, shared=shared,
                     top_k=s.num_experts_per_tok, renormalize=s.norm_topk_prob)


def build_layer(reader: WeightReader, layout: Layout, i: int, rotary: Rotary) -> DecoderLayer:
    s, p = layout.spec, layout.layer(i)
    full = s.layer_types[i] == "full_attention"
    mixer = build_attention(reader, s, p, rotary) if full else build_delta_net(reader, s, p)
    return DecoderLayer(
        input_norm=centred_norm(reader, f"{p}input_layernorm.weight", s.rms_norm_eps),
        mixer=mixer,
        post_norm=centred_norm(reader, f"{p}post_attention_layernorm.weight", s.rms_norm_eps),
        ffn=build_moe(reader, s, p, layout.fused_experts),
    )


def check_supported(spec: ModelSpec) -> None:
    if spec.attention_bias:
        raise AtlasError(
            "config.json sets attention_bias=true; atlas runs Qwen3.5 MoE without attention biases"
        )


def check_qwen3_5_moe(spec: ModelSpec, checkpoint: Checkpoint) -> None:
    """What loading checks before it reads a weight: the config is supported, and every tensor the
    text model reads is there with its shape and a readable dtype."""
    check_supported(spec)
    quantized = QuantizedTensors.of(checkpoint)
    for name, shape in model_plan(detect_layout(spec, checkpoint)).items():
        check_tensor(checkpoint, name, shape, quantized)


def load_qwen3_5_moe(spec: ModelSpec, checkpoint: Checkpoint, backend: Backend) -> CausalLM:
    check_supported(spec)
    layout = detect_layout(spec, checkpoint)
    reader = WeightReader(checkpoint, backend, model_plan(layout))
    try:
        rotary = model_rotary(backend, spec)
        embed = Embedding(reader.tensor(f"{layout.prefix}embed_tokens.weight"))
        layers = tuple(build_layer(reader, layout, i, rotary) for i in range(spec.num_hidden_layers))
        final_norm = centred_norm(reader, f"{layout.prefix}norm.weight", spec.rms_norm_eps)
        head = LMHead(embed.table if spec.tie_word_embeddings else reader.tensor("lm_head.weight"))
    finally:
        reader.close()
    return CausalLM(embed, layers, final_norm, head, rotary)
