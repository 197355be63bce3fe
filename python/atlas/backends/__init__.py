"""Backend factory: --device auto|cpu|cuda -> a Backend and a line saying which and why."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ..errors import AtlasError

if TYPE_CHECKING:
    from ..config import ModelSpec
    from ..kvcache.options import KVCacheOptions
    from .base import Backend

Device = Literal["auto", "cpu", "cuda"]
DEVICES: tuple[Device, ...] = ("auto", "cpu", "cuda")


def create_backend(
    device: str, model_dir: Path, spec: ModelSpec, kv_cache: KVCacheOptions | None = None, load_mtp: bool = True
) -> tuple[Backend, str]:
    """(backend, reason). cpu: the numpy reference backend. cuda: the compiled kernels, or an
    AtlasError saying why they cannot run (the device memory check counts the KV cache at its
    level and the MTP head when it will be loaded). auto: cuda when it can run, else cpu with the
    reason."""
    if device not in DEVICES:
        raise AtlasError(f"--device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "cpu":
        check_numpy_fits(Path(model_dir), spec, kv_cache, load_mtp)
        return open_numpy_backend(), "cpu (numpy float32 reference backend, as requested)"
    try:
        backend = open_cuda_backend(Path(model_dir), spec, kv_cache, load_mtp)
    except AtlasError as err:
        if device == "cuda":
            raise
        check_numpy_fits(Path(model_dir), spec, kv_cache, load_mtp)
        return open_numpy_backend(), f"cpu (numpy float32 reference backend; cuda unavailable: {err})"
    return backend, f"cuda ({'as requested' if device == 'cuda' else 'auto: GPU kernels available'})"


def check_numpy_fits(
    model_dir: Path, spec: ModelSpec, kv_cache: KVCacheOptions | None, load_mtp: bool, meminfo: Path | None = None
) -> None:
    """AtlasError (one line, both sizes and the fixes) when the numpy backend's weights, KV cache
    and states at the engine's max_seq_len exceed MemAvailable; read from headers only."""
    from ..engine import DEFAULT_MAX_SEQ_LEN
    from ..kvcache.options import KVCacheOptions
    from ..safetensors import Checkpoint
    from .host_memory import MEMINFO, HostRun, available_bytes, check_host_memory, host_footprint

    run = HostRun(DEFAULT_MAX_SEQ_LEN, kv_cache or KVCacheOptions(), load_mtp)
    footprint = host_footprint(spec, Checkpoint.open(model_dir), run)
    check_host_memory(footprint, available_bytes(meminfo or MEMINFO))


def open_numpy_backend() -> Backend:
    from .numpy_backend import NumpyBackend

    return NumpyBackend()


def open_cuda_backend(model_dir: Path, spec: ModelSpec, kv_cache: KVCacheOptions | None, load_mtp: bool) -> Backend:
    try:
        from .cuda import open_backend
        from .cuda.footprint import RunShape
    except ImportError as err:
        raise AtlasError(f"the CUDA backend cannot be imported ({err}); use --device cpu") from None
    run = RunShape(load_mtp=load_mtp) if kv_cache is None else RunShape(kv_cache=kv_cache, load_mtp=load_mtp)
    return open_backend(model_dir, spec, run)
