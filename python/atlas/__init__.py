"""atlas: ahead-of-time compiled LLM inference kernels with a thin Python runtime.

Importing atlas stays light (no numpy) so build tools can import atlas.targets and
atlas.kernel_params; `LLM` is loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .embed import PoolingParams
    from .llm import LLM
    from .vllm_api import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "PoolingParams", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):  # vLLM's offline API (atlas.vllm_api)
        from . import vllm_api

        return getattr(vllm_api, name)
    if name == "PoolingParams":  # vLLM's, for LLM.embed (atlas.embed)
        from .embed import PoolingParams

        return PoolingParams
    if name == "__version__":
        try:
            from ._version import version
        except ImportError:  # source tree never built: _version.py is written by the build
            return "0.1.0+src"
        return version
    raise AttributeError(f"module 'atlas' has no attribute {name!r}")
