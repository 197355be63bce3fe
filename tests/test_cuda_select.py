"""CPU-testable parts of the CUDA backend: tuple selection, error lines, the memory check, and the
runtime (arena, launches, uploads, graph replay) over an emulated driver that keeps device memory
in host RAM. No GPU needed."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlas.backends.cuda.driver import CudaError, DeviceInfo, LaunchArgs
from atlas.backends.cuda.graph import GraphedDecodeStep
from atlas.backends.cuda.kernel_images import TupleKey
from atlas.backends.cuda.runtime import CudaRuntime, KernelImage, RuntimeOptions
from atlas.backends.cuda.footprint import DeviceFootprint, device_footprint, quantized_bytes
from atlas.backends.run_plan import RunPlan
from atlas.backends.cuda.select import HEADROOM_BYTES, check_fits, device_ordinal, select_tuple
from atlas.backends.cuda.tensor import DeviceTensor
from atlas.backends.cuda.upload import Uploader, from_storage, to_storage
from atlas.errors import AtlasError
from atlas.targets import load_registry

QWEN = "qwen3.6-35b-a3b"


# --- selection ------------------------------------------------------------------------------------
def test_h200_cubin_chosen_on_cc90() -> None:
    installed = [TupleKey("h200", QWEN, "bf16"), TupleKey("sm80", QWEN, "bf16")]
    selection = select_tuple((9, 0), QWEN, "bf16", installed, load_registry())
    assert selection.key == TupleKey("h200", QWEN, "bf16")
    assert selection.kind == "cubin"


def test_portable_ptx_chosen_when_native_tuple_missing() -> None:
    installed = [TupleKey("sm80", QWEN, "bf16")]
    assert select_tuple((9, 0), QWEN, "bf16", installed, load_registry()).kind == "ptx"
    assert select_tuple((8, 9), QWEN, "bf16", installed, load_registry()).key.hw == "sm80"


def test_missing_tuple_names_wheel_contents_and_build_command() -> None:
    installed = [TupleKey("gb10", "atlas-demo", "bf16")]
    with pytest.raises(AtlasError) as err:
        select_tuple((9, 0), QWEN, "bf16", installed, load_registry())
    line = str(err.value)
    assert "\n" not in line
    assert "gb10/atlas-demo/bf16" in line
    assert f"ATLAS_TARGET_HW=h200 ATLAS_TARGET_MODEL={QWEN} ATLAS_TARGET_QUANT=bf16 pip wheel ." in line


def test_cpu_wheel_is_said_plainly() -> None:
    with pytest.raises(AtlasError, match=r"CPU-only \+cpu wheel"):
        select_tuple((12, 1), QWEN, "bf16", [], load_registry())


def test_unknown_model_and_old_gpu_are_refused() -> None:
    installed = [TupleKey("sm80", QWEN, "bf16")]
    with pytest.raises(AtlasError, match="none of the models"):
        select_tuple((9, 0), None, "bf16", installed, load_registry())
    with pytest.raises(AtlasError, match="compute capability 7.5"):
        select_tuple((7, 5), QWEN, "bf16", installed, load_registry())


def test_memory_check_names_sizes(rng: np.random.Generator) -> None:
    gib = 1 << 30
    weights = int(rng.integers(60, 80)) * gib
    footprint = DeviceFootprint(weights, int(rng.integers(1, 9)) << 26, 1 << 25, 256 << 20)
    check_fits(footprint, footprint.total + HEADROOM_BYTES, 141 * gib)
    with pytest.raises(AtlasError) as err:
        check_fits(footprint, footprint.total + HEADROOM_BYTES - 1, 141 * gib)
    line = str(err.value)
    assert "\n" not in line and f"weights {weights / gib:.2f}" in line and "141.0 GiB" in line
    assert f"KV cache {footprint.kv_cache / gib:.2f}" in line and "step arena 0.25" in line


@pytest.mark.parametrize("method", ["fp8", "nvfp4"])
def test_quantized_bytes_are_the_device_layout(rng: np.random.Generator, method: str) -> None:
    """The formula against quant_weights' real conversion of fresh random checkpoint parts."""
    from atlas.backends.cuda.quant_weights import from_fp8_block, from_nvfp4
    from atlas.quant.fp8_block import block_grid

    rows, k = int(rng.integers(1, 300)), 16 * int(rng.integers(1, 40))
    if method == "fp8":
        codes = rng.integers(0, 256, (rows, k), dtype=np.uint8)
        host = from_fp8_block(codes, rng.random(block_grid((rows, k), (128, 128)), dtype=np.float32))
    else:
        codes = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
        host = from_nvfp4(codes, rng.integers(0, 127, (rows, k // 16), dtype=np.uint8), np.float32(rng.random()))
    assert quantized_bytes(method, rows, k) == host.nbytes


def test_auto_device_falls_back_to_cpu_without_a_gpu(tmp_path: Path) -> None:
    from atlas.backends import create_backend
    from atlas.backends.cuda.driver import open_driver

    try:
        open_driver(0)
    except AtlasError:
        pass
    else:
        pytest.skip("a GPU is present: the fallback is not reachable here")
    demo = Path(__file__).resolve().parent.parent / "python" / "atlas" / "demo"
    if not (demo / "config.json").is_file():
        pytest.skip("the embedded demo checkpoint is not in the tree yet")
    from atlas.config import load_spec

    backend, reason = create_backend("auto", demo, load_spec(demo))
    assert backend.name != "cuda" and reason.startswith("cpu") and "cuda unavailable" in reason
    with pytest.raises(AtlasError):
        create_backend("cuda", demo, load_spec(demo))


def test_device_ordinal_is_read_or_refused_in_one_line(rng: np.random.Generator) -> None:
    index = int(rng.integers(0, 8))
    assert device_ordinal({"ATLAS_CUDA_DEVICE": f" {index} "}) == index
    assert device_ordinal({}) == 0
    for bad in ("gpu1", "-1", "", "0,1"):
        with pytest.raises(AtlasError, match="ATLAS_CUDA_DEVICE=.*set it to 0, 1"):
            device_ordinal({"ATLAS_CUDA_DEVICE": bad})


GPU_SETTINGS = {"ATLAS_CUDA_DEVICE": ("1", "one"), "ATLAS_CUDA_BINDING": ("pycuda", "cupy"),
                "ATLAS_ROUTER": ("fused", "fussed"), "ATLAS_GEMM": ("wgmma", "wmma"),
                "ATLAS_PREFILL_ATTENTION": ("simt", "flash"), "ATLAS_DELTANET_DECODE": ("fused", "fuse"),
                "ATLAS_ATTENTION_PREP": ("fused", "together"), "ATLAS_NORM": ("fused", "fuse"),
                "ATLAS_DELTA_RULE": ("chunked", "wy"), "ATLAS_LAUNCH": ("pdl", "graph"),
                "ATLAS_SAMPLE": ("split", "spilt"), "ATLAS_PREFETCH": ("l2", "on"),
                "ATLAS_CUDA_CHECK": ("1", "yes"), "ATLAS_CUDA_GRAPHS": ("0", "off"),
                "ATLAS_RUN_AHEAD": ("0", "no")}


@pytest.mark.parametrize("name", sorted(GPU_SETTINGS))
def test_every_gpu_setting_is_checked_up_front(name: str) -> None:
    from atlas.backends.cuda.select import check_gpu_settings

    good, bad = GPU_SETTINGS[name]
    check_gpu_settings({})
    check_gpu_settings({name: good})
    with pytest.raises(AtlasError, match=f"^{name}='{bad}' is not a "):
        check_gpu_settings({name: bad})


def test_auto_device_refuses_a_bad_gpu_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """--device auto refuses a mistyped setting whether or not a GPU is here; --device cpu, which
    reads none of them, runs."""
    from atlas.backends import create_backend
    from atlas.config import load_spec
    from atlas.demo import DEMO_DIR

    monkeypatch.setenv("ATLAS_ROUTER", "fussed")
    with pytest.raises(AtlasError, match="^ATLAS_ROUTER='fussed' is not a router form"):
        create_backend("auto", DEMO_DIR, load_spec(DEMO_DIR))
    backend, reason = create_backend("cpu", DEMO_DIR, load_spec(DEMO_DIR))
    assert backend.name == "numpy" and reason.startswith("cpu")


# --- an emulated driver: device memory is host RAM -----------------------------------------------
@dataclass
class FakeDriver:
    binding: str = "fake"
    graphs: bool = True
    programmatic: bool = True
    cc: tuple[int, int] = (9, 0)
    programmatic_launches: int = 0
    heap: Any = None
    next_ptr: int = 0
    allocs: dict[int, int] = field(default_factory=dict)
    pinned: dict[int, Any] = field(default_factory=dict)
    launches: list[tuple[str, tuple[int, int, int], bytes, int]] = field(default_factory=list)
    smem_raised: dict[str, int] = field(default_factory=dict)
    capturing: bool = False
    recorded: list[Any] = field(default_factory=list)
    graph_launches: int = 0
    live: dict[str, int] = field(default_factory=lambda: {"modules": 0, "streams": 0, "graphs": 0})

    def __post_init__(self) -> None:
        self.heap = ctypes.create_string_buffer(64 << 20)
        self.next_ptr = (ctypes.addressof(self.heap) + 255) // 256 * 256

    def device_info(self) -> DeviceInfo:
        return DeviceInfo("Fake H200", self.cc, 132, 227 * 1024, 141 << 30, 13000)

    def mem_get_info(self) -> tuple[int, int]:
        return 100 << 30, 141 << 30

    def module_load(self, image: bytes) -> Any:
        self.live["modules"] += 1
        return ("module", image)

    def module_unload(self, module: Any) -> None:
        assert self.live["modules"] > 0, "cuModuleUnload of no loaded module"
        self.live["modules"] -= 1

    def get_function(self, module: Any, name: str) -> Any:
        if not name.startswith("atlas_"):
            raise CudaError("cuModuleGetFunction failed: CUDA_ERROR_NOT_FOUND")
        return name

    def set_max_dynamic_smem(self, function: Any, nbytes: int) -> None:
        self.smem_raised[function] = nbytes

    def mem_alloc(self, nbytes: int) -> int:
        ptr = self.next_ptr
        self.next_ptr += (nbytes + 255) // 256 * 256
        assert self.next_ptr <= ctypes.addressof(self.heap) + len(self.heap) - 256, "fake heap exhausted"
        self.allocs[ptr] = nbytes
        return ptr

    def mem_free(self, ptr: int) -> None:
        assert not self.capturing, "cuMemFree during capture"
        del self.allocs[ptr]

    def host_alloc(self, nbytes: int) -> int:
        buffer = ctypes.create_string_buffer(nbytes)
        self.pinned[ctypes.addressof(buffer)] = buffer
        return ctypes.addressof(buffer)

    def host_free(self, ptr: int) -> None:
        del self.pinned[ptr]

    def _op(self, op: Any) -> None:
        if self.capturing:
            self.recorded.append(op)
        else:
            op()

    def _check_live(self, ptr: int, nbytes: int, what: str) -> None:
        """As the real driver: a range outside every live allocation is refused when the call is
        made (this heap never reuses an address, so a freed range would otherwise still read right)."""
        if not any(base <= ptr and ptr + nbytes <= base + size for base, size in self.allocs.items()):
            raise CudaError(f"{what} failed: CUDA_ERROR_INVALID_VALUE ({nbytes} B at {ptr:#x} is not allocated)")

    def memcpy_htod(self, dst: int, src_host: int, nbytes: int, stream: Any) -> None:
        assert not self.capturing
        self._check_live(dst, nbytes, "cuMemcpyHtoDAsync")
        ctypes.memmove(dst, src_host, nbytes)

    def memcpy_dtoh(self, dst_host: int, src: int, nbytes: int, stream: Any) -> None:
        assert not self.capturing
        self._check_live(src, nbytes, "cuMemcpyDtoHAsync")
        ctypes.memmove(dst_host, src, nbytes)

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self._check_live(dst, nbytes, "cuMemcpyDtoDAsync")
        self._check_live(src, nbytes, "cuMemcpyDtoDAsync")
        self._op(lambda: ctypes.memmove(dst, src, nbytes))

    def memset_d8(self, dst: int, value: int, nbytes: int, stream: Any) -> None:
        self._check_live(dst, nbytes, "cuMemsetD8Async")
        self._op(lambda: ctypes.memset(dst, value, nbytes))

    def launch(self, launch: LaunchArgs) -> None:
        params = ctypes.string_at(launch.params_addr, launch.params_size)
        self.programmatic_launches += launch.programmatic
        self._op(lambda: self.launches.append((launch.kernel, launch.grid, params, launch.smem)))

    def stream_create(self) -> Any:
        self.live["streams"] += 1
        return "stream"

    def stream_destroy(self, stream: Any) -> None:
        assert self.live["streams"] > 0 and not self.capturing, "cuStreamDestroy of no stream, or mid-capture"
        self.live["streams"] -= 1

    def stream_synchronize(self, stream: Any) -> None:
        assert not self.capturing

    def event_create(self) -> Any:
        return object()

    def event_record(self, event: Any, stream: Any) -> None:
        pass

    def event_synchronize(self, event: Any) -> None:
        pass

    def event_elapsed_ms(self, start: Any, end: Any) -> float:
        return 1.0

    def begin_capture(self, stream: Any) -> None:
        self.capturing, self.recorded = True, []

    def end_capture(self, stream: Any) -> Any:
        self.capturing = False
        self.live["graphs"] += 1
        return list(self.recorded)

    def graph_launch(self, graph_exec: Any, stream: Any) -> None:
        self.graph_launches += 1
        for op in graph_exec:
            op()

    def graph_destroy(self, graph_exec: Any) -> None:
        assert self.live["graphs"] > 0, "cuGraphExecDestroy of no graph"
        self.live["graphs"] -= 1


def make_runtime(arena_bytes: int = 1 << 20) -> tuple[CudaRuntime, FakeDriver]:
    driver = FakeDriver()
    image = KernelImage("fake/model/bf16 (cubin)", b"\x7fELF", "cubin", 90)
    return CudaRuntime(driver, image, RuntimeOptions(arena_bytes=arena_bytes)), driver


def test_programmatic_launch_is_opt_in_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """ATLAS_LAUNCH=pdl marks every launch programmatic; a GPU before Hopper or a binding without
    cuLaunchKernelEx is one line, and so is an unknown form."""
    from atlas.backends.cuda.runtime import LAUNCH_SWITCH

    image = KernelImage("fake/model/bf16 (cubin)", b"\x7fELF", "cubin", 90)
    params = AddParams(0, 0, 1, 1.0)
    plain, driver = make_runtime()
    plain.launch("atlas_add", (1, 1, 1), (32, 1, 1), params)
    assert driver.programmatic_launches == 0
    pdl = CudaRuntime(driver, image, RuntimeOptions(programmatic=True))
    pdl.launch("atlas_add", (1, 1, 1), (32, 1, 1), params)
    assert driver.programmatic_launches == 1
    with pytest.raises(AtlasError, match=r"ATLAS_LAUNCH=pdl needs compute capability 9.0 or newer, this GPU is 8.9"):
        CudaRuntime(FakeDriver(cc=(8, 9)), image, RuntimeOptions(programmatic=True))
    with pytest.raises(AtlasError, match="ATLAS_LAUNCH=pdl needs the cuda-bindings binding"):
        CudaRuntime(FakeDriver(programmatic=False), image, RuntimeOptions(programmatic=True))
    sm80 = KernelImage("sm80/model/bf16 (ptx)", b"// ptx", "ptx", 80)  # JIT-compiled for a Hopper: no griddepcontrol
    with pytest.raises(AtlasError, match=r"ATLAS_LAUNCH=pdl needs kernels built for sm_90 or newer; the loaded "
                                          r"sm80/model/bf16 \(ptx\) is built for sm_80; unset ATLAS_LAUNCH"):
        CudaRuntime(FakeDriver(), sm80, RuntimeOptions(programmatic=True))
    monkeypatch.setenv("ATLAS_LAUNCH", "eager")
    with pytest.raises(AtlasError, match="ATLAS_LAUNCH='eager' is not a launch form; use 'plain' .default. or 'pdl'"):
        LAUNCH_SWITCH.read()


def test_weight_prefetch_needs_hopper_kernels() -> None:
    """ATLAS_PREFETCH=l2 is compiled into sm_90+ kernels only: an older tuple is one line, not a
    setting that silently does nothing."""
    hopper = CudaRuntime(FakeDriver(), KernelImage("h200/model/bf16 (cubin)", b"\x7fELF", "cubin", 90),
                         RuntimeOptions(prefetch=True))
    assert hopper.prefetch
    sm80 = KernelImage("sm80/model/bf16 (ptx)", b"// ptx", "ptx", 80)
    with pytest.raises(AtlasError, match=r"^ATLAS_PREFETCH=l2 needs kernels built for sm_90 or newer; the loaded "
                                          r"sm80/model/bf16 \(ptx\) is built for sm_80; unset ATLAS_PREFETCH"):
        CudaRuntime(FakeDriver(), sm80, RuntimeOptions(prefetch=True))


class AddParams(ctypes.Structure):
    _fields_ = [("x", ctypes.c_void_p), ("out", ctypes.c_void_p), ("n", ctypes.c_int32),
                ("scale", ctypes.c_float)]


# --- runtime --------------------------------------------------------------------------------------
def arena_grows_then_folds(rt: CudaRuntime, rng: np.random.Generator, align: int) -> None:
    """Same addresses step after step; a step that outgrows the arena (1 MiB) folds it into one
    block at the next reset. Shared with the pycuda adapter's tests."""
    sizes = [tuple(int(d) for d in rng.integers(1, 100, size=2)) for _ in range(20)]
    first = [rt.empty(s, "f32").ptr for s in sizes]
    assert all(p % align == 0 for p in first)
    rt.reset_step()
    assert [rt.empty(s, "f32").ptr for s in sizes] == first
    generation = rt.arena.generation
    big = rt.empty((1 << 19,), "f32")  # 2 MiB: more than the arena holds
    assert big.ptr not in first
    rt.reset_step()
    assert rt.arena.generation == generation + 1


def test_arena_is_deterministic_and_grows_then_folds(rng: np.random.Generator) -> None:
    rt, driver = make_runtime(arena_bytes=1 << 20)
    arena_grows_then_folds(rt, rng, 256)
    assert len(driver.allocs) >= 1


def test_launch_passes_the_struct_bytes_and_raises_smem_limit(rng: np.random.Generator) -> None:
    rt, driver = make_runtime()
    x = rt.empty((64,), "f32")
    out = rt.empty((64,), "f32")
    scale = float(rng.standard_normal())
    params = AddParams(x.ptr, out.ptr, 64, scale)
    rt.launch("atlas_add", (1, 1, 1), (64, 1, 1), params, smem=100 * 1024)
    kernel, grid, raw, smem = driver.launches[-1]
    assert kernel == "atlas_add" and raw == bytes(params) and smem == 100 * 1024
    assert driver.smem_raised["atlas_add"] == 100 * 1024
    with pytest.raises(CudaError, match="allows"):
        rt.launch("atlas_add", (1, 1, 1), (64, 1, 1), params, smem=300 * 1024)
    with pytest.raises(ValueError, match="threads"):
        rt.launch("atlas_add", (1, 1, 1), (2048, 1, 1), params)
    with pytest.raises(ValueError, match="grid"):
        rt.launch("atlas_add", (0, 1, 1), (32, 1, 1), params)
    with pytest.raises(CudaError, match="not in fake/model/bf16"):
        rt.launch("missing", (1, 1, 1), (32, 1, 1), params)


def test_upload_round_trips_and_rounds_bf16_like_torch(rng: np.random.Generator) -> None:
    import torch

    rt, _ = make_runtime()
    uploader = Uploader(rt)
    matrix = rng.standard_normal((37, 64)).astype(np.float32) * 3
    device = uploader.upload(matrix, "bf16")
    back = from_storage(rt.read(device), "bf16")
    expected = torch.from_numpy(matrix).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(back, expected)
    ids = rng.integers(0, 1000, size=17).astype(np.int64)
    np.testing.assert_array_equal(rt.read(uploader.upload(ids, "i32")), ids.astype(np.int32))
    vec = rng.standard_normal(33).astype(np.float32)
    np.testing.assert_array_equal(rt.read(uploader.upload(vec, "f32")), vec)


def test_broadcast_upload_is_replicated_on_device(rng: np.random.Generator) -> None:
    rt, _ = make_runtime()
    tile = rng.standard_normal((3, 16, 8)).astype(np.float32)
    experts = int(rng.integers(5, 13))
    stacked = np.broadcast_to(tile[None], (experts, 3, 16, 8))
    device = Uploader(rt).upload(stacked, "bf16")
    assert device.shape == (experts, 3, 16, 8)
    back = from_storage(rt.read(device), "bf16")
    np.testing.assert_array_equal(back, np.broadcast_to(from_storage(to_storage(tile, "bf16"), "bf16"), back.shape))


def test_persistent_memory_is_reused_after_release() -> None:
    rt, driver = make_runtime()
    a = rt.persistent((16,), "i32")
    ptr = a.ptr
    del a
    import gc

    gc.collect()
    assert rt.persistent((16,), "i32").ptr == ptr


def _fake_step(rt: CudaRuntime) -> Any:
    """A stand-in decode step: out = ids (a device copy), plus one recorded kernel launch."""

    def step(ids: DeviceTensor, positions: DeviceTensor) -> DeviceTensor:
        rt.reset_step()
        out = rt.empty(ids.shape, "i32")
        rt.memset_zero(out)
        rt.copy(out, ids)
        rt.launch("atlas_step", (1, 1, 1), (32, 1, 1), AddParams(ids.ptr, out.ptr, 1, 0.0))
        return out

    return step


def test_decode_graph_captures_once_and_feeds_inputs(rng: np.random.Generator) -> None:
    rt, driver = make_runtime()
    graphed = GraphedDecodeStep(rt, _fake_step(rt))
    tokens = rng.integers(0, 50000, size=5)
    previous: DeviceTensor | None = None
    for position, token in enumerate(tokens):
        ids = previous if previous is not None and position % 2 else rt.persistent((1,), "i32")
        if ids is not previous:
            rt.write(ids, np.array([token], dtype=np.int32))
        expected = int(rt.read(ids)[0])
        positions = np.array([position], dtype=np.int32)
        out = graphed(ids, positions)
        assert int(rt.read(out)[0]) == expected
        assert int(rt.read(graphed._graph.positions)[0]) == position
        previous = out
    assert graphed.captures == 1
    assert driver.graph_launches == len(tokens)
    assert len(driver.launches) == len(tokens)


def test_decode_graph_takes_arena_ids_before_its_capture_folds_the_arena(rng: np.random.Generator) -> None:
    """The first decode step's ids are the prefill's argmax, in the step arena. Capturing starts a
    step, which frees the arena's blocks when the prefill grew it past one; the ids must be in the
    graph's own buffer before that, and not be read again after (seen on an H200, bench/quant.py's
    fp8 and nvfp4 decode: cuMemcpyDtoDAsync CUDA_ERROR_INVALID_VALUE)."""
    rt, driver = make_runtime(arena_bytes=1 << 20)
    token = int(rng.integers(0, 50000))
    rt.reset_step()
    for _ in range(2):
        rt.empty((int(rng.integers(300_000, 500_000)),), "f32")  # a prefill's scratch, past one block
    ids = rt.empty((1,), "i32")  # [1] its argmax
    rt.write(ids, np.array([token], dtype=np.int32))
    assert len(rt.arena.spans()) > 1
    graphed = GraphedDecodeStep(rt, _fake_step(rt))
    out = graphed(ids, np.zeros(1, dtype=np.int32))
    assert len(rt.arena.spans()) == 1 and graphed.captures == 1
    assert int(rt.read(out)[0]) == token
    again = graphed(out, np.ones(1, dtype=np.int32))  # replayed on its own output: no new capture
    assert int(rt.read(again)[0]) == token and graphed.captures == 1


def test_a_closed_runtime_gives_back_its_graphs_stream_and_module(rng: np.random.Generator) -> None:
    """Closing (or collecting) a runtime had freed its memory but kept its module (the kernels'
    code on the device), its stream and its captured graphs until the process ended."""
    import gc

    for close in (True, False):
        rt, driver = make_runtime()
        graphed = GraphedDecodeStep(rt, _fake_step(rt))
        ids = rt.persistent((1,), "i32")
        rt.write(ids, rng.integers(0, 50000, size=1).astype(np.int32))
        graphed(ids, np.zeros(1, dtype=np.int32))
        assert driver.live == {"modules": 1, "streams": 1, "graphs": 1}
        if close:
            rt.close()
            rt.close()  # idempotent
            graphed._drop()  # its runtime destroyed the graph: not destroyed twice
        else:
            del rt, graphed, ids
            gc.collect()
        assert driver.live == {"modules": 0, "streams": 0, "graphs": 0} and driver.allocs == {}


def test_decode_graph_recaptures_after_arena_moves() -> None:
    rt, _ = make_runtime(arena_bytes=1 << 20)
    graphed = GraphedDecodeStep(rt, _fake_step(rt))
    ids = rt.persistent((1,), "i32")
    rt.write(ids, np.array([7], dtype=np.int32))
    graphed(ids, np.array([0], dtype=np.int32))
    rt.empty((1 << 19,), "f32")  # a big prefill grows the arena
    rt.reset_step()
    out = graphed(ids, np.array([1], dtype=np.int32))
    assert graphed.captures == 2 and int(rt.read(out)[0]) == 7


def test_capture_refuses_host_copies_and_ends_cleanly() -> None:
    rt, driver = make_runtime()

    def bad_step(ids: DeviceTensor, positions: DeviceTensor) -> DeviceTensor:
        return rt.persistent((4,), "f32")

    graphed = GraphedDecodeStep(rt, bad_step)
    ids = rt.persistent((1,), "i32")
    rt.write(ids, np.array([1], dtype=np.int32))
    with pytest.raises(CudaError, match="inside a captured decode step"):
        graphed(ids, np.array([0], dtype=np.int32))
    assert not rt.capturing and not driver.capturing


def test_tensor_views() -> None:
    t = DeviceTensor(4096, (6, 4, 8), "bf16")
    assert t.reshape(-1, 8).shape == (24, 8) and t.reshape((48, 4)).nbytes == t.nbytes
    assert t.rows(2, 5).ptr == 4096 + 2 * 4 * 8 * 2 and t.rows(2, 5).shape == (3, 4, 8)
    with pytest.raises(ValueError):
        t.reshape(5, -1)
    assert math.prod(t.shape) == t.numel



def test_step_out_of_device_memory_is_one_line(rng: np.random.Generator) -> None:
    from atlas.backends.cuda.memory import StepArena

    limit = int(rng.integers(4, 16)) << 20

    class SmallDevice(FakeDriver):
        def mem_alloc(self, nbytes: int) -> int:
            if nbytes > limit:
                raise CudaError("cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)")
            return super().mem_alloc(nbytes)

    arena = StepArena(SmallDevice(), 1 << 20)
    arena.alloc(1000)
    with pytest.raises(AtlasError, match="ran out of memory") as err:
        arena.alloc(limit + 1)
    assert "\n" not in str(err.value)

# --- the real cuda-bindings adapter against a fake libcuda.so.1 (host memory) --------------------
FAKE_LIBCUDA_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
typedef unsigned long long dptr;
static unsigned char last_params[4096]; static size_t launches = 0; static char last_kernel[256];
int fake_launches(void) { return (int)launches; }
void fake_last_params(void* out, size_t n) { memcpy(out, last_params, n); }
const char* fake_last_kernel(void) { return last_kernel; }
int cuInit(unsigned f) { return 0; }
int cuDriverGetVersion(int* v) { *v = 13000; return 0; }
int cuDeviceGetCount(int* c) { *c = 1; return 0; }
int cuDeviceGet(int* d, int o) { *d = o; return o == 0 ? 0 : 101; }
int cuDeviceGetName(char* n, int len, int d) { strncpy(n, "Fake H200", len); return 0; }
int cuDeviceTotalMem_v2(size_t* b, int d) { *b = (size_t)141 << 30; return 0; }
int cuDeviceTotalMem(size_t* b, int d) { return cuDeviceTotalMem_v2(b, d); }
int cuDeviceGetAttribute(int* v, int a, int d) {
  *v = a == 75 ? 9 : a == 76 ? 0 : a == 16 ? 132 : a == 97 ? 232448 : 1; return 0; }
int cuDevicePrimaryCtxRetain(void** c, int d) { *c = (void*)0x10; return 0; }
/* A context is current per thread: calls that need one fail on a thread that did not set it. */
static __thread void* current = 0;
#define NEED_CONTEXT if (current != (void*)0x10) return 201 /* CUDA_ERROR_INVALID_CONTEXT */
int cuCtxSetCurrent(void* c) { if (c != (void*)0x10) return 201; current = c; return 0; }
int cuMemGetInfo_v2(size_t* f, size_t* t) { NEED_CONTEXT; *f = (size_t)100 << 30; *t = (size_t)141 << 30; return 0; }
int cuMemGetInfo(size_t* f, size_t* t) { return cuMemGetInfo_v2(f, t); }
/* live modules, streams and graph executables: a closed runtime leaves none */
static int live[3];
int fake_live(int which) { return live[which]; }
int cuModuleLoadData(void** m, const void* img) {
  NEED_CONTEXT; *m = (void*)0x20; if (!((const char*)img)[0]) return 200; live[0]++; return 0; }
int cuModuleUnload(void* m) { NEED_CONTEXT; if (m != (void*)0x20 || live[0] < 1) return 400; live[0]--; return 0; }
int cuModuleGetFunction(void** f, void* m, const char* name) {
  if (m != (void*)0x20) return 400; if (strncmp(name, "atlas_", 6)) return 500; *f = strdup(name); return 0; }
int cuFuncSetAttribute(void* f, int a, int v) { return a == 8 && v > 0 ? 0 : 1; }
int cuMemAlloc_v2(dptr* p, size_t n) { NEED_CONTEXT; *p = (dptr)malloc(n); return *p ? 0 : 2; }
int cuMemFree_v2(dptr p) { NEED_CONTEXT; free((void*)p); return 0; }
int cuMemcpyHtoDAsync_v2(dptr d, const void* s, size_t n, void* st) { NEED_CONTEXT; if (st != (void*)0x30) return 400; memcpy((void*)d, s, n); return 0; }
int cuMemcpyDtoHAsync_v2(void* d, dptr s, size_t n, void* st) { NEED_CONTEXT; if (st != (void*)0x30) return 400; memcpy(d, (void*)s, n); return 0; }
int cuMemcpyDtoDAsync_v2(dptr d, dptr s, size_t n, void* st) { NEED_CONTEXT; if (st != (void*)0x30) return 400; memmove((void*)d, (void*)s, n); return 0; }
int cuMemsetD8Async(dptr d, unsigned char v, size_t n, void* st) { NEED_CONTEXT; if (st != (void*)0x30) return 400; memset((void*)d, v, n); return 0; }
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned smem, void* st, void** params, void** extra) {
  NEED_CONTEXT;
  if (st != (void*)0x30 || !params || extra) return 1;
  memcpy(last_params, params[0], 64); strncpy(last_kernel, (const char*)f, 255); launches++; return 0; }
/* cuLaunchKernelEx's config as the driver API lays it out: one attribute, programmatic stream
   serialization (id 6), its value's first int the "allowed" flag. */
typedef struct { unsigned id; char pad[4]; union { unsigned char bytes[64]; int allowed; } value; } fake_attr;
typedef struct { unsigned gx, gy, gz, bx, by, bz, smem; void* st; fake_attr* attrs; unsigned nattrs; } fake_config;
static int last_programmatic = -1; static unsigned last_grid[3];
int fake_last_programmatic(void) { return last_programmatic; }
unsigned fake_last_grid(int i) { return last_grid[i]; }
int cuLaunchKernelEx(const fake_config* c, void* f, void** params, void** extra) {
  NEED_CONTEXT;
  if (c->st != (void*)0x30 || !params || extra || c->nattrs != 1 || c->attrs[0].id != 6) return 1;
  last_programmatic = c->attrs[0].value.allowed; last_grid[0] = c->gx; last_grid[1] = c->gy; last_grid[2] = c->gz;
  memcpy(last_params, params[0], 64); strncpy(last_kernel, (const char*)f, 255); launches++; return 0; }
int cuStreamCreate(void** s, unsigned f) { NEED_CONTEXT; *s = (void*)0x30; live[1]++; return 0; }
int cuStreamDestroy_v2(void* s) { NEED_CONTEXT; if (s != (void*)0x30 || live[1] < 1) return 400; live[1]--; return 0; }
int cuStreamDestroy(void* s) { return cuStreamDestroy_v2(s); }
int cuStreamSynchronize(void* s) { return 0; }
int cuEventCreate(void** e, unsigned f) { NEED_CONTEXT; *e = malloc(8); return 0; }
int cuEventRecord(void* e, void* s) { return 0; }
int cuEventSynchronize(void* e) { return 0; }
int cuEventElapsedTime(float* ms, void* a, void* b) { *ms = 1.5f; return 0; }
int cuEventElapsedTime_v2(float* ms, void* a, void* b) { *ms = 1.5f; return 0; }
int cuStreamBeginCapture_v2(void* s, int mode) { return mode == 2 ? 0 : 1; }
int cuStreamBeginCapture(void* s, int mode) { return cuStreamBeginCapture_v2(s, mode); }
int cuStreamEndCapture(void* s, void** g) { *g = (void*)0x40; return 0; }
int cuGraphInstantiateWithFlags(void** e, void* g, unsigned long long f) {
  *e = (void*)0x50; if (g != (void*)0x40) return 1; live[2]++; return 0; }
int cuGraphLaunch(void* e, void* s) { NEED_CONTEXT; return e == (void*)0x50 && s == (void*)0x30 ? 0 : 1; }
int cuGraphDestroy(void* g) { return 0; }
int cuGraphExecDestroy(void* e) { if (e != (void*)0x50 || live[2] < 1) return 400; live[2]--; return 0; }
int cuGetErrorString(int e, const char** s) { *s = "fake error"; return 0; }
int cuGetErrorName(int e, const char** s) { *s = "CUDA_ERROR_FAKE"; return 0; }
int cuGetProcAddress_v2(const char* sym, void** pfn, int ver, unsigned long long flags, int* status) {
  char name[256]; void* h = dlopen(NULL, RTLD_NOW); void* self = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  void* f = dlsym(self, sym);
  if (!f) { snprintf(name, sizeof name, "%s_v2", sym); f = dlsym(self, name); }
  if (!f && !strcmp(sym, "cuGraphInstantiate")) f = dlsym(self, "cuGraphInstantiateWithFlags");
  *pfn = f; if (status) *status = f ? 0 : 1; (void)h;

  return f ? 0 : 500; }
int cuGetProcAddress(const char* sym, void** pfn, int ver, unsigned long long flags) { return cuGetProcAddress_v2(sym, pfn, ver, flags, 0); }
"""

ADAPTER_SCRIPT = r"""
import ctypes, sys
import numpy as np
fake = ctypes.CDLL("libcuda.so.1")
fake.fake_last_kernel.restype = ctypes.c_char_p
from atlas.backends.cuda.driver import open_driver
from atlas.backends.cuda.runtime import CudaRuntime, KernelImage, RuntimeOptions
from atlas.errors import AtlasError
from atlas.backends.cuda.graph import GraphedDecodeStep
from atlas.backends.cuda.upload import Uploader, from_storage

try:
    open_driver(1)
except AtlasError as err:
    assert "ATLAS_CUDA_DEVICE=1: only 1 GPU(s) visible (0..0)" in str(err), err
else:
    raise AssertionError("device 1 of 1 opened")
drv = open_driver(0)
print(drv.device_info(), drv.mem_get_info())
rt = CudaRuntime(drv, KernelImage("fake (ptx)", b"// ptx", "ptx", 90), RuntimeOptions(arena_bytes=8 << 20, check_launches=True))
up = Uploader(rt)
a = np.random.default_rng(0).standard_normal((33, 64)).astype(np.float32)
t = up.upload(a, "bf16"); back = from_storage(rt.read(t), "bf16")
assert np.abs(back - a).max() < 0.02, "bf16 round trip"
ids = up.upload(np.arange(7), "i32"); assert (rt.read(ids) == np.arange(7)).all()
e = rt.empty((5,), "f32"); rt.poison_scratch(); assert np.isnan(rt.read(e)).all()
rt.memset_zero(e); assert (rt.read(e) == 0).all()
rt.copy(e, up.upload(np.ones(5), "f32")); assert (rt.read(e) == 1).all()
class P(ctypes.Structure):
    _fields_ = [("x", ctypes.c_void_p), ("n", ctypes.c_int32), ("s", ctypes.c_float)]
p = P(t.ptr, 42, 1.5)
rt.launch("atlas_test", (3, 2, 1), (128, 1, 1), p, smem=64 * 1024)
buf = ctypes.create_string_buffer(64); fake.fake_last_params(buf, 64)
assert buf.raw[:ctypes.sizeof(p)] == bytes(p), "params bytes"
assert fake.fake_last_kernel() == b"atlas_test"
try:
    rt.launch("missing", (1, 1, 1), (1, 1, 1), p); raise SystemExit("no error")
except Exception as err:
    print("expected:", err)
big = np.broadcast_to(np.arange(12, dtype=np.float32).reshape(3, 4)[None], (5, 3, 4))
bt = up.upload(big, "f32"); assert (rt.read(bt) == big).all(), "replicated"
def step(ids_t, pos_t):
    out = rt.empty(ids_t.shape, "i32"); rt.copy(out, ids_t)
    rt.launch("atlas_step", (1, 1, 1), (32, 1, 1), P(ids_t.ptr, 1, 0.0)); return out
g = GraphedDecodeStep(rt, step)
before = fake.fake_launches()
o = g(up.upload(np.array([5]), "i32"), np.array([0], dtype=np.int32))
o = g(up.upload(np.array([6]), "i32"), np.array([1], dtype=np.int32))
print("captures", g.captures, "launches during capture", fake.fake_launches() - before)
assert fake.fake_last_programmatic() == -1, "a plain launch went through cuLaunchKernelEx"
pdl = CudaRuntime(drv, KernelImage("fake (ptx)", b"// ptx", "ptx", 90), RuntimeOptions(programmatic=True))
pdl.launch("atlas_pdl", (5, 4, 1), (64, 1, 1), p)
assert fake.fake_last_programmatic() == 1 and fake.fake_last_kernel() == b"atlas_pdl", "cuLaunchKernelEx"
assert [fake.fake_last_grid(i) for i in range(3)] == [5, 4, 1]
fake.fake_last_params(buf, 64); assert buf.raw[:ctypes.sizeof(p)] == bytes(p), "params bytes (pdl)"
s, e2 = drv.event_create(), drv.event_create(); drv.event_record(s, rt.stream); drv.event_record(e2, rt.stream); drv.event_synchronize(e2)
print("elapsed", drv.event_elapsed_ms(s, e2))
import threading
found = {}
def elsewhere():  # an LLM built on one thread and run on another: the context follows the calls
    try:
        x = up.upload(a, "f32"); rt.launch("atlas_thread", (1, 1, 1), (32, 1, 1), P(x.ptr, 1, 0.0))
        found["back"] = rt.read(x)
    except Exception as err:
        found["error"] = err
worker = threading.Thread(target=elsewhere); worker.start(); worker.join()
assert "error" not in found, found.get("error")
assert (found["back"] == a).all() and fake.fake_last_kernel() == b"atlas_thread"
from cuda.bindings import driver as raw
def bare():  # the fake enforces it: a thread that never set the context gets INVALID_CONTEXT
    found["bare"] = int(raw.cuMemAlloc(16)[0])
worker = threading.Thread(target=bare); worker.start(); worker.join()
assert found["bare"] == 201, found
assert [fake.fake_live(i) for i in range(3)] == [2, 2, 1], "modules, streams, graphs before closing"
rt.close(); pdl.close(); g._drop()
assert [fake.fake_live(i) for i in range(3)] == [0, 0, 0], "a closed runtime keeps none"
print("ALL OK")
"""


def test_cuda_bindings_adapter_against_a_fake_driver(tmp_path: Path) -> None:
    """Every driver call atlas makes goes through cuda-bindings into a fake libcuda built here
    (device memory = host memory): argument marshalling, the packed params bytes, copies, capture."""
    import shutil
    import subprocess
    import sys

    pytest.importorskip("cuda.bindings")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the fake libcuda")
    (tmp_path / "fake.c").write_text(FAKE_LIBCUDA_C)
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(tmp_path / "libcuda.so.1"),
                    str(tmp_path / "fake.c"), "-ldl"], check=True)
    (tmp_path / "drive.py").write_text(ADAPTER_SCRIPT)
    import os

    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path), "ATLAS_CUDA_BINDING": "cuda-bindings",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    run = subprocess.run([sys.executable, str(tmp_path / "drive.py")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]


# --- the memory estimate against what loading really allocates -------------------------------------
TINY_FOR_GPU = dict(hidden_size=160, head_dim=64, dtype="bfloat16")  # attention kernels: head_dim 64+


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from _checkpoints import TinyModel, random_checkpoint_dir
    from atlas.quantize import QuantizeArgs, quantize

    source = random_checkpoint_dir(tmp_path_factory, "tiny-bf16", TinyModel(**TINY_FOR_GPU))  # type: ignore[arg-type]
    out = tmp_path_factory.mktemp("tiny-quantized")
    quantized = {m: quantize(QuantizeArgs(str(source), m, out / m, 1 << 30)) for m in ("fp8", "nvfp4")}
    shared_slot = TinyModel(**TINY_FOR_GPU, shared_expert_intermediate_size=32)  # type: ignore[arg-type]
    return {"bf16": source, **quantized, "bf16-shared-slot": random_checkpoint_dir(tmp_path_factory, "tiny-slot", shared_slot)}


def _allocated(driver: FakeDriver) -> int:
    return sum(driver.allocs.values())


@pytest.mark.parametrize(("method", "kv_level"), [("bf16", "bf16"), ("fp8", "fp8"), ("nvfp4", "turbo4")])
def test_footprint_matches_what_loading_allocates(
    tiny_checkpoints: dict[str, Path], rng: np.random.Generator, method: str, kv_level: str
) -> None:
    """Weights, then weights + KV caches + DeltaNet states, as the emulated driver sees them. The
    weight estimate rounds each planned tensor to the pool's 256 bytes, the loader each stacked
    upload (experts, gate + up): it may exceed what is allocated by that, never fall short; the
    caches and states are exact (a quantized level's caches made directly in its storage)."""
    from atlas.backends.cuda.backend import CudaBackend
    from atlas.config import load_spec
    from atlas.engine import Engine
    from atlas.kvcache.options import KVCacheOptions
    from atlas.models import load_model
    from atlas.safetensors import Checkpoint

    model_dir = tiny_checkpoints[method]
    spec, checkpoint = load_spec(model_dir), Checkpoint.open(model_dir)
    run = RunPlan(max_seq_len=int(rng.integers(8, 300)), kv_cache=KVCacheOptions(kv_level, 0))
    estimate = device_footprint(spec, checkpoint, run)

    rt, driver = make_runtime()
    load_model(spec, checkpoint, CudaBackend(rt, use_graphs=False))
    weights = _allocated(driver)
    rt, driver = make_runtime()
    Engine(spec, checkpoint, CudaBackend(rt, use_graphs=False), run.max_seq_len, kv_cache=run.kv_cache)
    held = _allocated(driver)
    print(f"{method}: weights {weights} B, estimated {estimate.weights} B; held {held} B, estimated "
          f"{estimate.total - estimate.arena} B")
    assert weights <= estimate.weights <= weights * 1.01  # over only by 256-byte rounding of stacked parts
    assert held - weights == estimate.kv_cache + estimate.states


def test_closing_or_dropping_a_model_frees_its_device_memory(tiny_checkpoints: dict[str, Path],
                                                             rng: np.random.Generator) -> None:
    """Device memory had stayed allocated after its LLM was gone (a notebook loading another model,
    a test process building one after another); now collecting the runtime frees it, and
    LLM.close() / a with-block frees it at once and refuses to generate after."""
    import gc

    from atlas.backends.cuda.backend import CudaBackend
    from atlas.config import load_spec
    from atlas.demo import DEMO_DIR
    from atlas.engine import Engine
    from atlas.llm import LLM, LoadedModel
    from atlas.safetensors import Checkpoint
    from atlas.tokenizer import Tokenizer

    model_dir = tiny_checkpoints[str(rng.choice(["bf16", "fp8", "nvfp4"]))]
    spec, checkpoint = load_spec(model_dir), Checkpoint.open(model_dir)
    rt, driver = make_runtime()
    engine = Engine(spec, checkpoint, CudaBackend(rt, use_graphs=False), int(rng.integers(8, 300)))
    assert _allocated(driver) > 0
    del engine, rt
    gc.collect()
    assert driver.allocs == {}

    rt, driver = make_runtime()
    engine = Engine(spec, checkpoint, CudaBackend(rt, use_graphs=False), int(rng.integers(8, 300)))
    tokenizer = Tokenizer.open(DEMO_DIR)  # the tiny checkpoints have none; nothing is encoded below
    with LLM.from_loaded(LoadedModel(model_dir, spec, tokenizer, engine, "cuda (fake)")) as llm:
        assert _allocated(driver) > 0 and not rt.closed
    assert driver.allocs == {} and rt.closed
    llm.close()  # idempotent
    with pytest.raises(AtlasError, match="this LLM was closed"):
        llm.generate([1, 2], max_tokens=2)


DRIVER_PAGE_BYTES = 2 << 20


def live_bytes(pool: Any) -> int:
    """Pool bytes held by live tensors: allocated, less the blocks it keeps for reuse or has yet
    to free (a loader's upload temporaries end there)."""
    cached = sum(size * len(ptrs) for size, ptrs in pool._free.items())
    return pool.allocated_bytes - cached - sum(size for _, size in pool._pending_free)


def test_footprint_is_what_a_stacked_shared_expert_holds(
    tiny_checkpoints: dict[str, Path], rng: np.random.Generator
) -> None:
    """Shared expert as large as a routed one: the loader may stack it as expert E (with upload
    temporaries the pool keeps); the live bytes are still the estimate."""
    from atlas.backends.cuda.backend import CudaBackend
    from atlas.config import load_spec
    from atlas.engine import Engine
    from atlas.safetensors import Checkpoint

    model_dir = tiny_checkpoints["bf16-shared-slot"]
    spec, checkpoint = load_spec(model_dir), Checkpoint.open(model_dir)
    run = RunPlan(max_seq_len=int(rng.integers(8, 300)))
    estimate = device_footprint(spec, checkpoint, run)
    rt, driver = make_runtime()
    engine = Engine(spec, checkpoint, CudaBackend(rt, use_graphs=False), run.max_seq_len)
    live = live_bytes(rt.pool)
    print(f"live {live} B, estimated {estimate.total - estimate.arena} B, driver {_allocated(driver)} B")
    assert live <= estimate.total - estimate.arena <= live * 1.01 and _allocated(driver) >= live
    del engine


def test_open_backend_refuses_before_allocating(
    tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fit check runs on the checkpoint's headers: a GPU one byte short gets the sizes and
    no allocation; one that is large enough gets the backend."""
    import atlas.backends.cuda.driver as driver_mod
    import atlas.backends.cuda.select as select_mod
    from atlas.backends.cuda.kernel_images import TupleKey
    from atlas.config import load_spec
    from atlas.safetensors import Checkpoint

    model_dir = tiny_checkpoints["nvfp4"]
    needed = device_footprint(load_spec(model_dir), Checkpoint.open(model_dir)).total + HEADROOM_BYTES
    key = TupleKey("h200", "atlas-demo", "nvfp4")
    monkeypatch.setattr(select_mod, "select_tuple", lambda *args: select_mod.Selection(key, "cubin"))
    monkeypatch.setattr(select_mod, "load_image", lambda *args: KernelImage("fake", b"\x7fELF", "cubin", 90))
    for free, fits in ((needed - 1, False), (needed, True)):
        driver = FakeDriver()
        driver.mem_get_info = lambda free=free: (free, 141 << 30)  # type: ignore[method-assign]
        monkeypatch.setattr(driver_mod, "open_driver", lambda ordinal, d=driver: d)
        if fits:
            assert select_mod.open_backend(model_dir).rt.driver is driver
            continue
        with pytest.raises(AtlasError, match=r"needs 0\.7\d GiB of GPU memory \(weights 0\.00 \+ KV cache .* but the GPU has 0\.7\d GiB free") as err:
            select_mod.open_backend(model_dir)
        assert "\n" not in str(err.value) and driver.allocs == {}


@pytest.mark.parametrize(("eager", "switch", "graphs"), [(False, "", True), (False, "0", False), (True, "", False),
                                                       (True, "1", False)])
def test_enforce_eager_turns_graphs_off(tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                        eager: bool, switch: str, graphs: bool) -> None:
    """vLLM's --enforce-eager (RunPlan.eager): no CUDA graphs whatever ATLAS_CUDA_GRAPHS says;
    without it the switch decides."""
    import atlas.backends.cuda.driver as driver_mod
    import atlas.backends.cuda.select as select_mod

    key = TupleKey("h200", "atlas-demo", "bf16")
    monkeypatch.setattr(select_mod, "select_tuple", lambda *args: select_mod.Selection(key, "cubin"))
    monkeypatch.setattr(select_mod, "load_image", lambda *args: KernelImage("fake", b"\x7fELF", "cubin", 90))
    monkeypatch.setattr(driver_mod, "open_driver", lambda ordinal: FakeDriver())
    monkeypatch.setenv("ATLAS_CUDA_GRAPHS", switch)
    backend = select_mod.open_backend(tiny_checkpoints["bf16"], None, RunPlan(eager=eager))
    assert backend.use_graphs is graphs and ("no CUDA graphs" in backend.describe()) is not graphs


@pytest.mark.parametrize("flag", [[], ["--enforce-eager"]])
def test_enforce_eager_flag_reaches_the_backend(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                flag: list[str]) -> None:
    """atlas.run --enforce-eager hands the CUDA backend a run plan that says so (no GPU here: the
    refusal sends --device auto to the CPU, as on a machine without one)."""
    import atlas.backends as backends
    from atlas.run import main

    plans: list[RunPlan] = []

    def no_gpu(model_dir: Path, spec: Any, run: RunPlan) -> Any:
        plans.append(run)
        raise AtlasError("no GPU in this test")

    monkeypatch.setattr(backends, "open_cuda_backend", no_gpu)
    assert main([*flag, "--device", "auto", "--max-tokens", "2"]) == 0
    assert [plan.eager for plan in plans] == [bool(flag)] and "no GPU in this test" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["bf16", "fp8", "nvfp4"])
def test_gpu_footprint_matches_the_device(tmp_path: Path, rng: np.random.Generator, method: str) -> None:
    """On the GPU, through open_backend (the real fit check): the demo (quantized copies by
    atlas.quantize) holds what the estimate says, and the driver's free memory drops by at least
    that much."""
    import gc
    import os

    from atlas.backends.cuda.select import open_backend
    from atlas.config import load_spec
    from atlas.demo import DEMO_DIR
    from atlas.engine import Engine
    from atlas.quantize import QuantizeArgs, quantize
    from atlas.safetensors import Checkpoint

    model_dir = DEMO_DIR if method == "bf16" else quantize(QuantizeArgs(str(DEMO_DIR), method, tmp_path / method, 1 << 30))
    try:
        backend = open_backend(model_dir)
    except (AtlasError, ImportError) as err:
        required = "ATLAS_REQUIRE_GPU" if method == "bf16" else "ATLAS_REQUIRE_GPU_QUANT"
        if os.environ.get(required) == "1":
            raise
        pytest.skip(f"no CUDA backend for the demo in {method} here: {err}")
    spec, checkpoint = load_spec(model_dir), Checkpoint.open(model_dir)
    run = RunPlan(max_seq_len=int(rng.integers(64, 2048)), load_mtp=False)  # Engine alone loads no MTP head
    estimate = device_footprint(spec, checkpoint, run)
    pool, driver = backend.rt.pool, backend.rt.driver
    gc.collect()  # earlier tests' device tensors are released before the free memory is read
    pool.trim()
    live_before, free_before = live_bytes(pool), driver.mem_get_info()[0]
    reusable = pool.allocated_bytes - live_before  # small blocks earlier tests gave back: no new cuMemAlloc
    engine = Engine(spec, checkpoint, backend, run.max_seq_len, kv_cache=run.kv_cache)
    backend.rt.synchronize()
    live = live_bytes(pool) - live_before
    expected = estimate.weights + estimate.kv_cache + estimate.states
    dropped = free_before - driver.mem_get_info()[0]
    print(f"{method}: live {live} B, estimated {expected} B, pool {pool.allocated_bytes} B, reusable {reusable} B, "
          f"free dropped {dropped} B")
    assert live <= expected <= live * 1.01
    # The driver hands small allocations out of 2 MiB pages it may already hold (seen on an H200:
    # nvfp4's 1.7 MB demo dropped the free memory by 0 after the bf16 and fp8 runs).
    assert dropped >= live - reusable - DRIVER_PAGE_BYTES
    del engine


def test_every_kernel_form_switch_reads_empty_as_default_and_refuses_in_one_line(rng: np.random.Generator) -> None:
    from atlas.backends.cuda import ops_delta_decode, ops_dense, ops_linear_moe, runtime

    switches = [ops_dense.GEMM_SWITCH, ops_dense.PREFILL_ATTENTION_SWITCH, ops_dense.ATTENTION_PREP_SWITCH,
                ops_dense.SAMPLE_SWITCH, ops_linear_moe.ROUTER_SWITCH,
                ops_linear_moe.DELTA_RULE_SWITCH, ops_delta_decode.DECODE_SWITCH, runtime.LAUNCH_SWITCH,
                runtime.CHECK_SWITCH, runtime.GRAPHS_SWITCH]
    assert len({s.env for s in switches}) == len(switches)
    for switch in switches:
        assert switch.read(None, {}) == switch.read(None, {switch.env: " "}) == switch.forms[0]
        other = str(rng.choice(switch.forms))
        assert switch.read(None, {switch.env: other}) == other and switch.read(other, {switch.env: "x"}) == other
        with pytest.raises(AtlasError, match=f"^{switch.env}='bogus' is not a .*; use '{switch.forms[0]}' \\(default\\)"):
            switch.read(None, {switch.env: "bogus"})
