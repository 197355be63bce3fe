"""Driver binding through pycuda (ATLAS_CUDA_BINDING=pycuda). pycuda raises on every failed
call itself; this adapter re-raises as CudaError naming the call. CUDA graphs are used when the
installed pycuda has stream capture (2021.1+), else decode runs without graphs."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from atlas.errors import AtlasError

from .driver import CudaError, DeviceInfo, Handle, LaunchArgs, no_such_device


def _call(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as err:
        raise CudaError(f"{name} failed: {err}") from None


class _HostSpan:
    """A host address range as a writable buffer object (pycuda copies take buffers)."""

    @staticmethod
    def view(addr: int, nbytes: int) -> memoryview:
        return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


class PycudaDriver:
    binding = "pycuda"

    def __init__(self, ordinal: int = 0) -> None:
        try:
            import pycuda.driver as cuda
        except ImportError:
            raise AtlasError(
                "ATLAS_CUDA_BINDING=pycuda but pycuda is not installed; "
                "install it (`pip install pycuda`, builds from source) or unset ATLAS_CUDA_BINDING"
            ) from None
        self._cuda = cuda
        try:
            cuda.init()
            count = cuda.Device.count()
        except Exception as err:
            raise AtlasError(f"no usable NVIDIA GPU through pycuda: {err}") from None
        if count <= ordinal:
            raise no_such_device(ordinal, count)
        self._device = cuda.Device(ordinal)
        self._context = _call("retain_primary_context", self._device.retain_primary_context)
        _call("Context.push", self._context.push)
        self.graphs = hasattr(cuda.Stream, "begin_capture")
        self._allocations: dict[int, Any] = {}

    def device_info(self) -> DeviceInfo:
        attr = self._cuda.device_attribute
        dev = self._device
        return DeviceInfo(
            name=dev.name(),
            cc=tuple(dev.compute_capability()),  # type: ignore[arg-type]
            sm_count=dev.get_attribute(attr.MULTIPROCESSOR_COUNT),
            max_smem_optin=dev.get_attribute(attr.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
            total_bytes=dev.total_memory(),
            driver_version=self._cuda.get_driver_version(),
        )

    def mem_get_info(self) -> tuple[int, int]:
        free, total = _call("mem_get_info", self._cuda.mem_get_info)
        return int(free), int(total)

    def module_load(self, image: bytes) -> Handle:
        return _call("module_from_buffer", self._cuda.module_from_buffer, image)

    def get_function(self, module: Handle, name: str) -> Handle:
        return _call(f"get_function({name})", module.get_function, name)

    def set_max_dynamic_smem(self, function: Handle, nbytes: int) -> None:
        attr = self._cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES
        _call("Function.set_attribute", function.set_attribute, attr, nbytes)

    def mem_alloc(self, nbytes: int) -> int:
        allocation = _call("mem_alloc", self._cuda.mem_alloc, max(nbytes, 1))
        self._allocations[int(allocation)] = allocation
        return int(allocation)

    def mem_free(self, ptr: int) -> None:
        # pycuda frees through its DeviceAllocation objects, kept here by address.
        allocation = self._allocations.pop(ptr, None)
        if allocation is not None:
            _call("DeviceAllocation.free", allocation.free)

    def memcpy_htod(self, dst: int, src_host: int, nbytes: int, stream: Handle) -> None:
        _call("memcpy_htod_async", self._cuda.memcpy_htod_async, dst, _HostSpan.view(src_host, nbytes), stream)

    def memcpy_dtoh(self, dst_host: int, src: int, nbytes: int, stream: Handle) -> None:
        _call("memcpy_dtoh_async", self._cuda.memcpy_dtoh_async, _HostSpan.view(dst_host, nbytes), src, stream)

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: Handle) -> None:
        _call("memcpy_dtod_async", self._cuda.memcpy_dtod_async, dst, src, nbytes, stream)

    def memset_d8(self, dst: int, value: int, nbytes: int, stream: Handle) -> None:
        _call("memset_d8_async", self._cuda.memset_d8_async, dst, value, nbytes, stream)

    def launch(self, launch: LaunchArgs) -> None:
        # pycuda's _launch_kernel takes the packed argument buffer; ours is the one params struct.
        packed = ctypes.string_at(launch.params_addr, launch.params_size)
        _call(
            f"launch {launch.kernel} grid={launch.grid} block={launch.block}",
            launch.function._launch_kernel,
            launch.grid,
            launch.block,
            packed,
            launch.smem,
            launch.stream,
        )

    def stream_create(self) -> Handle:
        return _call("Stream", self._cuda.Stream)

    def stream_synchronize(self, stream: Handle) -> None:
        _call("Stream.synchronize", stream.synchronize)

    def event_create(self) -> Handle:
        return _call("Event", self._cuda.Event)

    def event_record(self, event: Handle, stream: Handle) -> None:
        _call("Event.record", event.record, stream)

    def event_synchronize(self, event: Handle) -> None:
        _call("Event.synchronize", event.synchronize)

    def event_elapsed_ms(self, start: Handle, end: Handle) -> float:
        return float(_call("Event.time_since", end.time_since, start))

    def begin_capture(self, stream: Handle) -> None:
        mode = self._cuda.capture_mode.RELAXED
        _call("Stream.begin_capture", stream.begin_capture, mode)

    def end_capture(self, stream: Handle) -> Handle:
        graph = _call("Stream.end_capture", stream.end_capture)
        return _call("Graph.instantiate", graph.instantiate)

    def graph_launch(self, graph_exec: Handle, stream: Handle) -> None:
        _call("GraphExec.launch", graph_exec.launch, stream)

    def graph_destroy(self, graph_exec: Handle) -> None:
        del graph_exec
