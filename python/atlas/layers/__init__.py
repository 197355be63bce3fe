"""Model layers written against the Backend ops only, so every backend runs the same model code.

Intermediates reach `Step.dump` (when set) under these names, per layer i:
  positions (emitted by the engine first in each forward), embed, layer.i.input_norm,
  layer.i.attn.{v,q,k,core,gated} (full attention: q/k after norm + rope; not with a fused prep),
  layer.i.attn.{qkv,z,b,a,conv,core,gated_norm} (Gated DeltaNet: qkv, z, b, a from the input
  projection), layer.i.attn_out, layer.i.post_norm,
  layer.i.mlp.{router_logits,router_ids,router_weights,routed,shared,shared.act} (router_logits
  only while a dump is attached; shared.act only when the shared expert runs apart, not stacked
  as expert E), layer.i.mlp_out, layer.i.out (the residual stream after the layer), final_norm,
  logits.
"""
