"""The pycuda driver adapter (ATLAS_CUDA_BINDING=pycuda) without pycuda or a GPU.

A fake `pycuda` package is put in sys.modules. It has only the part of pycuda's documented API
(doc/driver.rst and src/wrapper/wrap_cudadrv.cpp of pycuda 2026.1) that the adapter should use,
with pycuda's signatures: a wrong argument count, keyword or type is a TypeError, a call without
a current context a LogicError, anything else an AttributeError. Device memory is a ctypes buffer,
streams queue their work until something drains them (as CUDA orders a blocking stream after the
legacy default stream), and "kernels" are Python functions that read their params struct. The
adapter then runs the scenarios tests/test_cuda_select.py runs on the emulated driver."""

from __future__ import annotations

import atexit
import builtins
import ctypes
import importlib.machinery
import struct
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlas.backends.cuda.driver import CudaError, open_driver
from atlas.backends.cuda.graph import GraphedDecodeStep
from atlas.backends.cuda.runtime import CudaRuntime, KernelImage, RuntimeOptions
from atlas.backends.cuda.tensor import DeviceTensor
from atlas.backends.cuda.upload import Uploader, from_storage, to_storage
from atlas.errors import AtlasError

KERNEL_MS = 0.5  # the fake clock's time per kernel, read back through events
HEAP_ALIGN = 256


class ScaleParams(ctypes.Structure):
    """The params struct of the fake kernel atlas_scale: out[i] = x[i] * scale for i < n."""

    _fields_ = [("x", ctypes.c_void_p), ("out", ctypes.c_void_p), ("n", ctypes.c_int32),
                ("scale", ctypes.c_float)]


@dataclass
class FakeGpu:
    """What the fake pycuda drives: one heap, a context stack, queued stream work."""

    device_count: int = 1
    name: str = "Fake H200"
    cc: tuple[int, int] = (9, 0)
    sm_count: int = 132
    smem_optin: int = 227 * 1024
    heap_bytes: int = 32 << 20
    version: tuple[int, ...] = (2026, 1)
    init_error: str | None = None
    initialised: bool = False
    contexts: dict[int, list[Any]] = field(default_factory=dict)  # thread id -> its context stack
    allocations: dict[int, int] = field(default_factory=dict)
    pending: list[tuple[Any, Callable[[], None]]] = field(default_factory=list)
    launches: list[tuple[str, tuple[int, ...], bytes, int]] = field(default_factory=list)
    clock_ms: float = 0.0
    heap: Any = None
    next_ptr: int = 0

    def __post_init__(self) -> None:
        self.heap = ctypes.create_string_buffer(self.heap_bytes)
        self.next_ptr = _round_up(ctypes.addressof(self.heap), HEAP_ALIGN)

    def stack(self) -> list[Any]:
        """The calling thread's context stack (CUDA contexts are current per thread)."""
        return self.contexts.setdefault(threading.get_ident(), [])

    def pushed(self) -> int:
        """Contexts left pushed on every thread: pycuda aborts when a thread or the process ends with one."""
        return sum(len(stack) for stack in self.contexts.values())

    def check_span(self, ptr: int, nbytes: int) -> bool:
        return any(base <= ptr and ptr + nbytes <= base + size for base, size in self.allocations.items())

    def drain(self, stream: Any | None = None) -> None:
        """Run queued work of `stream`, or of every blocking stream (what the legacy default
        stream waits for); a non-blocking stream's work stays queued."""
        keep = []
        for owner, op in self.pending:
            if owner is stream or (stream is None and owner.flags == 0):
                op()
            else:
                keep.append((owner, op))
        self.pending = keep


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def _scale_kernel(gpu: FakeGpu, params: bytes) -> None:
    p = ScaleParams.from_buffer_copy(params)
    assert gpu.check_span(p.x, 4 * p.n) and gpu.check_span(p.out, 4 * p.n), "atlas_scale: wild pointer"
    x = np.frombuffer((ctypes.c_float * p.n).from_address(p.x), dtype=np.float32)
    out = np.frombuffer((ctypes.c_float * p.n).from_address(p.out), dtype=np.float32)
    out[:] = x * np.float32(p.scale)


def _fault_kernel(gpu: FakeGpu, params: bytes) -> None:
    raise AssertionError("never runs: the launch itself fails")


KERNELS: dict[str, Callable[[FakeGpu, bytes], None]] = {"atlas_scale": _scale_kernel, "atlas_fault": _fault_kernel}


def build_fake_pycuda(gpu: FakeGpu) -> tuple[types.ModuleType, types.ModuleType]:
    drv = types.ModuleType("pycuda.driver")
    _add_errors(drv)
    _add_enums(drv)
    _add_device_and_context(drv, gpu)
    _add_memory(drv, gpu)
    _add_streams_and_events(drv, gpu)
    _add_modules(drv, gpu)
    pkg = types.ModuleType("pycuda")
    pkg.__spec__ = importlib.machinery.ModuleSpec("pycuda", None, is_package=True)
    pkg.__path__ = []  # type: ignore[attr-defined]
    pkg.VERSION = gpu.version  # type: ignore[attr-defined]
    pkg.VERSION_TEXT = ".".join(map(str, gpu.version))  # type: ignore[attr-defined]
    pkg.driver = drv  # type: ignore[attr-defined]
    return pkg, drv


def _add_errors(drv: types.ModuleType) -> None:
    error = type("Error", (Exception,), {})
    drv.Error = error  # type: ignore[attr-defined]
    drv.MemoryError = type("MemoryError", (error, builtins.MemoryError), {})  # type: ignore[attr-defined]
    for name in ("LogicError", "LaunchError", "RuntimeError"):
        setattr(drv, name, type(name, (error,), {}))


def _add_enums(drv: types.ModuleType) -> None:
    drv.device_attribute = types.SimpleNamespace(  # type: ignore[attr-defined]
        MULTIPROCESSOR_COUNT=16, MAX_SHARED_MEMORY_PER_BLOCK_OPTIN=97)
    drv.function_attribute = types.SimpleNamespace(MAX_DYNAMIC_SHARED_SIZE_BYTES=8)  # type: ignore[attr-defined]


def _need_context(drv: types.ModuleType, gpu: FakeGpu, call: str) -> None:
    if not gpu.initialised:
        raise drv.LogicError(f"{call} failed: initialization error")
    if not gpu.stack():
        raise drv.LogicError(f"{call} failed: invalid device context")


def _int_arg(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what}: expected an integer, got {type(value).__name__}")
    return int(value)


def _add_device_and_context(drv: types.ModuleType, gpu: FakeGpu) -> None:
    def init(flags: int = 0) -> None:
        _int_arg(flags, "init(flags)")
        if gpu.init_error:
            raise drv.RuntimeError(f"cuInit failed: {gpu.init_error}")
        gpu.initialised = True

    class Context:
        def push(self) -> None:
            gpu.stack().append(self)

        @staticmethod
        def pop() -> None:
            if not gpu.stack():
                raise drv.LogicError("cuCtxPopCurrent failed: invalid device context")
            gpu.stack().pop()

        def detach(self) -> None:
            pass

    class Device:
        def __init__(self, number: int) -> None:
            if not gpu.initialised:
                raise drv.LogicError("cuDeviceGet failed: initialization error")
            if not 0 <= _int_arg(number, "Device(number)") < gpu.device_count:
                raise drv.LogicError("cuDeviceGet failed: invalid device ordinal")

        @staticmethod
        def count() -> int:
            if not gpu.initialised:
                raise drv.LogicError("cuDeviceGetCount failed: initialization error")
            return gpu.device_count

        def name(self) -> str:
            return gpu.name

        def compute_capability(self) -> tuple[int, int]:
            return gpu.cc

        def total_memory(self) -> int:
            return gpu.heap_bytes

        def get_attribute(self, attr: int) -> int:
            values = {drv.device_attribute.MULTIPROCESSOR_COUNT: gpu.sm_count,
                      drv.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: gpu.smem_optin}
            if attr not in values:
                raise TypeError(f"get_attribute: not a device_attribute the fake knows: {attr!r}")
            return values[attr]

        def retain_primary_context(self) -> Context:
            return Context()  # not made current: the caller pushes it

    drv.init, drv.Context, drv.Device = init, Context, Device  # type: ignore[attr-defined]
    drv.get_driver_version = lambda: 13000  # type: ignore[attr-defined]


def _add_memory(drv: types.ModuleType, gpu: FakeGpu) -> None:
    class DeviceAllocation:
        def __init__(self, ptr: int) -> None:
            self._ptr = ptr

        def __int__(self) -> int:
            return self._ptr

        def free(self) -> None:
            _need_context(drv, gpu, "cuMemFree")
            if gpu.allocations.pop(self._ptr, None) is None:
                raise drv.LogicError("cuMemFree failed: invalid value")

    def mem_alloc(nbytes: int) -> DeviceAllocation:
        _need_context(drv, gpu, "cuMemAlloc")
        size = _round_up(_int_arg(nbytes, "mem_alloc(bytes)"), HEAP_ALIGN)
        if gpu.next_ptr + size > ctypes.addressof(gpu.heap) + gpu.heap_bytes:
            raise drv.MemoryError("cuMemAlloc failed: out of memory")
        ptr, gpu.next_ptr = gpu.next_ptr, gpu.next_ptr + size
        gpu.allocations[ptr] = size
        return DeviceAllocation(ptr)

    def mem_get_info() -> tuple[int, int]:
        _need_context(drv, gpu, "cuMemGetInfo")
        return gpu.heap_bytes - sum(gpu.allocations.values()), gpu.heap_bytes

    def device_ptr(value: Any, nbytes: int, call: str) -> int:
        ptr = int(value) if isinstance(value, DeviceAllocation) else _int_arg(value, f"{call}(pointer)")
        if not gpu.check_span(ptr, nbytes):
            raise drv.LogicError(f"{call} failed: invalid argument")
        return ptr

    def pagelocked_empty(shape: Any, dtype: Any, order: str = "C", mem_flags: int = 0) -> np.ndarray:
        _need_context(drv, gpu, "cuMemHostAlloc")
        return np.empty(shape, dtype, order)

    _add_copies(drv, gpu, device_ptr)
    drv.DeviceAllocation, drv.mem_alloc, drv.mem_get_info = DeviceAllocation, mem_alloc, mem_get_info  # type: ignore[attr-defined]
    drv.pagelocked_empty = pagelocked_empty  # type: ignore[attr-defined]


def _enqueue(drv: types.ModuleType, gpu: FakeGpu, stream: Any, op: Callable[[], None]) -> None:
    if stream is None:  # the legacy default stream: after every blocking stream's work
        gpu.drain()
        op()
    elif not isinstance(stream, drv.Stream):
        raise TypeError(f"stream: expected Stream or None, got {type(stream).__name__}")
    else:
        gpu.pending.append((stream, op))


def _add_copies(drv: types.ModuleType, gpu: FakeGpu, device_ptr: Callable[[Any, int, str], int]) -> None:
    def memcpy_htod(dest: Any, src: Any) -> None:
        view = memoryview(src).cast("B")  # a TypeError unless src is a buffer, as in pycuda
        ptr = device_ptr(dest, view.nbytes, "cuMemcpyHtoD")
        gpu.drain()
        ctypes.memmove(ptr, (ctypes.c_char * view.nbytes).from_buffer_copy(view), view.nbytes)

    def memcpy_dtoh(dest: Any, src: Any) -> None:
        view = memoryview(dest).cast("B")
        if view.readonly:
            raise TypeError("memcpy_dtoh: dest must be a writable buffer")
        ptr = device_ptr(src, view.nbytes, "cuMemcpyDtoH")
        gpu.drain()
        view[:] = ctypes.string_at(ptr, view.nbytes)

    def memcpy_dtod_async(dest: Any, src: Any, size: int, stream: Any = None) -> None:
        nbytes = _int_arg(size, "memcpy_dtod_async(size)")
        dst_ptr, src_ptr = device_ptr(dest, nbytes, "cuMemcpyDtoDAsync"), device_ptr(src, nbytes, "cuMemcpyDtoDAsync")
        _enqueue(drv, gpu, stream, lambda: ctypes.memmove(dst_ptr, src_ptr, nbytes))

    def memset_d8_async(dest: Any, data: int, size: int, stream: Any = None) -> None:
        value, nbytes = _int_arg(data, "memset_d8_async(data)"), _int_arg(size, "memset_d8_async(size)")
        if not 0 <= value <= 255:
            raise OverflowError("memset_d8_async(data): not an unsigned char")
        ptr = device_ptr(dest, nbytes, "cuMemsetD8Async")
        _enqueue(drv, gpu, stream, lambda: ctypes.memset(ptr, value, nbytes))

    drv.memcpy_htod, drv.memcpy_dtoh = memcpy_htod, memcpy_dtoh  # type: ignore[attr-defined]
    drv.memcpy_dtod_async, drv.memset_d8_async = memcpy_dtod_async, memset_d8_async  # type: ignore[attr-defined]


def _add_streams_and_events(drv: types.ModuleType, gpu: FakeGpu) -> None:
    class Stream:
        def __init__(self, flags: int = 0) -> None:
            _need_context(drv, gpu, "cuStreamCreate")
            self.flags = _int_arg(flags, "Stream(flags)")

        def synchronize(self) -> None:
            gpu.drain(self)

    class Event:
        def __init__(self, flags: int | None = None) -> None:
            _need_context(drv, gpu, "cuEventCreate")
            self._stream: Any = None
            self.time_ms: float | None = None

        def record(self, stream: Any = None) -> Event:
            self.time_ms, self._stream = None, stream
            _enqueue(drv, gpu, stream, lambda: setattr(self, "time_ms", gpu.clock_ms))
            return self

        def synchronize(self) -> Event:
            gpu.drain(self._stream)
            return self

        def time_since(self, event: Event) -> float:
            if self.time_ms is None or event.time_ms is None:
                raise drv.LogicError("cuEventElapsedTime failed: device not ready")
            return self.time_ms - event.time_ms

    drv.Stream, drv.Event = Stream, Event  # type: ignore[attr-defined]


def _add_modules(drv: types.ModuleType, gpu: FakeGpu) -> None:
    class Function:
        def __init__(self, name: str) -> None:
            self.name = name
            self.max_dynamic_smem = 48 * 1024

        def set_attribute(self, attr: int, value: int) -> None:
            if attr != drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES:
                raise drv.LogicError("cuFuncSetAttribute failed: invalid value")
            self.max_dynamic_smem = _int_arg(value, "set_attribute(value)")

        def prepare(self, arg_types: Any, texrefs: Any = None) -> Function:
            self.arg_format = "".join(_struct_code(t) for t in arg_types)
            return self

        def prepared_async_call(self, grid: Any, block: Any, stream: Any, *args: Any, shared_size: int = 0) -> None:
            _launch(drv, gpu, self, (grid, block, stream, args, shared_size))

    class Module:
        def get_function(self, name: str) -> Function:
            if not isinstance(name, str):
                raise TypeError("get_function(name): expected str")
            if name not in KERNELS:
                raise drv.LogicError("cuModuleGetFunction failed: named symbol not found")
            return Function(name)

    def module_from_buffer(buffer: Any, options: Any = (), message_handler: Any = None) -> Module:
        _need_context(drv, gpu, "cuModuleLoadDataEx")
        data = bytes(memoryview(buffer))
        if not data.startswith(b"\x7fELF") and not data.endswith(b"\0"):  # PTX must end in NUL
            raise drv.LogicError("cuModuleLoadDataEx failed: a PTX JIT compilation failed")
        return Module()

    drv.Function, drv.Module, drv.module_from_buffer = Function, Module, module_from_buffer  # type: ignore[attr-defined]


def _struct_code(arg_type: Any) -> str:
    """pycuda's function_prepare: numpy scalar types, dtypes (void -> "<n>s"), struct chars."""
    if isinstance(arg_type, np.dtype):
        return f"{arg_type.itemsize}s" if arg_type.char == "V" else arg_type.char
    if isinstance(arg_type, type) and issubclass(arg_type, np.number):
        return np.dtype(arg_type).char
    if isinstance(arg_type, str):
        return arg_type
    return np.dtype(np.uintp).char


def _launch(drv: types.ModuleType, gpu: FakeGpu, function: Any, call: tuple[Any, ...]) -> None:
    grid, block, stream, args, shared_size = call
    if not isinstance(block, tuple) or not isinstance(grid, tuple) or len(grid) > 3 or len(block) > 3:
        raise TypeError("prepared_async_call: grid and block must be tuples of up to 3 ints")
    dims = [_int_arg(d, "grid/block") for d in grid + block]
    packed = struct.pack(function.arg_format, *args)  # a struct.error (not TypeError) is a bad arg too
    if shared_size > function.max_dynamic_smem or np.prod(block) > 1024 or function.name == "atlas_fault":
        raise drv.LaunchError("cuLaunchKernel failed: unspecified launch failure")

    def run() -> None:
        KERNELS[function.name](gpu, packed)
        gpu.launches.append((function.name, tuple(dims), packed, shared_size))
        gpu.clock_ms += KERNEL_MS

    _enqueue(drv, gpu, stream, run)


# --- fixtures -----------------------------------------------------------------------------------
@dataclass
class Harness:
    gpu: FakeGpu
    drv: types.ModuleType
    at_exit: list[Callable[[], None]]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> Iterator[Harness]:
    """A fresh fake pycuda with a randomly drawn device, ATLAS_CUDA_BINDING=pycuda, and the
    adapter's exit hooks collected (run at teardown, like atexit would)."""
    gpu = FakeGpu(device_count=int(rng.integers(1, 4)), cc=((8, 0), (9, 0), (12, 1))[int(rng.integers(0, 3))],
                  sm_count=int(rng.integers(20, 200)), smem_optin=int(rng.integers(100, 228)) * 1024)
    pkg, drv = build_fake_pycuda(gpu)
    monkeypatch.setitem(sys.modules, "pycuda", pkg)
    monkeypatch.setitem(sys.modules, "pycuda.driver", drv)
    monkeypatch.setenv("ATLAS_CUDA_BINDING", "pycuda")
    at_exit: list[Callable[[], None]] = []
    register = atexit.register

    def collect(hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if type(getattr(hook, "__self__", None)).__name__ != "PycudaDriver":
            return register(hook, *args, **kwargs)
        at_exit.append(hook)
        return hook

    monkeypatch.setattr(atexit, "register", collect)
    yield Harness(gpu, drv, at_exit)
    for hook in at_exit:
        hook()


def make_runtime(image: KernelImage | None = None, arena_bytes: int = 1 << 20) -> CudaRuntime:
    image = image or KernelImage("fake/model/bf16 (ptx)", b"// fake ptx", "ptx", 90)
    return CudaRuntime(open_driver(0), image, RuntimeOptions(arena_bytes=arena_bytes))


# --- the fake holds pycuda's surface and nothing else -------------------------------------------
def test_fake_pycuda_refuses_what_pycuda_does_not_have(fake: Harness) -> None:
    drv = fake.drv
    drv.init()
    with pytest.raises(drv.LogicError, match="invalid device context"):
        drv.mem_alloc(16)
    drv.Device(0).retain_primary_context().push()
    ptr = int(drv.mem_alloc(64))
    for missing in ("memcpy_htod_async", "memcpy_dtoh_async", "memset_d8"):
        assert not hasattr(drv, missing)
    assert not hasattr(drv.Stream(), "begin_capture") and not hasattr(drv.Function("atlas_scale"), "_launch_kernel")
    with pytest.raises(TypeError):
        drv.memset_d8_async(ptr, 0, 64, None, 0)
    with pytest.raises(TypeError):
        drv.memcpy_htod(ptr, 12345)
    with pytest.raises(TypeError):
        drv.memcpy_dtod_async(ptr, ptr, size=64, stream="stream")
    function = drv.Function("atlas_scale").prepare([np.dtype((np.void, 8))])
    with pytest.raises(TypeError):
        function.prepared_async_call((1, 1, 1), [32, 1, 1], None, b"\0" * 8)
    with pytest.raises(drv.LogicError, match="invalid argument"):
        drv.memset_d8_async(ptr + HEAP_ALIGN, 0, 1)  # past the one (rounded) allocation
    quiet = drv.Stream(1)  # non-blocking: the legacy default stream does not wait for it
    drv.memset_d8_async(ptr, 7, 64, quiet)
    out = bytearray(64)
    drv.memcpy_dtoh(out, ptr)
    assert out == bytearray(64)
    quiet.synchronize()
    drv.memcpy_dtoh(out, ptr)
    assert out == bytearray([7] * 64)
    drv.Context.pop()


# --- opening, device info, exit -----------------------------------------------------------------
def test_open_reports_the_device_and_frees_at_exit(fake: Harness) -> None:
    from atlas.backends.cuda.driver_pycuda import PycudaDriver

    driver = open_driver(fake.gpu.device_count - 1)
    assert isinstance(driver, PycudaDriver) and driver.binding == "pycuda" and driver.graphs is False
    info = driver.device_info()
    assert (info.name, info.cc, info.sm_count, info.max_smem_optin) == (
        fake.gpu.name, fake.gpu.cc, fake.gpu.sm_count, fake.gpu.smem_optin)
    assert info.total_bytes == fake.gpu.heap_bytes and info.driver_version == 13000
    ptr = driver.mem_alloc(1000)
    free, total = driver.mem_get_info()
    assert total == fake.gpu.heap_bytes and free == total - 1024
    assert fake.gpu.pushed() == 0 and len(fake.at_exit) == 1  # current only inside a call
    fake.at_exit.pop()()
    assert fake.gpu.pushed() == 0 and ptr not in fake.gpu.allocations
    driver.release()  # a second release does nothing


def test_a_driver_opened_on_one_thread_runs_on_another(fake: Harness, rng: np.random.Generator) -> None:
    """An LLM built on one thread and run on another (a web app's worker threads): every call
    gets the context on its own thread, and no thread ends with a context pushed (pycuda aborts)."""
    rt = make_runtime()
    values = rng.standard_normal(int(rng.integers(1, 500))).astype(np.float32)
    found: dict[str, Any] = {}

    def run() -> None:
        try:
            x = Uploader(rt).upload(values, "f32")
            out = rt.empty(x.shape, "f32")
            rt.launch("atlas_scale", (1, 1, 1), (128, 1, 1), ScaleParams(x.ptr, out.ptr, x.numel, 2.0))
            found["out"] = rt.read(out)
        except Exception as err:  # noqa: BLE001 - reported by the assert below
            found["error"] = err

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert "error" not in found, found.get("error")
    np.testing.assert_array_equal(found["out"], values * np.float32(2.0))
    assert fake.gpu.pushed() == 0
    with pytest.raises(fake.drv.LogicError, match="invalid device context"):
        fake.drv.mem_alloc(16)  # the fake enforces it: nothing is current outside a call


# --- runtime: arena, uploads, reads, memset, copies ---------------------------------------------
def test_arena_is_deterministic_and_grows_then_folds(fake: Harness, rng: np.random.Generator) -> None:
    from test_cuda_select import arena_grows_then_folds

    import gc

    rt = make_runtime(arena_bytes=1 << 20)
    arena_grows_then_folds(rt, rng, HEAP_ALIGN)
    assert len(fake.gpu.allocations) == 1  # the two grown blocks were freed for one folded block
    del rt
    gc.collect()
    assert fake.gpu.allocations == {} and fake.gpu.pushed() == 0  # a collected runtime frees its memory


def test_uploads_reads_memsets_and_copies_round_trip(fake: Harness, rng: np.random.Generator) -> None:
    import torch

    rt = make_runtime(KernelImage("fake/model/bf16 (cubin)", b"\x7fELF fake", "cubin", 90))
    uploader = Uploader(rt)
    matrix = rng.standard_normal((int(rng.integers(1, 50)), 64)).astype(np.float32) * 3
    back = from_storage(rt.read(uploader.upload(matrix, "bf16")), "bf16")
    np.testing.assert_array_equal(back, torch.from_numpy(matrix).to(torch.bfloat16).float().numpy())
    ids = rng.integers(0, 1000, size=int(rng.integers(1, 40))).astype(np.int64)
    np.testing.assert_array_equal(rt.read(uploader.upload(ids, "i32")), ids.astype(np.int32))
    pending = rt.read_later(uploader.upload(ids[:8], "i32"))  # into page-locked memory
    np.testing.assert_array_equal(pending.result(), ids[:8].astype(np.int32))
    tile = rng.standard_normal((3, 16, 8)).astype(np.float32)
    experts = int(rng.integers(5, 13))
    stacked = uploader.upload(np.broadcast_to(tile[None], (experts, 3, 16, 8)), "f32")  # replicated by dtod
    np.testing.assert_array_equal(rt.read(stacked), np.broadcast_to(tile, (experts, 3, 16, 8)))
    scratch = rt.empty((int(rng.integers(1, 300)),), "f32")
    rt.poison_scratch()
    assert np.isnan(rt.read(scratch)).all()
    rt.memset_zero(scratch)
    assert (rt.read(scratch) == 0).all()
    values = rng.standard_normal(scratch.shape).astype(np.float32)
    rt.copy(scratch, uploader.upload(values, "f32"))
    np.testing.assert_array_equal(rt.read(scratch), values)


def test_persistent_memory_is_reused_after_release(fake: Harness) -> None:
    import gc

    rt = make_runtime()
    a = rt.persistent((16,), "i32")
    ptr = a.ptr
    del a
    gc.collect()
    assert rt.persistent((16,), "i32").ptr == ptr


# --- launches -----------------------------------------------------------------------------------
def test_launch_passes_the_params_struct_by_value(fake: Harness, rng: np.random.Generator) -> None:
    rt = make_runtime()
    n = int(rng.integers(1, 5000))
    x = rng.standard_normal(n).astype(np.float32)
    x_dev, out = Uploader(rt).upload(x, "f32"), rt.empty((n,), "f32")
    params = ScaleParams(x_dev.ptr, out.ptr, n, float(rng.standard_normal()))
    smem = int(rng.integers(49, fake.gpu.smem_optin // 1024 + 1)) * 1024  # needs the opt-in attribute
    rt.launch("atlas_scale", (int(rng.integers(1, 9)), 1, 1), (128, 1, 1), params, smem=smem)
    np.testing.assert_array_equal(rt.read(out), x * np.float32(params.scale))
    kernel, dims, raw, shared = fake.gpu.launches[-1]
    assert kernel == "atlas_scale" and raw == bytes(params) and shared == smem and dims[3:] == (128, 1, 1)
    with pytest.raises(CudaError, match=r"kernel missing is not in fake/model/bf16 \(ptx\): Module.get_function"
                                        r"\(missing\) failed: cuModuleGetFunction failed: named symbol not found"):
        rt.launch("missing", (1, 1, 1), (32, 1, 1), params)
    with pytest.raises(CudaError, match=r"launch of atlas_fault grid=\(2, 1, 1\) block=\(64, 1, 1\) smem=0 "
                                        r"failed: CUDA_ERROR_LAUNCH_FAILED \(cuLaunchKernel failed: "
                                        r"unspecified launch failure\)") as fault:
        rt.launch("atlas_fault", (2, 1, 1), (64, 1, 1), params)
    assert fault.value.sticky  # pycuda's words named as the driver result, which loses the context


def test_events_time_the_kernels_between_them(fake: Harness, rng: np.random.Generator) -> None:
    rt = make_runtime()
    driver, n = rt.driver, 64
    x = Uploader(rt).upload(np.ones(n, dtype=np.float32), "f32")
    start, end = driver.event_create(), driver.event_create()
    kernels = int(rng.integers(1, 10))
    driver.event_record(start, rt.stream)
    for _ in range(kernels):
        rt.launch("atlas_scale", (1, 1, 1), (32, 1, 1), ScaleParams(x.ptr, x.ptr, n, 2.0))
    driver.event_record(end, rt.stream)
    driver.event_synchronize(end)
    assert driver.event_elapsed_ms(start, end) == kernels * KERNEL_MS
    assert (rt.read(x) == 2.0**kernels).all()


# --- decode without graphs ----------------------------------------------------------------------
def _scale_step(rt: CudaRuntime) -> Callable[[DeviceTensor, DeviceTensor], DeviceTensor]:
    """A stand-in decode step: out = ids as f32, times 2 (a copy, a memset and a launch)."""

    def step(ids: DeviceTensor, positions: DeviceTensor) -> DeviceTensor:
        rt.reset_step()
        raw = rt.empty(ids.shape, "f32")
        rt.memset_zero(raw)
        rt.copy(raw, ids)  # i32 bits; the test feeds small values whose f32 view it knows
        out = rt.empty(ids.shape, "f32")
        rt.launch("atlas_scale", (1, 1, 1), (32, 1, 1), ScaleParams(raw.ptr, out.ptr, ids.numel, 2.0))
        return out

    return step


def test_decode_runs_without_graphs_and_says_so(fake: Harness, rng: np.random.Generator,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from atlas.backends.cuda.backend import CudaBackend

    monkeypatch.delenv("ATLAS_CUDA_GRAPHS", raising=False)
    rt = make_runtime()
    backend = CudaBackend(rt)
    assert not backend.use_graphs and "no CUDA graphs" in backend.describe()
    assert "atlas: pycuda cannot capture CUDA graphs; decoding without them" in capsys.readouterr().err
    step = backend.make_decode_step(_scale_step(rt))
    for position in range(int(rng.integers(2, 6))):
        bits = rng.standard_normal(int(rng.integers(1, 8))).astype(np.float32)
        ids = backend.upload(bits.view(np.int32), "i32")
        out = step(ids, np.array([position], dtype=np.int32))
        np.testing.assert_array_equal(backend.to_numpy(out), bits * 2)


def test_forced_capture_fails_in_one_line_and_leaves_the_runtime_usable(fake: Harness) -> None:
    rt = make_runtime()
    ids = rt.persistent((1,), "i32")
    rt.write(ids, to_storage(np.array([3]), "i32"))
    with pytest.raises(CudaError, match="pycuda has no CUDA stream capture") as err:
        GraphedDecodeStep(rt, _scale_step(rt))(ids, np.array([0], dtype=np.int32))
    assert "\n" not in str(err.value) and not rt.capturing
    assert int(rt.read(ids)[0]) == 3


# --- errors -------------------------------------------------------------------------------------
def test_driver_errors_become_cuda_errors_naming_the_call(fake: Harness, rng: np.random.Generator) -> None:
    from atlas.backends.cuda.memory import StepArena

    driver = open_driver(0)
    with pytest.raises(CudaError, match="module_from_buffer failed: cuModuleLoadDataEx failed"):
        driver.module_load(b"// ptx without its terminating NUL")
    with pytest.raises(CudaError, match=r"mem_free\(0x10\) failed: not an allocation"):
        driver.mem_free(0x10)
    with pytest.raises(CudaError, match="memset_d8_async failed: cuMemsetD8Async failed: invalid argument"):
        driver.memset_d8(0x10, 0, 16, driver.stream_create())
    arena = StepArena(driver, 1 << 20)
    arena.alloc(int(rng.integers(1, 1000)))
    with pytest.raises(AtlasError, match="ran out of memory") as err:  # pycuda.driver.MemoryError
        arena.alloc(fake.gpu.heap_bytes)
    assert "\n" not in str(err.value)


# --- refusals: one line each --------------------------------------------------------------------
def _one_line(match: str, ordinal: int = 0) -> None:
    with pytest.raises(AtlasError, match=match) as err:
        open_driver(ordinal)
    assert "\n" not in str(err.value)


def test_missing_broken_or_old_pycuda_is_one_line(fake: Harness, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "pycuda", None)
    _one_line(r"ATLAS_CUDA_BINDING=pycuda but pycuda is not installed; install it \(`pip install pycuda`")
    package = tmp_path / "pycuda"
    package.mkdir()
    (package / "__init__.py").write_text("VERSION = (2026, 1)\n")
    (package / "driver.py").write_text("raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.delitem(sys.modules, "pycuda")
    monkeypatch.delitem(sys.modules, "pycuda.driver")
    monkeypatch.syspath_prepend(str(tmp_path))
    _one_line(r"pycuda is installed but does not load \(libcuda.so.1: cannot open shared object file\)")
    for name in ("pycuda", "pycuda.driver"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    pkg, drv = build_fake_pycuda(FakeGpu(version=(2021, 1)))
    monkeypatch.setitem(sys.modules, "pycuda", pkg)
    monkeypatch.setitem(sys.modules, "pycuda.driver", drv)
    _one_line(r"pycuda 2021.1 is older than 2022.1, which atlas needs")


def test_device_index_and_missing_gpu_are_one_line(fake: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    from atlas.backends.cuda.select import device_ordinal

    count = fake.gpu.device_count
    monkeypatch.setenv("ATLAS_CUDA_DEVICE", str(count))
    _one_line(rf"ATLAS_CUDA_DEVICE={count}: only {count} GPU\(s\) visible \(0..{count - 1}\); set it", device_ordinal())
    fake.gpu.device_count = 0
    _one_line(r"no NVIDIA GPU visible \(device count 0\); use --device cpu")
    fake.gpu.init_error = "no CUDA-capable device is detected"
    _one_line(r"no usable NVIDIA GPU through pycuda: cuInit failed: no CUDA-capable device is detected")
    assert fake.gpu.pushed() == 0 and fake.at_exit == []


# --- the real pycuda on a GPU (the device machine has no pycuda today: then this skips) ---------
@pytest.mark.gpu
def test_gpu_pycuda_runtime_round_trips(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    pytest.importorskip("pycuda.driver", reason="pycuda is not installed (it builds from source)")
    monkeypatch.setenv("ATLAS_CUDA_BINDING", "pycuda")
    try:
        driver = open_driver(0)
    except AtlasError as err:
        pytest.skip(f"no GPU through pycuda: {err}")
    rt = CudaRuntime(driver, KernelImage("empty (ptx)", b".version 7.0\n.target sm_80\n.address_size 64\n", "ptx", 90),
                     RuntimeOptions())
    assert driver.device_info().cc >= (8, 0)
    values = rng.standard_normal(int(rng.integers(1, 100_000))).astype(np.float32)
    device = Uploader(rt).upload(values, "f32")
    np.testing.assert_array_equal(rt.read(device), values)
    copy = rt.empty(values.shape, "f32")
    rt.poison_scratch()
    assert np.isnan(rt.read(copy)).all()
    rt.copy(copy, device)
    np.testing.assert_array_equal(rt.read(copy), values)
