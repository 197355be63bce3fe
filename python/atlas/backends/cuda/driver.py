"""The few CUDA driver calls atlas needs, behind one small interface with two bindings.

`CudaBindingsDriver` uses cuda-python's driver API (`cuda.bindings.driver`, the default);
`PycudaDriver` uses pycuda when `ATLAS_CUDA_BINDING=pycuda`. Handles (modules, functions,
streams, events, graphs) are opaque objects; device pointers are plain ints. Every call's
result is checked; a failure raises `CudaError` naming the call and the driver's message.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from atlas.errors import AtlasError

Handle = Any


# The results after which the CUDA context is unusable for the rest of the process ("leaves the
# process in an inconsistent state", the driver API's reference): a kernel fault reported at the
# next synchronising call. Value: the words of the driver's message for it (pycuda gives only those).
STICKY_RESULTS = {
    "CUDA_ERROR_ECC_UNCORRECTABLE": "uncorrectable ECC error",
    "CUDA_ERROR_ILLEGAL_ADDRESS": "illegal memory access",
    "CUDA_ERROR_LAUNCH_TIMEOUT": "launch timed out",
    "CUDA_ERROR_HARDWARE_STACK_ERROR": "hardware stack error",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION": "illegal instruction",
    "CUDA_ERROR_MISALIGNED_ADDRESS": "misaligned address",
    "CUDA_ERROR_INVALID_ADDRESS_SPACE": "address space",
    "CUDA_ERROR_INVALID_PC": "invalid program counter",
    "CUDA_ERROR_LAUNCH_FAILED": "unspecified launch failure",
}


class CudaError(RuntimeError):
    """A CUDA driver call failed (a bug or a broken device, not a user error). The message names
    the driver's result (CUDA_ERROR_...) where the binding gives it."""

    @property
    def sticky(self) -> bool:
        """The context is lost: every later CUDA call of this process fails too."""
        return any(result in str(self) for result in STICKY_RESULTS)


def context_lost(error: BaseException | None) -> bool:
    """`error` is a sticky CudaError, or has one as its cause: no CUDA call of this process can
    succeed again (a server should say it is unhealthy, a test run start a new process)."""
    while error is not None:
        if isinstance(error, CudaError) and error.sticky:
            return True
        error = error.__cause__ or error.__context__
    return False


def sticky_result(message: str) -> str | None:
    """The STICKY_RESULTS name whose words a driver message (pycuda's) holds, or None."""
    lowered = message.lower()
    return next((name for name, words in STICKY_RESULTS.items() if words in lowered), None)


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    cc: tuple[int, int]
    sm_count: int
    max_smem_optin: int
    total_bytes: int
    driver_version: int


class Driver(Protocol):
    """What the runtime calls; each method checks its CUresult."""

    binding: str
    graphs: bool  # False when the binding cannot capture CUDA graphs
    programmatic: bool  # False when the binding cannot launch with programmatic stream serialization

    def device_info(self) -> DeviceInfo: ...
    def mem_get_info(self) -> tuple[int, int]: ...  # (free, total) bytes
    def module_load(self, image: bytes) -> Handle: ...
    def module_unload(self, module: Handle) -> None: ...
    def get_function(self, module: Handle, name: str) -> Handle: ...
    def set_max_dynamic_smem(self, function: Handle, nbytes: int) -> None: ...
    def mem_alloc(self, nbytes: int) -> int: ...
    def mem_free(self, ptr: int) -> None: ...
    def host_alloc(self, nbytes: int) -> int: ...  # page-locked host memory: a copy into it is truly async
    def host_free(self, ptr: int) -> None: ...
    def memcpy_htod(self, dst: int, src_host: int, nbytes: int, stream: Handle) -> None: ...
    def memcpy_dtoh(self, dst_host: int, src: int, nbytes: int, stream: Handle) -> None: ...
    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: Handle) -> None: ...
    def memset_d8(self, dst: int, value: int, nbytes: int, stream: Handle) -> None: ...
    def launch(self, launch: "LaunchArgs") -> None: ...
    def stream_create(self) -> Handle: ...
    def stream_destroy(self, stream: Handle) -> None: ...
    def stream_synchronize(self, stream: Handle) -> None: ...
    def event_create(self) -> Handle: ...
    def event_record(self, event: Handle, stream: Handle) -> None: ...
    def event_synchronize(self, event: Handle) -> None: ...
    def event_elapsed_ms(self, start: Handle, end: Handle) -> float: ...
    def begin_capture(self, stream: Handle) -> None: ...
    def end_capture(self, stream: Handle) -> Handle: ...  # -> instantiated executable graph
    def graph_launch(self, graph_exec: Handle, stream: Handle) -> None: ...
    def graph_destroy(self, graph_exec: Handle) -> None: ...


@dataclass(frozen=True)
class LaunchArgs:
    function: Handle
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    stream: Handle
    params_addr: int  # address of the packed params struct (the kernel's single argument)
    params_size: int
    kernel: str  # entry name, for error messages
    # Programmatic dependent launch (sm_90+): the kernel may be launched before the previous one in
    # the stream ends; every entry waits for it in griddepcontrol.wait before touching memory.
    programmatic: bool = False


def no_such_device(ordinal: int, count: int) -> AtlasError:
    """The refusal when device `ordinal` is not among the `count` visible GPUs."""
    if count == 0:
        return AtlasError("no NVIDIA GPU visible (device count 0); use --device cpu")
    return AtlasError(f"ATLAS_CUDA_DEVICE={ordinal}: only {count} GPU(s) visible (0..{count - 1}); "
                      "set it to one of those or unset it")


BINDING_ENV = "ATLAS_CUDA_BINDING"
BINDING_NAMES = {"": "cuda-bindings", "cuda-bindings": "cuda-bindings", "cuda-python": "cuda-bindings",
                 "cuda_bindings": "cuda-bindings", "pycuda": "pycuda"}


def binding_name(environ: Mapping[str, str] = os.environ) -> str:
    """"cuda-bindings" (the default) or "pycuda", as ATLAS_CUDA_BINDING names it; checked."""
    given = environ.get(BINDING_ENV, "cuda-bindings").strip().lower()
    if given not in BINDING_NAMES:
        raise AtlasError(f"{BINDING_ENV}={given!r} is not a CUDA binding atlas knows; "
                         "use 'cuda-bindings' (default) or 'pycuda'")
    return BINDING_NAMES[given]


def open_driver(ordinal: int = 0) -> Driver:
    """The driver binding named by ATLAS_CUDA_BINDING (cuda-bindings by default), initialised
    with the primary context of device `ordinal` current. Raises AtlasError when no binding,
    no driver or no GPU is present."""
    if binding_name() == "pycuda":
        from .driver_pycuda import PycudaDriver

        return PycudaDriver(ordinal)
    from .driver_cuda_bindings import CudaBindingsDriver

    return CudaBindingsDriver(ordinal)
