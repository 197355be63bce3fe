// generated from kernels/templates/bf16/attention.cu.j2 by build_tools/instances.py; do not edit
// Decode: 4 warps x 1 row per block, many splits + combine. Prefill: 8 warps x 2 rows, one split.
#include "atlas/attention.cuh"

extern "C" __global__ void __launch_bounds__(256) atlas_kv_cache_write(const KvCacheWriteParams p) {
  atlas::pdl_enter();
  atlas::kv_cache_write(p);
}

extern "C" __global__ void __launch_bounds__(128) atlas_attention_decode(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_block<atlas::model::head_dim, 1, 4>(p);
}

extern "C" __global__ void __launch_bounds__(256) atlas_attention_prefill(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_block<atlas::model::head_dim, 2, 8>(p);
}

extern "C" __global__ void __launch_bounds__(256) atlas_attention_combine(const AttentionCombineParams p) {
  atlas::pdl_enter();
  atlas::attention_combine(p);
}
