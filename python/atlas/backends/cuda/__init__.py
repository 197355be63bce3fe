"""CUDA backend: driver access (cuda-bindings, or pycuda), runtime, op wrappers, graphs.

Importing this package needs neither a GPU nor cuda-bindings; `open_backend` says plainly
(AtlasError) when either is missing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import CudaBackend

__all__ = ["open_backend", "CudaBackend"]


def __getattr__(name: str) -> Any:
    if name == "open_backend":
        from .select import open_backend

        return open_backend
    if name == "CudaBackend":
        from .backend import CudaBackend

        return CudaBackend
    raise AttributeError(f"module 'atlas.backends.cuda' has no attribute {name!r}")
