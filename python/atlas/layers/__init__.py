"""Model layers written against the Backend ops only, so every backend runs the same model code.

Intermediates reach `Step.dump` (when set) under these names, per layer i:
  embed, layer.i.input_norm, layer.i.attn.{q,k,v,core,gated} (full attention: q/k after norm +
  rope), layer.i.attn.{conv,core,gated_norm} (Gated DeltaNet), layer.i.attn_out,
  layer.i.post_norm, layer.i.mlp.{router_ids,router_weights,routed,shared,shared.act},
  layer.i.mlp_out, layer.i.out (the residual stream after the layer), final_norm, logits.
"""
