// generated from kernels/templates/bf16/attention_mma.cu.j2 by build_tools/instances.py; do not edit
// Prefill attention on tensor cores (opt-in: ATLAS_PREFILL_ATTENTION=mma), 4 warps x 16 rows.
#include "atlas/attention_mma.cuh"

extern "C" __global__ void __launch_bounds__(128) atlas_attention_prefill_mma(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_prefill_mma<atlas::model::head_dim>(p);
}
