// generated from kernels/templates/bf16/embedding.cu.j2 by build_tools/instances.py; do not edit
#include "atlas/embedding.cuh"

extern "C" __global__ void __launch_bounds__(256) atlas_embedding_bf16(const EmbeddingParams p) {
  atlas::pdl_enter();
  atlas::embedding<uint16_t>(p);
}

extern "C" __global__ void __launch_bounds__(256) atlas_embedding_f32(const EmbeddingParams p) {
  atlas::pdl_enter();
  atlas::embedding<float>(p);
}
