"""Runs the real kernel sources on the CPU: a tuple built for the host with g++ (tests/simt) behind
the CUDA backend's Driver interface, so the backend, its op wrappers and the kernels execute here as
they would on a GPU, only slower and one block at a time.

What it checks that nothing else on a GPU-less machine does: the kernels' arithmetic, indexing,
tiling and launch geometry; every barrier and warp collective (each CUDA thread is a fiber, so a
missing __syncthreads or __syncwarp gives a wrong answer or a deadlock report); cp.async groups
(a copy lands at the wait that covers it); ldmatrix / mma.sync / wgmma fragment layouts and
wgmma's swizzled descriptors (emulated from their PTX definitions, see tests/simt/include/simt_ptx.h);
wgmma's asynchrony (its accumulators change at the wait_group, and shared memory it reads written
before that wait fails the launch, as does an issue without wgmma.fence);
out-of-bounds accesses past an allocation (guard page); launch limits (__launch_bounds__, the
48 KiB dynamic shared memory default); the params structs' sizes; CUDA graph capture and replay
(recorded launches, params copied at capture). What it does not check: timing, occupancy,
registers and spills (ptxas does), races between blocks, the memory model, the async proxy
(fence.proxy.async is a no-op here), the hardware e4m3 conversion (the host takes the kernels'
portable path), and the device's own rounding of expf and friends.

Use: ATLAS_SIMT=h200 (or gb10, sm80) python -m pytest -m gpu -k "not qwen" runs the gpu-marked
tests on the emulator (tests/conftest.py); tests/test_simt.py tests the emulator itself and runs
that suite once per hardware.
"""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atlas.backends.cuda.driver import CudaError, DeviceInfo, LaunchArgs

REPO = Path(__file__).resolve().parents[1]
SIMT = REPO / "tests" / "simt"
OUT = REPO / "build" / "simt"
ENTRY = re.compile(r'extern "C" __global__ void __launch_bounds__\(([^,)]+)(?:, *\d+)?\) (\w+)\(const (\w+) p\)')
# -fno-weak: one translation unit, and the static __shared__ arrays of inline functions then share a
# section with the others; alignment checks trap (SIGILL), reported as misaligned accesses.
CXX_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-ffp-contract=off", "-fno-strict-aliasing", "-fno-weak",
             "-fsanitize=alignment", "-fsanitize-undefined-trap-on-error", "-w")
HOST_CC = {"sm80": (8, 0), "gb10": (12, 1), "h200": (9, 0)}  # the compute capability each emulates
DEFAULT_SMEM = 48 * 1024
ALLOC_ALIGN = 256  # cuMemAlloc's alignment
TENSOR_ALIGN = 16  # the widest access a kernel makes (uint4 / float4)
MAX_SMEM_OPTIN = 227 * 1024


@dataclass(frozen=True)
class Kernel:
    name: str
    params: str  # the params struct
    bound: str  # __launch_bounds__ max threads (a C++ expression)


def kernels_in(source: Path) -> list[Kernel]:
    return [Kernel(m.group(2), m.group(3), m.group(1)) for m in ENTRY.finditer(source.read_text())]


def entries_source(kernels: list[Kernel]) -> str:
    """Per kernel: simt_entry_<name>(params bytes), simt_params_<name> (sizeof), simt_bound_<name>."""
    lines = ['#include <cstring>\n']
    for k in kernels:
        lines.append(
            f'extern "C" void simt_entry_{k.name}(const void* raw) {{ {k.params} p; '
            f"std::memcpy(&p, raw, sizeof p); {k.name}(p); }}\n"
            f'extern "C" const unsigned long simt_params_{k.name} = sizeof({k.params});\n'
            f'extern "C" const int simt_bound_{k.name} = ({k.bound});\n'
        )
    return "".join(lines)


def _sources(hw: str, model: str, quant: str) -> list[Path]:
    from build_tools.compile import tuple_sources
    from build_tools.selection import Target

    return tuple_sources(Target(hw, model, quant))


def _digest(paths: list[Path], extra: str) -> str:
    digest = hashlib.sha256(extra.encode())
    for path in sorted(paths):
        digest.update(str(path.relative_to(REPO)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def build(hw: str, model: str, quant: str) -> Path:
    """The tuple's kernels as a host shared library (cached under build/simt by content)."""
    from build_tools.headers import TupleNames, write_headers
    from atlas.targets import load_registry

    if hw not in HOST_CC:
        raise ValueError(f"the host emulator builds {', '.join(HOST_CC)} tuples, not {hw}")
    out = OUT / hw / model / quant
    include = out / "include"
    write_headers(load_registry(), TupleNames(hw, model, quant), include)
    return compile_library(out, _sources(hw, model, quant), [include])


def build_selftest() -> Path:
    """tests/simt/selftest.cu, the emulator's own test kernels."""
    return compile_library(OUT / "selftest", [SIMT / "selftest.cu"], [])


def compile_library(out: Path, sources: list[Path], includes: list[Path]) -> Path:
    """`sources` (one translation unit) plus the generated entries and the runtime, built with g++
    into out/simt-<hash of every input>.so; an unchanged build is reused."""
    kernels = [k for s in sources for k in kernels_in(s)]
    unity = "".join(f'#include "{s.relative_to(REPO)}"\n' for s in sources) + entries_source(kernels)
    inputs = [*sources, *(REPO / "kernels" / "include").rglob("*.cuh"), *(SIMT / "include").glob("*.h"),
              SIMT / "runtime.cpp",
              *(f for d in includes for f in d.glob("*"))]
    cxx = shutil.which(os.environ.get("CXX", "g++")) or "g++"
    lib = out / f"simt-{_digest(inputs, unity + cxx + ' '.join(CXX_FLAGS))}.so"
    if lib.exists():
        return lib
    out.mkdir(parents=True, exist_ok=True)
    unit = out / f"tuple.{os.getpid()}.cpp"  # per process: the background lanes may build a tuple at once
    unit.write_text(unity)
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cxx, *CXX_FLAGS, "-include", str(SIMT / "include" / "simt_cuda.h"), "-I", str(SIMT / "include"),
           *(arg for d in includes for arg in ("-I", str(d))), "-I", str(REPO / "kernels" / "include"),
           "-I", str(REPO), "-x", "c++", str(unit), str(SIMT / "runtime.cpp"), "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    unit.unlink()
    if done.returncode != 0:
        raise RuntimeError(f"host build of {out.relative_to(REPO)} failed:\n{done.stderr[-6000:]}")
    for stale in out.glob("simt-*.so"):
        if stale != lib:
            stale.unlink(missing_ok=True)
    tmp.rename(lib)
    return lib


# Function-local statics outside the runtime (namespace simt) and the C++ library: in kernel code
# only __shared__ arrays are static locals.
KERNEL_STATIC = re.compile(r"_ZZ(?!N4simt|N?K?St|N9__gnu_cxx)")


def template_shared_arrays(library: Path) -> list[tuple[int, int]]:
    """(offset, size) of the kernels' __shared__ arrays outside the simt_shared section: GCC puts
    the static locals of function templates in .bss whatever their section attribute says."""
    table = subprocess.run(["nm", "-S", "--defined-only", str(library)], capture_output=True, text=True, check=True)
    regions = []
    for line in table.stdout.splitlines():
        fields = line.split()
        if len(fields) == 4 and fields[2] in "bB" and KERNEL_STATIC.match(fields[3]):
            regions.append((int(fields[0], 16), int(fields[1], 16)))
    return regions


@dataclass
class _Function:
    name: str
    entry: int
    params_size: int
    bound: int
    max_dynamic_smem: int = DEFAULT_SMEM


@dataclass
class _Graph:
    nodes: list[Any] = field(default_factory=list)  # callables replayed in order
    destroyed: bool = False


class SimtDriver:
    """The Driver protocol (atlas.backends.cuda.driver) over host memory and a host-built tuple."""

    binding = "simt"
    graphs = True
    programmatic = True  # blocks run one kernel after another: griddepcontrol has nothing to order

    def __init__(self, hw: str) -> None:
        self.hw = hw
        self.lib: Any = None
        self.sizes: dict[int, int] = {}
        self.aligns: dict[int, int] = {}
        self.functions: dict[tuple[int, str], _Function] = {}
        self.capture: _Graph | None = None
        self.bases: list[int] = []  # sorted, for _check_range
        self.pinned: dict[int, Any] = {}  # host_alloc's buffers by address
        # Deferred (defer(True)): stream work runs when the host waits for it, as on a GPU, so a
        # page-locked read used before its event was waited for reads stale bytes.
        self.queue: list[Any] | None = None
        self.ran = 0  # queued nodes run so far; an event waits for the ones queued before it

    def module_load(self, image: bytes) -> Any:
        """`image` names the tuple (simt_image) instead of holding PTX: build it for the host."""
        hw, model, quant = image.rstrip(b"\0").decode().split("/")
        if hw != self.hw:
            raise CudaError(f"cuModuleLoadData: a {hw} image on the {self.hw} emulator")
        return self.load_library(build(hw, model, quant))

    def load_library(self, path: Path) -> Any:
        self.lib = ctypes.CDLL(str(path))
        self.lib.simt_launch.restype = ctypes.c_int
        self.lib.simt_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint),
                                         ctypes.POINTER(ctypes.c_uint), ctypes.c_ulong, ctypes.c_char_p, ctypes.c_ulong]
        self.lib.simt_alloc.restype = ctypes.c_void_p
        self.lib.simt_alloc.argtypes = [ctypes.c_ulong, ctypes.c_ulong]
        self.lib.simt_free.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
        regions = template_shared_arrays(path)
        offsets = (ctypes.c_ulong * max(len(regions), 1))(*(offset for offset, _ in regions))
        sizes = (ctypes.c_ulong * max(len(regions), 1))(*(size for _, size in regions))
        self.lib.simt_set_template_shared(offsets, sizes, ctypes.c_ulong(len(regions)))
        return self.lib

    # --- device ---------------------------------------------------------------------------------
    def device_info(self) -> DeviceInfo:
        return DeviceInfo(f"host SIMT emulator ({self.hw})", HOST_CC[self.hw], 4, MAX_SMEM_OPTIN, 16 << 30, 13000)

    def mem_get_info(self) -> tuple[int, int]:
        return (16 << 30) - sum(self.sizes.values()), 16 << 30

    def get_function(self, module: Any, name: str) -> _Function:
        key = (id(module), name)
        if key not in self.functions:
            self.functions[key] = self._function(module, name)
        return self.functions[key]

    def _function(self, module: Any, name: str) -> _Function:
        try:
            entry = ctypes.cast(getattr(module, f"simt_entry_{name}"), ctypes.c_void_p).value
        except AttributeError:
            raise CudaError(f"cuModuleGetFunction({name}): CUDA_ERROR_NOT_FOUND") from None
        size = ctypes.c_ulong.in_dll(module, f"simt_params_{name}").value
        bound = ctypes.c_int.in_dll(module, f"simt_bound_{name}").value
        return _Function(name, int(entry), int(size), int(bound))

    def set_max_dynamic_smem(self, function: _Function, nbytes: int) -> None:
        if nbytes > MAX_SMEM_OPTIN:
            raise CudaError(f"cuFuncSetAttribute({function.name}, {nbytes} B): CUDA_ERROR_INVALID_VALUE")
        function.max_dynamic_smem = nbytes

    # --- memory ---------------------------------------------------------------------------------
    def mem_alloc(self, nbytes: int, align: int = ALLOC_ALIGN) -> int:
        """cuMemAlloc: 256-byte aligned like the real one; `align` 16 puts the end of a tensor that
        is not a multiple of 256 bytes next to its guard page (GuardedArena)."""
        size = max(int(nbytes), 1)
        ptr = self.lib.simt_alloc(size, align)
        if not ptr:
            raise CudaError(f"cuMemAlloc({nbytes}): CUDA_ERROR_OUT_OF_MEMORY")
        self.sizes[int(ptr)] = size
        self.aligns[int(ptr)] = align
        bisect.insort(self.bases, int(ptr))
        return int(ptr)

    def mem_free(self, ptr: int) -> None:
        self._drain(self.queued)  # cuMemFree waits for the work that may use the memory
        size = self.sizes.pop(int(ptr), None)
        if size is None:
            raise CudaError(f"cuMemFree({ptr:#x}): not an allocation")
        self.bases.pop(bisect.bisect_left(self.bases, int(ptr)))
        self.lib.simt_free(ptr, size, self.aligns.pop(int(ptr)))

    def _check_range(self, ptr: int, nbytes: int, what: str) -> None:
        index = bisect.bisect_right(self.bases, ptr) - 1
        if index >= 0 and ptr + nbytes <= self.bases[index] + self.sizes[self.bases[index]]:
            return
        raise CudaError(f"{what}: {nbytes} B at {ptr:#x} is not inside one allocation (CUDA_ERROR_INVALID_VALUE)")

    def host_alloc(self, nbytes: int) -> int:
        buffer = ctypes.create_string_buffer(max(int(nbytes), 1))
        self.pinned[ctypes.addressof(buffer)] = buffer
        return ctypes.addressof(buffer)

    def host_free(self, ptr: int) -> None:
        if self.pinned.pop(ptr, None) is None:
            raise CudaError(f"cuMemFreeHost({ptr:#x}): not a page-locked allocation (CUDA_ERROR_INVALID_VALUE)")

    def _is_pinned(self, ptr: int, nbytes: int) -> bool:
        return any(base <= ptr and ptr + nbytes <= base + len(buf) for base, buf in self.pinned.items())

    def defer(self, on: bool) -> None:
        """Queue stream work until the host waits for it (on), or run it at once again (off)."""
        self._drain(self.queued)
        self.queue = [] if on else None

    @property
    def queued(self) -> int:
        """Nodes ever queued."""
        return self.ran + len(self.queue or ())

    def _drain(self, upto: int) -> None:
        """Run the queued nodes up to the `upto`-th ever queued."""
        while self.queue and self.ran < upto:
            node = self.queue.pop(0)
            self.ran += 1
            node()

    def _now_or_recorded(self, node: Any) -> None:
        if self.capture is not None:
            self.capture.nodes.append(node)
        elif self.queue is not None:
            self.queue.append(node)
        else:
            node()

    def memcpy_htod(self, dst: int, src_host: int, nbytes: int, stream: Any) -> None:
        """Deferred, the bytes of pageable memory are staged at the call; page-locked memory is read
        when the copy runs."""
        self._refuse_in_capture("cuMemcpyHtoDAsync")
        self._check_range(dst, nbytes, "cuMemcpyHtoDAsync")
        if self.queue is None:
            ctypes.memmove(dst, src_host, nbytes)
            return
        staged = src_host if self._is_pinned(src_host, nbytes) else ctypes.create_string_buffer(ctypes.string_at(src_host, nbytes), nbytes)
        self._now_or_recorded(lambda: ctypes.memmove(dst, staged, nbytes))

    def memcpy_dtoh(self, dst_host: int, src: int, nbytes: int, stream: Any) -> None:
        """Into page-locked memory the copy is queued; into pageable memory it returns once done."""
        self._refuse_in_capture("cuMemcpyDtoHAsync")
        self._check_range(src, nbytes, "cuMemcpyDtoHAsync")
        if not self._is_pinned(dst_host, nbytes):
            self._drain(self.queued)
        self._now_or_recorded(lambda: ctypes.memmove(dst_host, src, nbytes))

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self._check_range(dst, nbytes, "cuMemcpyDtoDAsync")
        self._check_range(src, nbytes, "cuMemcpyDtoDAsync")
        self._now_or_recorded(lambda: ctypes.memmove(dst, src, nbytes))

    def memset_d8(self, dst: int, value: int, nbytes: int, stream: Any) -> None:
        self._check_range(dst, nbytes, "cuMemsetD8Async")
        self._now_or_recorded(lambda: ctypes.memset(dst, value, nbytes))

    # --- kernels --------------------------------------------------------------------------------
    def launch(self, launch: LaunchArgs) -> None:
        f: _Function = launch.function
        threads = launch.block[0] * launch.block[1] * launch.block[2]
        if threads > f.bound:
            raise CudaError(f"cuLaunchKernel({f.name}): {threads} threads > __launch_bounds__ {f.bound} "
                            "(CUDA_ERROR_INVALID_VALUE)")
        if launch.smem > f.max_dynamic_smem:
            raise CudaError(f"cuLaunchKernel({f.name}): {launch.smem} B dynamic shared memory > the function's "
                            f"limit {f.max_dynamic_smem} (CUDA_ERROR_INVALID_VALUE)")
        if launch.params_size != f.params_size:
            raise CudaError(f"cuLaunchKernel({f.name}): params of {launch.params_size} B, the kernel takes "
                            f"{f.params_size} B")
        params = ctypes.create_string_buffer(ctypes.string_at(launch.params_addr, launch.params_size))
        grid = (ctypes.c_uint * 3)(*launch.grid)
        block = (ctypes.c_uint * 3)(*launch.block)
        smem = int(launch.smem)

        def run() -> None:
            message = ctypes.create_string_buffer(512)
            if self.lib.simt_launch(f.entry, params, grid, block, smem, message, len(message)) != 0:
                raise CudaError(f"{f.name} grid={tuple(launch.grid)} block={tuple(launch.block)}: "
                                f"{message.value.decode()}")

        self._now_or_recorded(run)

    # --- streams, events, graphs ----------------------------------------------------------------
    def stream_create(self) -> Any:
        return object()

    def stream_destroy(self, stream: Any) -> None:
        self._refuse_in_capture("cuStreamDestroy")

    def module_unload(self, module: Any) -> None:
        """The built library stays loaded: later runtimes on this driver load the same one."""
        self._refuse_in_capture("cuModuleUnload")

    def stream_synchronize(self, stream: Any) -> None:
        self._refuse_in_capture("cuStreamSynchronize")
        self._drain(self.queued)

    def event_create(self) -> Any:
        return [0.0, 0]  # the time it ran, the nodes queued up to it

    def event_record(self, event: Any, stream: Any) -> None:
        import time

        def stamp() -> None:
            event[0] = time.perf_counter()

        self._now_or_recorded(stamp)
        event[1] = self.queued

    def event_synchronize(self, event: Any) -> None:
        self._drain(event[1])

    def event_elapsed_ms(self, start: Any, end: Any) -> float:
        return (end[0] - start[0]) * 1000.0

    def begin_capture(self, stream: Any) -> None:
        if self.capture is not None:
            raise CudaError("cuStreamBeginCapture: the stream is already capturing")
        self.capture = _Graph()

    def end_capture(self, stream: Any) -> _Graph:
        if self.capture is None:
            raise CudaError("cuStreamEndCapture: the stream is not capturing")
        graph, self.capture = self.capture, None
        return graph

    def graph_launch(self, graph_exec: _Graph, stream: Any) -> None:
        self._refuse_in_capture("cuGraphLaunch")
        if graph_exec.destroyed:
            raise CudaError("cuGraphLaunch: the graph was destroyed (CUDA_ERROR_INVALID_VALUE)")
        nodes = list(graph_exec.nodes)
        self._now_or_recorded(lambda: [node() for node in nodes])

    def graph_destroy(self, graph_exec: _Graph) -> None:
        graph_exec.nodes.clear()
        graph_exec.destroyed = True

    def _refuse_in_capture(self, call: str) -> None:
        if self.capture is not None:
            raise CudaError(f"{call} while the stream is capturing: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")


class GuardedArena:
    """The step arena (atlas.backends.cuda.memory.StepArena's interface) with every step tensor in
    an allocation of its own that ends at a guard page, so a kernel writing or reading past a
    scratch tensor faults instead of landing in its neighbour. The k-th allocation of a step reuses
    the k-th slot when the size is the same (what graph replay needs, like the bump arena);
    otherwise the slot is replaced and `generation` moves, so graphs are captured again."""

    def __init__(self, driver: SimtDriver, initial_bytes: int = 0) -> None:
        self.driver = driver
        self.generation = 0
        self.high_water = 0
        self._slots: list[tuple[int, int]] = []  # (ptr, size)
        self._next = 0

    def alloc(self, nbytes: int) -> int:
        size = max(int(nbytes), 1)
        index, self._next = self._next, self._next + 1
        if index < len(self._slots) and self._slots[index][1] == size:
            return self._slots[index][0]
        ptr = self.driver.mem_alloc(size, TENSOR_ALIGN)
        if index < len(self._slots):
            self.driver.mem_free(self._slots[index][0])
            self._slots[index] = (ptr, size)
            self.generation += 1
        else:
            self._slots.append((ptr, size))
        self.high_water = max(self.high_water, sum(size for _, size in self._slots[: self._next]))
        return ptr

    def mark(self) -> tuple[int]:
        return (self._next,)

    def rewind(self, mark: tuple[int]) -> None:
        self._next = mark[0]

    def reset(self) -> None:
        self._next = 0

    def spans(self) -> list[tuple[int, int]]:
        return list(self._slots)

    def release(self) -> None:
        for ptr, _ in self._slots:
            self.driver.mem_free(ptr)
        self._slots = []


def host_tuples(hw: str) -> list[Any]:
    """The tuples of `hw` whose kernel sources are in the tree (all of them build for the host)."""
    from atlas.backends.cuda.kernel_images import TupleKey

    root = REPO / "kernels" / hw
    return sorted(TupleKey(hw, d.parent.name, d.name) for d in root.glob("*/*") if any(d.glob("*.cu")))


def use_simt(monkeypatch: Any, hw: str) -> None:
    """Every CUDA backend this test opens runs on the host emulator of `hw`'s tuples."""
    from atlas.backends.cuda import driver, runtime, select
    from atlas.backends.cuda.runtime import KernelImage
    from atlas.targets import load_registry

    monkeypatch.setattr(driver, "open_driver", lambda ordinal=0: SimtDriver(hw))
    monkeypatch.setattr(runtime, "StepArena", GuardedArena)
    monkeypatch.setattr(select, "installed_tuples", lambda: host_tuples(hw))
    sm = load_registry().hardware[hw].sm
    monkeypatch.setattr(select, "load_image", lambda key, kind: KernelImage(f"{key} (host SIMT)", str(key).encode(), "ptx", sm))
