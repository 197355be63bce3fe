"""CudaRuntime: the API the op wrappers (ops_dense, ops_linear_moe) are written against.

One device, one stream, one loaded kernel module. Step tensors come from a bump arena
(`empty`), persistent ones from a pool (`zeros`, `upload_bytes`); kernels are launched by entry
name with their params struct passed by value.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import numpy as np

from ...errors import AtlasError
from .driver import CudaError, DeviceInfo, Driver, Handle, LaunchArgs
from .memory import PersistentPool, StepArena
from .ops_common import FormSwitch
from .reads import HOST_DTYPES, PendingRead, PinnedReads
from .tensor import DeviceTensor, StorageDType

DEFAULT_SMEM_LIMIT = 48 * 1024
MAX_GRID_YZ = 65535
MAX_GRID_X = 2**31 - 1


@dataclass(frozen=True)
class KernelImage:
    """A loadable module: cubin for the device's own arch, else PTX for the driver's JIT."""

    label: str  # e.g. "h200/qwen3.6-35b-a3b/bf16 (cubin sm_90a)"
    data: bytes
    kind: str  # "cubin" or "ptx"
    sm: int  # the arch its tuple was built for (targets.toml): sm80's PTX has no griddepcontrol.wait, only 90 has wgmma


# ATLAS_LAUNCH=pdl: programmatic dependent launch, opt-in until the device measures it. Each kernel's
# launch and block scheduling overlap the previous kernel's tail; every entry starts with
# atlas::pdl_enter() (common.cuh: griddepcontrol.wait), so none reads memory before its predecessor is done.
LAUNCH_SWITCH = FormSwitch("ATLAS_LAUNCH", "launch form", ("plain", "pdl"))
PDL_CC = (9, 0)  # griddepcontrol and the launch attribute: Hopper and newer
# ATLAS_PREFETCH=l2: decode kernels pull weights into L2 ahead of their own loads (cp.async.bulk
# .prefetch.L2, sm_90+; nothing on older GPUs): a bf16 GEMV's first blocks their rows at entry
# (under pdl while the previous kernel still runs), the MoE gate_up GEMV the down rows of its
# experts. Opt-in until the device has timed it (bench/decode.py times both settings).
PREFETCH_SWITCH = FormSwitch("ATLAS_PREFETCH", "weight prefetch setting", ("off", "l2"))
# ATLAS_CUDA_CHECK=1: synchronise after each launch, so a fault names its kernel; ATLAS_CUDA_GRAPHS=0:
# decode without CUDA graphs (backend.py).
CHECK_SWITCH = FormSwitch("ATLAS_CUDA_CHECK", "launch check setting", ("0", "1"))
GRAPHS_SWITCH = FormSwitch("ATLAS_CUDA_GRAPHS", "CUDA graph setting", ("1", "0"))
# ATLAS_RUN_AHEAD=0: read each token back before queueing the next decode step (atlas.decode_loop),
# instead of queueing step N+1 first; the GPU then idles while the host takes token N.
RUN_AHEAD_SWITCH = FormSwitch("ATLAS_RUN_AHEAD", "run-ahead setting", ("1", "0"))


@dataclass(frozen=True)
class DeferredLaunch:
    """A launch issued late (CudaRuntime.defer): before any other work the runtime enqueues, so the
    stream's order is what it would have been, unless the next launch takes it over
    (take_deferred) by doing the same writes itself. `outputs` are what it writes, outputs[0] the
    tensor a consumer recognises it by; `inputs` are held so their memory outlives the launch."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    params: ctypes.Structure
    outputs: tuple[DeviceTensor, ...]
    inputs: tuple[DeviceTensor, ...]


@dataclass(frozen=True)
class RuntimeOptions:
    arena_bytes: int = 256 << 20
    check_launches: bool = False  # synchronise after each launch (outside capture) to name a faulting kernel
    programmatic: bool = False  # launch every kernel with programmatic stream serialization (ATLAS_LAUNCH=pdl)
    prefetch: bool = False  # decode kernels prefetch weights into L2 (ATLAS_PREFETCH=l2)


class CudaRuntime:
    def __init__(self, driver: Driver, image: KernelImage, options: RuntimeOptions) -> None:
        self.driver = driver
        self.options = options
        self.info: DeviceInfo = driver.device_info()
        self.sm_count = self.info.sm_count
        self.cc = self.info.cc
        self.max_smem_optin = self.info.max_smem_optin
        self.image = image
        data = image.data if image.kind == "cubin" or image.data.endswith(b"\0") else image.data + b"\0"
        self.module: Handle = driver.module_load(data)
        self.stream: Handle = driver.stream_create()
        self.arena = StepArena(driver, options.arena_bytes)
        self.pool = PersistentPool(driver)
        self.reads = PinnedReads(driver)
        self.graphs: dict[int, Handle] = {}  # live executable graphs by id(): destroyed before the module goes
        # Device memory, graphs, stream and module go back when the runtime is closed or collected (an
        # LLM dropped in a notebook or a test process); not at interpreter exit, where the process
        # frees them anyway.
        held = HeldResources(driver, self.module, self.stream, self.arena, self.pool, self.reads, self.graphs)
        self._release = weakref.finalize(self, release_resources, held)
        self._release.atexit = False
        self.capturing = False
        self.programmatic = options.programmatic  # bench/decode.py sets it to time both forms
        self.prefetch = options.prefetch  # so does this one: read when a decode kernel is launched
        if self.programmatic:
            check_programmatic(driver, self.cc, image)
        if self.prefetch:
            check_prefetch(image)
        self._functions: dict[str, Handle] = {}
        self._smem_set: dict[str, int] = {}
        self._deferred: DeferredLaunch | None = None

    def close(self) -> None:
        """Free every device allocation, graph, the stream and the module now (idempotent);
        nothing may run on this runtime after."""
        self._deferred = None
        self._release()
        self._functions.clear()  # handles into the unloaded module

    @property
    def closed(self) -> bool:
        return not self._release.alive

    # --- memory -------------------------------------------------------------------------------
    def empty(self, shape: tuple[int, ...], dtype: StorageDType) -> DeviceTensor:
        """Step scratch (arena): valid until the next `reset_step`."""
        shape = tuple(int(d) for d in shape)
        tensor = DeviceTensor(0, shape, dtype)
        return DeviceTensor(self.arena.alloc(tensor.nbytes), shape, dtype)

    def persistent(self, shape: tuple[int, ...], dtype: StorageDType) -> DeviceTensor:
        """Uninitialised memory that lives as long as the returned tensor (or its views)."""
        self._refuse_in_capture("a persistent allocation")
        shape = tuple(int(d) for d in shape)
        nbytes = DeviceTensor(0, shape, dtype).nbytes
        allocation = self.pool.alloc(nbytes)
        return DeviceTensor(allocation.ptr, shape, dtype, allocation)

    def zeros(self, shape: tuple[int, ...], dtype: StorageDType) -> DeviceTensor:
        tensor = self.persistent(shape, dtype)
        self.memset_zero(tensor)
        return tensor

    def memset_zero(self, t: DeviceTensor) -> None:
        self.issue_deferred()
        if t.nbytes:
            self.driver.memset_d8(t.ptr, 0, t.nbytes, self.stream)

    def poison_scratch(self) -> None:
        """Fill all arena memory with NaN bytes, so any step output a kernel fails to write
        reads back as NaN (f32, bf16) or -1 (i32). Tests call it before each op."""
        self.issue_deferred()
        if not self.arena.spans():
            self.arena.alloc(1)
            self.arena.reset()
        for ptr, size in self.arena.spans():
            self.driver.memset_d8(ptr, 0xFF, size, self.stream)

    def copy(self, dst: DeviceTensor, src: DeviceTensor) -> None:
        self.issue_deferred()
        if dst.nbytes != src.nbytes:
            raise ValueError(f"copy of {src.shape} {src.dtype} into {dst.shape} {dst.dtype}")
        if dst.nbytes:
            self.driver.memcpy_dtod(dst.ptr, src.ptr, dst.nbytes, self.stream)

    def write(self, dst: DeviceTensor, host: np.ndarray) -> None:
        """Copy host bytes (already in dst's storage format) into dst, in stream order. From
        pageable memory the driver stages the bytes before returning, so `host` may go at once."""
        self._refuse_in_capture("a host-to-device copy")
        self.issue_deferred()
        data = np.ascontiguousarray(host)
        if data.nbytes != dst.nbytes:
            raise ValueError(f"write of {data.nbytes} bytes into {dst.shape} {dst.dtype}")
        if data.nbytes:
            self.driver.memcpy_htod(dst.ptr, data.ctypes.data, data.nbytes, self.stream)

    def read(self, src: DeviceTensor) -> np.ndarray:
        """The raw storage of src as a host array (bf16 as uint16), after the stream drains."""
        self._refuse_in_capture("a device-to-host copy")
        self.issue_deferred()
        out = np.empty(src.shape, dtype=HOST_DTYPES[src.dtype])
        if out.nbytes:
            self.driver.memcpy_dtoh(out.ctypes.data, src.ptr, out.nbytes, self.stream)
        self.synchronize()
        return out

    def read_later(self, src: DeviceTensor) -> PendingRead:
        """read()'s copy queued without waiting (small tensors: reads.SLOT_BYTES); its result()
        waits for that copy alone, so work queued after it keeps running."""
        self._refuse_in_capture("a device-to-host copy")
        self.issue_deferred()
        return self.reads.start(src, self.stream)

    def reset_step(self) -> None:
        """Begin a step: recycle the arena (outside capture only; a no-op while capturing)."""
        self.issue_deferred()
        if not self.capturing:
            self.arena.reset()
            self.pool.trim()

    def synchronize(self) -> None:
        self.issue_deferred()
        self.driver.stream_synchronize(self.stream)

    # --- kernels ------------------------------------------------------------------------------
    def function(self, kernel: str) -> Handle:
        function = self._functions.get(kernel)
        if function is None:
            try:
                function = self.driver.get_function(self.module, kernel)
            except CudaError as err:
                raise CudaError(f"kernel {kernel} is not in {self.image.label}: {err}") from None
            self._functions[kernel] = function
        return function

    def launch(
        self,
        kernel: str,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        params: ctypes.Structure,
        smem: int = 0,
    ) -> None:
        _check_dims(kernel, grid, block)
        self.issue_deferred()
        function = self.function(kernel)
        if smem > DEFAULT_SMEM_LIMIT and self._smem_set.get(kernel, 0) < smem:
            if smem > self.max_smem_optin:
                raise CudaError(f"{kernel} asks {smem} B of shared memory; the device allows {self.max_smem_optin}")
            self.driver.set_max_dynamic_smem(function, smem)
            self._smem_set[kernel] = smem
        args = LaunchArgs(function, grid, block, smem, self.stream, ctypes.addressof(params),
                          ctypes.sizeof(params), kernel, self.programmatic)
        self.driver.launch(args)
        if self.options.check_launches and not self.capturing:
            try:
                self.driver.stream_synchronize(self.stream)
            except CudaError as err:
                raise CudaError(f"{kernel} grid={grid} block={block} failed while running: {err}") from None

    # --- deferred launches -----------------------------------------------------------------
    # One launch may wait for the next: atlas_add_rms_norm of one decode token under ATLAS_NORM=fused,
    # which the GEMV or router reading its output takes in (norm_fusion.take_norm). Every method that
    # puts work on the stream issues it first, and so must code that reaches the driver's stream
    # itself (graph.py), so nothing ever runs ahead of it or reads its outputs before they exist.
    def defer(self, launch: DeferredLaunch) -> None:
        self.issue_deferred()
        self._deferred = launch

    def deferred_writing(self, t: DeviceTensor) -> DeferredLaunch | None:
        """The waiting launch whose first output is t (same address, shape and dtype), if any."""
        launch = self._deferred
        return launch if launch is not None and launch.outputs[0] == t else None

    def take_deferred(self, launch: DeferredLaunch) -> None:
        """The next launch does `launch`'s writes itself: it is dropped, not issued."""
        if launch is not self._deferred:
            raise CudaError(f"{launch.kernel}: taken over, but it is not the launch waiting")
        self._deferred = None

    def issue_deferred(self) -> None:
        launch, self._deferred = self._deferred, None
        if launch is not None:
            self.launch(launch.kernel, launch.grid, launch.block, launch.params)

    def discard_deferred(self) -> None:
        """Forget the waiting launch (a failed capture it belonged to is being thrown away)."""
        self._deferred = None

    def _refuse_in_capture(self, what: str) -> None:
        if self.capturing:
            raise CudaError(
                f"{what} inside a captured decode step: allocate and upload before the step, "
                "use backend ops and rt.empty inside it"
            )


@dataclass(frozen=True)
class HeldResources:
    """What a runtime holds on the device (kept apart from it, for its finalizer)."""

    driver: Driver
    module: Handle
    stream: Handle
    arena: StepArena
    pool: PersistentPool
    reads: PinnedReads
    graphs: dict[int, Handle]


def release_resources(held: HeldResources) -> None:
    """A runtime's device resources, freed once its queued work is done (a closing runtime runs
    no graph again, so freeing what its graphs reference is safe); its graphs go before the
    module whose kernels they launch."""
    driver = held.driver
    try:
        driver.stream_synchronize(held.stream)
        held.arena.release()
        held.pool.release()
        held.reads.release()
        for graph in held.graphs.values():
            driver.graph_destroy(graph)
        held.graphs.clear()
        driver.stream_destroy(held.stream)
        driver.module_unload(held.module)
    except CudaError:  # a kernel fault lost the context: nothing can be freed, nor used, any more
        pass


def _check_dims(kernel: str, grid: tuple[int, int, int], block: tuple[int, int, int]) -> None:
    if len(grid) != 3 or len(block) != 3:
        raise ValueError(f"{kernel}: grid and block must be 3-tuples, got {grid} {block}")
    gx, gy, gz = (int(g) for g in grid)
    if not (1 <= gx <= MAX_GRID_X and 1 <= gy <= MAX_GRID_YZ and 1 <= gz <= MAX_GRID_YZ):
        raise ValueError(f"{kernel}: grid {grid} out of range (each >= 1; y, z <= {MAX_GRID_YZ})")
    threads = int(block[0]) * int(block[1]) * int(block[2])
    if not 1 <= threads <= 1024:
        raise ValueError(f"{kernel}: block {block} has {threads} threads (1..1024)")


def check_prefetch(image: KernelImage) -> None:
    """ATLAS_PREFETCH=l2's requirement, as one line when unmet: prefetch_l2 is compiled into kernels
    built for sm_90 or newer only (common.cuh), so an older tuple would not prefetch at all."""
    if image.sm < PDL_CC[0] * 10:
        raise AtlasError(f"{PREFETCH_SWITCH.env}=l2 needs kernels built for sm_90 or newer; the loaded {image.label} "
                         f"is built for sm_{image.sm}; unset {PREFETCH_SWITCH.env}, or install this GPU's own tuple")


def check_programmatic(driver: Driver, cc: tuple[int, int], image: KernelImage) -> None:
    """ATLAS_LAUNCH=pdl's requirements, as one line when unmet. The kernels must be built for sm_90
    or newer too: an older tuple's PTX (JIT-compiled for this GPU) has no griddepcontrol.wait, so a
    programmatic launch could read its predecessor's output before it is written."""
    if tuple(cc) < PDL_CC:
        raise AtlasError(f"{LAUNCH_SWITCH.env}=pdl needs compute capability 9.0 or newer, this GPU is "
                         f"{cc[0]}.{cc[1]}; unset {LAUNCH_SWITCH.env}")
    if image.sm < PDL_CC[0] * 10:
        raise AtlasError(f"{LAUNCH_SWITCH.env}=pdl needs kernels built for sm_90 or newer; the loaded {image.label} "
                         f"is built for sm_{image.sm}; unset {LAUNCH_SWITCH.env}, or install this GPU's own tuple")
    if not driver.programmatic:
        raise AtlasError(f"{LAUNCH_SWITCH.env}=pdl needs the cuda-bindings binding ({driver.binding} cannot launch "
                         f"with it); unset {LAUNCH_SWITCH.env} or ATLAS_CUDA_BINDING")
