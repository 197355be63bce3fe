"""Backend factory: --device auto|cpu|cuda -> a Backend and a line saying which and why."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ..errors import AtlasError

if TYPE_CHECKING:
    from ..config import ModelSpec
    from .base import Backend
    from .run_plan import RunPlan

Device = Literal["auto", "cpu", "cuda"]
DEVICES: tuple[Device, ...] = ("auto", "cpu", "cuda")


def create_backend(device: str, model_dir: Path, spec: ModelSpec, run: RunPlan | None = None) -> tuple[Backend, str]:
    """(backend, reason). cpu: the numpy reference backend. cuda: the compiled kernels, or an
    AtlasError saying why they cannot run. auto: cuda when it can run, else cpu with the reason.
    The memory checks count what `run` (default: `atlas run`'s) holds beside the weights: the
    KV cache at its capacity and level, the MTP head when it will be loaded."""
    from .run_plan import RunPlan

    run = run or RunPlan()
    if device not in DEVICES:
        raise AtlasError(f"--device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "cpu":
        check_numpy_fits(Path(model_dir), spec, run)
        return open_numpy_backend(), "cpu (numpy float32 reference backend, as requested)"
    if device == "auto":
        check_gpu_settings()  # a bad value refuses here as it would on a GPU, not a quiet CPU run
    try:
        backend = open_cuda_backend(Path(model_dir), spec, run)
    except AtlasError as err:
        if device == "cuda":
            raise
        check_numpy_fits(Path(model_dir), spec, run)
        return open_numpy_backend(), f"cpu (numpy float32 reference backend; cuda unavailable: {err})"
    return backend, f"cuda ({'as requested' if device == 'cuda' else 'auto: GPU kernels available'})"


def check_numpy_fits(model_dir: Path, spec: ModelSpec, run: RunPlan, meminfo: Path | None = None) -> None:
    """AtlasError (one line, both sizes and the fixes) when the numpy backend's weights, KV cache
    and states at the run's max_seq_len exceed MemAvailable; read from headers only."""
    from ..safetensors import Checkpoint
    from .host_memory import MEMINFO, available_bytes, check_host_memory, host_footprint

    footprint = host_footprint(spec, Checkpoint.open(model_dir), run)
    check_host_memory(footprint, available_bytes(meminfo or MEMINFO))


def open_numpy_backend() -> Backend:
    from .numpy_backend import NumpyBackend

    return NumpyBackend()


def check_gpu_settings() -> None:
    try:
        from .cuda.select import check_gpu_settings as check
    except ImportError:  # the auto fall-back says why the CUDA backend cannot be imported
        return
    check()


def open_cuda_backend(model_dir: Path, spec: ModelSpec, run: RunPlan) -> Backend:
    try:
        from .cuda import open_backend
    except ImportError as err:
        raise AtlasError(f"the CUDA backend cannot be imported ({err}); use --device cpu") from None
    return open_backend(model_dir, spec, run)
