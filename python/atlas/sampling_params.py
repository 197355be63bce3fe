"""vLLM's `vllm.sampling_params` names, so `from atlas.sampling_params import ...` follows a
script's `from vllm.sampling_params import ...` (atlas.vllm_api holds them)."""

from .beam_search import BeamSearchParams
from .vllm_api import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

__all__ = ["BeamSearchParams", "GuidedDecodingParams", "SamplingParams", "StructuredOutputsParams"]
