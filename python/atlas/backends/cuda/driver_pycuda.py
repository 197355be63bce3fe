"""Driver binding through pycuda (ATLAS_CUDA_BINDING=pycuda), on pycuda's documented API only
(doc/driver.rst of pycuda 2026.1; the newest feature used, Function.set_attribute with
function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, is "versionadded 2022.1").

pycuda raises its own `pycuda.driver.Error` on every failed call; this adapter re-raises it as
CudaError naming the call. Released pycuda has no stream capture (CUDA graph support, pycuda
pull request #343, was never merged), so `graphs` is False and decode runs without graphs.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
from collections.abc import Callable
from typing import Any

import numpy as np

from atlas.errors import AtlasError

from .driver import CudaError, DeviceInfo, Handle, LaunchArgs, no_such_device, sticky_result

MIN_VERSION = (2022, 1)
NO_CAPTURE = "pycuda has no CUDA stream capture (no released version has graphs); decode runs without CUDA graphs"


def _import_pycuda() -> tuple[Any, Any]:
    """(pycuda, pycuda.driver), or one AtlasError line saying what to install or fix."""
    if importlib.util.find_spec("pycuda") is None:
        raise AtlasError(
            "ATLAS_CUDA_BINDING=pycuda but pycuda is not installed; "
            "install it (`pip install pycuda`, builds from source) or unset ATLAS_CUDA_BINDING"
        )
    try:
        import pycuda
        import pycuda.driver as cuda
    except ImportError as err:  # pycuda._driver links libcuda: no NVIDIA driver, or a broken build
        raise AtlasError(f"pycuda is installed but does not load ({err}); install the NVIDIA driver, "
                         "reinstall pycuda, or unset ATLAS_CUDA_BINDING") from None
    version = tuple(getattr(pycuda, "VERSION", (0,)))
    if version < MIN_VERSION:
        text = getattr(pycuda, "VERSION_TEXT", ".".join(map(str, version)))
        raise AtlasError(f"pycuda {text} is older than {MIN_VERSION[0]}.{MIN_VERSION[1]}, which atlas needs "
                         "(Function.set_attribute); upgrade it (`pip install -U pycuda`) or unset ATLAS_CUDA_BINDING")
    return pycuda, cuda


def _host_bytes(addr: int, nbytes: int) -> memoryview:
    """A host address range as a writable buffer (pycuda's copies take buffer objects)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


class PycudaDriver:
    binding = "pycuda"
    graphs = False
    programmatic = False  # pycuda has no cuLaunchKernelEx

    def __init__(self, ordinal: int = 0) -> None:
        _, cuda = _import_pycuda()
        self._cuda = cuda
        try:
            cuda.init()
            count = cuda.Device.count()
        except cuda.Error as err:
            raise AtlasError(f"no usable NVIDIA GPU through pycuda: {err}") from None
        if count <= ordinal:
            raise no_such_device(ordinal, count)
        self._device = self._invoke("Device", cuda.Device, ordinal)
        self._context = self._invoke("Device.retain_primary_context", self._device.retain_primary_context)
        self._allocations: dict[int, Any] = {}
        self._pinned: dict[int, np.ndarray] = {}
        atexit.register(self.release)

    def _call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn` with the primary context current on this thread for the call alone. Contexts are
        current per thread and pycuda keeps a stack per thread that must be empty when the
        thread (or the process) ends, or it aborts; so nothing stays pushed, and any thread may
        call (an LLM built on one thread and run on another)."""
        if self._context is None:
            raise CudaError(f"{name}: the pycuda driver was released at exit")
        self._invoke("Context.push", self._context.push)
        try:
            return self._invoke(name, fn, *args, **kwargs)
        finally:
            self._invoke("Context.pop", self._cuda.Context.pop)

    def _invoke(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._cuda.MemoryError as err:  # memory.py recognises the driver's name for it
            raise CudaError(f"{name} failed: CUDA_ERROR_OUT_OF_MEMORY ({err})") from None
        except self._cuda.Error as err:
            result = sticky_result(str(err))  # pycuda's message has the words, not the result's name
            raise CudaError(f"{name} failed: {f'{result} ({err})' if result else err}") from None

    def release(self) -> None:
        """Free what is still allocated (at exit; idempotent)."""
        if self._context is None:
            return
        for allocation in self._allocations.values():
            try:
                self._call("DeviceAllocation.free", allocation.free)
            except CudaError:
                pass
        self._allocations.clear()
        self._pinned.clear()  # pycuda frees page-locked memory in its own context when collected
        self._context = None

    def device_info(self) -> DeviceInfo:
        attr, dev = self._cuda.device_attribute, self._device
        major, minor = dev.compute_capability()
        return DeviceInfo(
            name=dev.name(),
            cc=(int(major), int(minor)),
            sm_count=int(dev.get_attribute(attr.MULTIPROCESSOR_COUNT)),
            max_smem_optin=int(dev.get_attribute(attr.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)),
            total_bytes=int(dev.total_memory()),
            driver_version=int(self._cuda.get_driver_version()),
        )

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._call("mem_get_info", self._cuda.mem_get_info)
        return int(free), int(total)

    def module_load(self, image: bytes) -> Handle:
        return self._call("module_from_buffer", self._cuda.module_from_buffer, image)

    def module_unload(self, module: Handle) -> None:
        """Nothing to call: pycuda unloads a module when its object is collected."""

    def stream_destroy(self, stream: Handle) -> None:
        """Nothing to call: pycuda destroys a stream when its object is collected."""

    def get_function(self, module: Handle, name: str) -> Handle:
        return self._call(f"Module.get_function({name})", module.get_function, name)

    def set_max_dynamic_smem(self, function: Handle, nbytes: int) -> None:
        attr = self._cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._call("Function.set_attribute", function.set_attribute, attr, int(nbytes))

    def mem_alloc(self, nbytes: int) -> int:
        allocation = self._call("mem_alloc", self._cuda.mem_alloc, max(int(nbytes), 1))
        ptr = int(allocation)
        self._allocations[ptr] = allocation  # freed through its DeviceAllocation, kept by address
        return ptr

    def mem_free(self, ptr: int) -> None:
        allocation = self._allocations.pop(ptr, None)
        if allocation is None:
            raise CudaError(f"mem_free({ptr:#x}) failed: not an allocation of this driver")
        self._call("DeviceAllocation.free", allocation.free)

    def host_alloc(self, nbytes: int) -> int:
        pinned = self._call("pagelocked_empty", self._cuda.pagelocked_empty, (max(int(nbytes), 1),), np.uint8)
        ptr = int(pinned.ctypes.data)
        self._pinned[ptr] = pinned  # page-locked while the array lives
        return ptr

    def host_free(self, ptr: int) -> None:
        if self._pinned.pop(ptr, None) is None:
            raise CudaError(f"host_free({ptr:#x}) failed: not a page-locked allocation of this driver")

    # The host copies are the synchronous forms: pycuda documents memcpy_htod_async/dtoh_async
    # for page-locked host memory only, and atlas copies from numpy arrays. They run on the
    # legacy default stream, which `Stream()` (flags 0, a blocking stream) is ordered with.
    def memcpy_htod(self, dst: int, src_host: int, nbytes: int, stream: Handle) -> None:
        self._call("memcpy_htod", self._cuda.memcpy_htod, dst, _host_bytes(src_host, nbytes))

    def memcpy_dtoh(self, dst_host: int, src: int, nbytes: int, stream: Handle) -> None:
        self._call("memcpy_dtoh", self._cuda.memcpy_dtoh, _host_bytes(dst_host, nbytes), src)

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: Handle) -> None:
        self._call("memcpy_dtod_async", self._cuda.memcpy_dtod_async, dst, src, nbytes, stream)

    def memset_d8(self, dst: int, value: int, nbytes: int, stream: Handle) -> None:
        self._call("memset_d8_async", self._cuda.memset_d8_async, dst, value, nbytes, stream)

    def launch(self, launch: LaunchArgs) -> None:
        # The kernel's one argument is the params struct by value: prepared as a numpy void
        # dtype of its size, which pycuda packs as struct format "<size>s" (the bytes verbatim).
        function = launch.function
        function.prepare([np.dtype((np.void, launch.params_size))])
        packed = ctypes.string_at(launch.params_addr, launch.params_size)
        grid = tuple(int(g) for g in launch.grid)
        block = tuple(int(b) for b in launch.block)
        self._call(f"launch of {launch.kernel} grid={grid} block={block} smem={launch.smem}",
                   function.prepared_async_call, grid, block, launch.stream, packed, shared_size=launch.smem)

    def stream_create(self) -> Handle:
        return self._call("Stream", self._cuda.Stream)

    def stream_synchronize(self, stream: Handle) -> None:
        self._call("Stream.synchronize", stream.synchronize)

    def event_create(self) -> Handle:
        return self._call("Event", self._cuda.Event)

    def event_record(self, event: Handle, stream: Handle) -> None:
        self._call("Event.record", event.record, stream)

    def event_synchronize(self, event: Handle) -> None:
        self._call("Event.synchronize", event.synchronize)

    def event_elapsed_ms(self, start: Handle, end: Handle) -> float:
        return float(self._call("Event.time_since", end.time_since, start))

    def begin_capture(self, stream: Handle) -> None:
        raise CudaError(NO_CAPTURE)

    def end_capture(self, stream: Handle) -> Handle:
        raise CudaError(NO_CAPTURE)

    def graph_launch(self, graph_exec: Handle, stream: Handle) -> None:
        raise CudaError(NO_CAPTURE)

    def graph_destroy(self, graph_exec: Handle) -> None:
        raise CudaError(NO_CAPTURE)
