// generated from kernels/templates/bf16/attention_mma.cu.j2 by build_tools/instances.py; do not edit
// Prefill attention on tensor cores (opt-in: ATLAS_PREFILL_ATTENTION=mma), 4 warps x 16 rows: over
// the bf16 cache, and over each quantized KV level (its tiles decoded to bf16, kv_quant_mma.cuh).
#include "atlas/kv_quant_mma.cuh"

extern "C" __global__ void __launch_bounds__(128) atlas_attention_prefill_mma(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_prefill_mma<atlas::model::head_dim>(p);
}
extern "C" __global__ void __launch_bounds__(128) atlas_attention_prefill_mma_fp8(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_prefill_mma<atlas::model::head_dim, atlas::KvqMmaKv<atlas::KvLevel::fp8, atlas::model::head_dim>>(p);
}
extern "C" __global__ void __launch_bounds__(128) atlas_attention_prefill_mma_nvfp4(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_prefill_mma<atlas::model::head_dim, atlas::KvqMmaKv<atlas::KvLevel::nvfp4, atlas::model::head_dim>>(p);
}
extern "C" __global__ void __launch_bounds__(128) atlas_attention_prefill_mma_turbo8(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_prefill_mma<atlas::model::head_dim, atlas::KvqMmaKv<atlas::KvLevel::turbo8, atlas::model::head_dim>>(p);
}
extern "C" __global__ void __launch_bounds__(128) atlas_attention_prefill_mma_turbo4(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_prefill_mma<atlas::model::head_dim, atlas::KvqMmaKv<atlas::KvLevel::turbo4, atlas::model::head_dim>>(p);
}
extern "C" __global__ void __launch_bounds__(128) atlas_attention_prefill_mma_turbo3(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_prefill_mma<atlas::model::head_dim, atlas::KvqMmaKv<atlas::KvLevel::turbo3, atlas::model::head_dim>>(p);
}
