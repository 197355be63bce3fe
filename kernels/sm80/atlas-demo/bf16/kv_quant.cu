// generated from kernels/templates/bf16/kv_quant.cu.j2 by build_tools/instances.py; do not edit
// Quantized KV cache levels (atlas/kv_quant.cuh): per level a cache writer and the decode /
// prefill attention over it (same shapes as attention.cu; atlas_attention_combine merges splits).
#include "atlas/kv_quant.cuh"
extern "C" __global__ void __launch_bounds__(128) atlas_kv_write_fp8(const KvCacheWriteParams p) {
  atlas::pdl_enter();
  atlas::kv_quant_write<atlas::KvLevel::fp8, atlas::model::head_dim>(p);
}

extern "C" __global__ void __launch_bounds__(128, 1) atlas_attention_decode_fp8(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_block<atlas::model::head_dim, 1, 4, atlas::KvqTile<atlas::KvLevel::fp8, atlas::model::head_dim>>(p);
}

extern "C" __global__ void __launch_bounds__(256, 1) atlas_attention_prefill_fp8(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_block<atlas::model::head_dim, 2, 8, atlas::KvqTile<atlas::KvLevel::fp8, atlas::model::head_dim>>(p);
}
extern "C" __global__ void __launch_bounds__(128) atlas_kv_write_nvfp4(const KvCacheWriteParams p) {
  atlas::pdl_enter();
  atlas::kv_quant_write<atlas::KvLevel::nvfp4, atlas::model::head_dim>(p);
}

extern "C" __global__ void __launch_bounds__(128, 1) atlas_attention_decode_nvfp4(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_block<atlas::model::head_dim, 1, 4, atlas::KvqTile<atlas::KvLevel::nvfp4, atlas::model::head_dim>>(p);
}

extern "C" __global__ void __launch_bounds__(256, 1) atlas_attention_prefill_nvfp4(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_block<atlas::model::head_dim, 2, 8, atlas::KvqTile<atlas::KvLevel::nvfp4, atlas::model::head_dim>>(p);
}
extern "C" __global__ void __launch_bounds__(128) atlas_kv_write_turbo8(const KvCacheWriteParams p) {
  atlas::pdl_enter();
  atlas::kv_quant_write<atlas::KvLevel::turbo8, atlas::model::head_dim>(p);
}

extern "C" __global__ void __launch_bounds__(128, 1) atlas_attention_decode_turbo8(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_block<atlas::model::head_dim, 1, 4, atlas::KvqTile<atlas::KvLevel::turbo8, atlas::model::head_dim>>(p);
}

extern "C" __global__ void __launch_bounds__(256, 1) atlas_attention_prefill_turbo8(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_block<atlas::model::head_dim, 2, 8, atlas::KvqTile<atlas::KvLevel::turbo8, atlas::model::head_dim>>(p);
}
extern "C" __global__ void __launch_bounds__(128) atlas_kv_write_turbo4(const KvCacheWriteParams p) {
  atlas::pdl_enter();
  atlas::kv_quant_write<atlas::KvLevel::turbo4, atlas::model::head_dim>(p);
}

extern "C" __global__ void __launch_bounds__(128, 1) atlas_attention_decode_turbo4(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_block<atlas::model::head_dim, 1, 4, atlas::KvqTile<atlas::KvLevel::turbo4, atlas::model::head_dim>>(p);
}

extern "C" __global__ void __launch_bounds__(256, 1) atlas_attention_prefill_turbo4(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_block<atlas::model::head_dim, 2, 8, atlas::KvqTile<atlas::KvLevel::turbo4, atlas::model::head_dim>>(p);
}
extern "C" __global__ void __launch_bounds__(128) atlas_kv_write_turbo3(const KvCacheWriteParams p) {
  atlas::pdl_enter();
  atlas::kv_quant_write<atlas::KvLevel::turbo3, atlas::model::head_dim>(p);
}

extern "C" __global__ void __launch_bounds__(128, 1) atlas_attention_decode_turbo3(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_block<atlas::model::head_dim, 1, 4, atlas::KvqTile<atlas::KvLevel::turbo3, atlas::model::head_dim>>(p);
}

extern "C" __global__ void __launch_bounds__(256, 1) atlas_attention_prefill_turbo3(const AttentionParams p) {
  atlas::pdl_enter();
  atlas::attention_block<atlas::model::head_dim, 2, 8, atlas::KvqTile<atlas::KvLevel::turbo3, atlas::model::head_dim>>(p);
}
