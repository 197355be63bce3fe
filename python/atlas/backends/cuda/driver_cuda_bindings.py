"""Driver binding through cuda-python (`cuda.bindings.driver`), checking every CUresult."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from atlas.errors import AtlasError

from .driver import CudaError, DeviceInfo, Handle, LaunchArgs, no_such_device


def _import_driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python < 12.6 layout
        except ImportError:
            raise AtlasError(
                "the CUDA backend needs cuda-bindings, which is not installed; "
                "install it with `pip install 'atlas[cuda]'` (or `pip install cuda-bindings`)"
            ) from None
    return driver


class CudaBindingsDriver:
    """A context is current per CPU thread: the primary context is made current on each thread
    the first time that thread calls in (an LLM built on one thread and run on another, as a web
    app's worker threads do, would otherwise fail with CUDA_ERROR_INVALID_CONTEXT)."""

    binding = "cuda-bindings"
    graphs = True
    programmatic = True

    def __init__(self, ordinal: int = 0) -> None:
        self._d = _import_driver()
        self._context: Any = None
        self._bound = threading.local()  # .done: the context is current on this thread
        try:
            self._invoke("cuInit", 0)
        except CudaError as err:
            raise AtlasError(f"no usable NVIDIA GPU: {err}") from None
        except Exception as err:  # the binding raises its own error when libcuda is absent
            raise AtlasError(f"no NVIDIA driver found (libcuda): {err}") from None
        (count,) = self._invoke("cuDeviceGetCount")
        if count <= ordinal:
            raise no_such_device(ordinal, count)
        (self._device,) = self._invoke("cuDeviceGet", ordinal)
        (self._context,) = self._invoke("cuDevicePrimaryCtxRetain", self._device)

    def _call(self, name: str, *args: Any) -> tuple[Any, ...]:
        """A driver call on this thread, with the context made current here first if need be."""
        if not getattr(self._bound, "done", False):
            self._invoke("cuCtxSetCurrent", self._context)
            self._bound.done = True
        return self._invoke(name, *args)

    def _invoke(self, name: str, *args: Any) -> tuple[Any, ...]:
        result = getattr(self._d, name)(*args)
        err, values = result[0], tuple(result[1:])
        if int(err) != 0:
            raise CudaError(f"{name} failed: {self._describe(err)}")
        return values

    def _describe(self, err: Any) -> str:
        name = getattr(err, "name", str(err))
        try:
            status, text = self._d.cuGetErrorString(err)
            if int(status) == 0 and text:
                return f"{name} ({text.decode() if isinstance(text, bytes) else text})"
        except Exception:
            pass
        return str(name)

    def _attr(self, attr_name: str) -> int:
        attr = getattr(self._d.CUdevice_attribute, attr_name)
        (value,) = self._call("cuDeviceGetAttribute", attr, self._device)
        return int(value)

    def device_info(self) -> DeviceInfo:
        (raw_name,) = self._call("cuDeviceGetName", 256, self._device)
        (total,) = self._call("cuDeviceTotalMem", self._device)
        (version,) = self._call("cuDriverGetVersion")
        name = raw_name.split(b"\0", 1)[0].decode() if isinstance(raw_name, bytes) else str(raw_name)
        return DeviceInfo(
            name=name,
            cc=(
                self._attr("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
                self._attr("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"),
            ),
            sm_count=self._attr("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
            max_smem_optin=self._attr("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
            total_bytes=int(total),
            driver_version=int(version),
        )

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._call("cuMemGetInfo")
        return int(free), int(total)

    def module_load(self, image: bytes) -> Handle:
        (module,) = self._call("cuModuleLoadData", image)
        return module

    def module_unload(self, module: Handle) -> None:
        self._call("cuModuleUnload", module)

    def get_function(self, module: Handle, name: str) -> Handle:
        (function,) = self._call("cuModuleGetFunction", module, name.encode())
        return function

    def set_max_dynamic_smem(self, function: Handle, nbytes: int) -> None:
        attr = self._d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._call("cuFuncSetAttribute", function, attr, nbytes)

    def mem_alloc(self, nbytes: int) -> int:
        (ptr,) = self._call("cuMemAlloc", max(nbytes, 1))
        return int(ptr)

    def mem_free(self, ptr: int) -> None:
        self._call("cuMemFree", ptr)

    def host_alloc(self, nbytes: int) -> int:
        (ptr,) = self._call("cuMemAllocHost", max(nbytes, 1))
        return int(ptr)

    def host_free(self, ptr: int) -> None:
        self._call("cuMemFreeHost", ptr)

    def memcpy_htod(self, dst: int, src_host: int, nbytes: int, stream: Handle) -> None:
        self._call("cuMemcpyHtoDAsync", dst, src_host, nbytes, stream)

    def memcpy_dtoh(self, dst_host: int, src: int, nbytes: int, stream: Handle) -> None:
        self._call("cuMemcpyDtoHAsync", dst_host, src, nbytes, stream)

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: Handle) -> None:
        self._call("cuMemcpyDtoDAsync", dst, src, nbytes, stream)

    def memset_d8(self, dst: int, value: int, nbytes: int, stream: Handle) -> None:
        self._call("cuMemsetD8Async", dst, value, nbytes, stream)

    def launch(self, launch: LaunchArgs) -> None:
        # kernelParams = void*[1] holding the address of the packed struct (one by-value param).
        arg_pointers = (ctypes.c_void_p * 1)(launch.params_addr)
        try:
            if launch.programmatic:
                self._call("cuLaunchKernelEx", self._programmatic_config(launch), launch.function,
                           ctypes.addressof(arg_pointers), 0)
                return
            self._call(
                "cuLaunchKernel",
                launch.function,
                *launch.grid,
                *launch.block,
                launch.smem,
                launch.stream,
                ctypes.addressof(arg_pointers),
                0,
            )
        except CudaError as err:
            raise CudaError(
                f"launch of {launch.kernel} grid={launch.grid} block={launch.block} "
                f"smem={launch.smem}: {err}"
            ) from None

    def _programmatic_config(self, launch: LaunchArgs) -> Any:
        """cuLaunchKernelEx's config: the launch's geometry with programmatic stream serialization."""
        attribute = self._d.CUlaunchAttribute()
        attribute.id = self._d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        config = self._d.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = launch.grid
        config.blockDimX, config.blockDimY, config.blockDimZ = launch.block
        config.sharedMemBytes = launch.smem
        config.hStream = launch.stream
        config.attrs = [attribute]
        config.numAttrs = 1
        return config

    def stream_create(self) -> Handle:
        (stream,) = self._call("cuStreamCreate", int(self._d.CUstream_flags.CU_STREAM_NON_BLOCKING))
        return stream

    def stream_destroy(self, stream: Handle) -> None:
        self._call("cuStreamDestroy", stream)

    def stream_synchronize(self, stream: Handle) -> None:
        self._call("cuStreamSynchronize", stream)

    def event_create(self) -> Handle:
        (event,) = self._call("cuEventCreate", int(self._d.CUevent_flags.CU_EVENT_DEFAULT))
        return event

    def event_record(self, event: Handle, stream: Handle) -> None:
        self._call("cuEventRecord", event, stream)

    def event_synchronize(self, event: Handle) -> None:
        self._call("cuEventSynchronize", event)

    def event_elapsed_ms(self, start: Handle, end: Handle) -> float:
        (ms,) = self._call("cuEventElapsedTime", start, end)
        return float(ms)

    def begin_capture(self, stream: Handle) -> None:
        mode = self._d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        self._call("cuStreamBeginCapture", stream, mode)

    def end_capture(self, stream: Handle) -> Handle:
        (graph,) = self._call("cuStreamEndCapture", stream)
        try:
            (graph_exec,) = self._call("cuGraphInstantiate", graph, 0)
        finally:
            self._call("cuGraphDestroy", graph)
        return graph_exec

    def graph_launch(self, graph_exec: Handle, stream: Handle) -> None:
        self._call("cuGraphLaunch", graph_exec, stream)

    def graph_destroy(self, graph_exec: Handle) -> None:
        self._call("cuGraphExecDestroy", graph_exec)
