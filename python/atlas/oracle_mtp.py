"""The Qwen3.5 MTP head built from transformers' own decoder layer and norms (vLLM's qwen3_5_mtp
structure), in torch: the oracle of atlas.layers.mtp and the head scripts/train_demo_mtp.py trains.
Needs the `oracle` extra (torch, transformers)."""

from __future__ import annotations

from pathlib import Path

import torch


class TorchMtpHead(torch.nn.Module):
    """fc(cat[norm_e(embed(next)), norm_h(hidden)]) -> one full-attention MoE layer -> norm."""

    def __init__(self, model_dir: Path) -> None:
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

        super().__init__()
        config = hf.Qwen3_5MoeTextConfig.from_pretrained(model_dir)
        config.layer_types, config.num_hidden_layers = ["full_attention"], 1
        h = config.hidden_size
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = hf.Qwen3_5MoeRMSNorm(h, config.rms_norm_eps)
        self.pre_fc_norm_hidden = hf.Qwen3_5MoeRMSNorm(h, config.rms_norm_eps)
        self.layers = torch.nn.ModuleList([hf.Qwen3_5MoeDecoderLayer(config, 0)])
        self.norm = hf.Qwen3_5MoeRMSNorm(h, config.rms_norm_eps)
        self.rotary = hf.Qwen3_5MoeTextRotaryEmbedding(config)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        tokens = embedded.shape[0]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], -1))[None]
        position_ids = torch.arange(tokens)[None]
        mask = torch.full((tokens, tokens), float("-inf")).triu(1)[None, None]
        out = self.layers[0](x, self.rotary(x, position_ids), attention_mask=mask, position_ids=position_ids)
        return self.norm(out[0] if isinstance(out, tuple) else out)[0]  # [T, H]
