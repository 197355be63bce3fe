"""The KV cache level names (stdlib only, so the CLI can list them without importing numpy)."""

from __future__ import annotations

LEVEL_NAMES = ("bf16", "fp8", "nvfp4", "turbo8", "turbo4", "turbo3")
DEFAULT_LEVEL = "bf16"
VLLM_KV_NAMES = {"auto": DEFAULT_LEVEL, "fp8_e4m3": "fp8"}  # vLLM's kv_cache_dtype values, as atlas levels
