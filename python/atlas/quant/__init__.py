"""Quantized checkpoint formats on the host: block FP8 and ModelOpt NVFP4.

codes       e4m3 / e2m1 element codes from their bit layouts
fp8_block   block FP8 quantize / dequantize
nvfp4       NVFP4 quantize / dequantize (packed nibbles, two-level scales)
scheme      a checkpoint directory's quantization settings
stored      quantized weights as a checkpoint stores them (the loader's view)
exclusions  which weights the quantizer converts
convert     bf16 tensors -> quantized tensors; writer: streaming safetensors shards
memory      weight bytes per format
"""
