"""The multi-token-prediction (MTP) head of Qwen3-Next / Qwen3.5: drafts the token after next.

At position i it reads the token at i+1 and the main model's hidden state at i:
  x = fc(cat[pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)])
  -> one full-attention + MoE decoder layer with its own KV cache -> mtp.norm -> shared lm_head.
`fc` is kept as its two column halves, so the concatenation is two linears and an add (the op
interface has no concat). Intermediates reach the dump as mtp.{embed,fc,attn_out,mlp_out,out}.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.base import Backend, Tensor
from .attention import KVCache
from .decoder import DecoderLayer
from .embedding import Embedding, LMHead
from .norm import RMSNorm
from .step import Step


@dataclass(frozen=True)
class MtpHead:
    embed: Embedding  # shared with the main model
    embed_norm: RMSNorm  # pre_fc_norm_embedding (stored as 1 + w)
    hidden_norm: RMSNorm  # pre_fc_norm_hidden (stored as 1 + w)
    fc_embed: Tensor  # [H, H]  fc columns 0..H-1 (the embedding half)
    fc_hidden: Tensor  # [H, H]  fc columns H..2H-1 (the hidden-state half)
    layer: DecoderLayer  # full attention + MoE
    norm: RMSNorm  # mtp.norm (stored as 1 + w)
    lm_head: LMHead  # shared with the main model

    def new_state(self, backend: Backend, capacity: int) -> KVCache:
        return self.layer.mixer.new_state(backend, capacity)

    def forward(self, step: Step, ids: Tensor, hidden: Tensor, cache: KVCache) -> Tensor:
        """ids [T] i32 (tokens at positions + 1), hidden [T, H] (the main model's, or this head's
        previous output) at `step.positions` -> mtp-normed hidden [T, H]; the cache is updated.
        The embedding comes first: on the GPU it starts the step, so `hidden` must not live in
        the step's scratch memory."""
        be = step.backend
        embedded = step.emit("mtp.embed", self.embed_norm(step, self.embed(step, ids)))  # [T, H]
        normed_hidden = self.hidden_norm(step, hidden)  # [T, H]
        x = be.add(be.linear(embedded, self.fc_embed), be.linear(normed_hidden, self.fc_hidden))
        x = step.emit("mtp.fc", x)  # [T, H]
        layer = self.layer
        mixed = layer.mixer(step, layer.input_norm(step, x), cache, "mtp.attn")  # [T, H]
        step.emit("mtp.attn_out", mixed)
        normed, residual = layer.post_norm.add(step, mixed, x)
        update = step.emit("mtp.mlp_out", layer.ffn(step, normed, "mtp.mlp"))  # [T, H]
        out, _ = self.norm.add(step, update, residual)
        return step.emit("mtp.out", out)

    def logits(self, step: Step, hidden: Tensor) -> Tensor:
        return self.lm_head(step, hidden)  # [T, V]
