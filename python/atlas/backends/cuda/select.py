"""Which compiled tuple runs this checkpoint on this GPU, and whether the run fits in its memory.

compute capability -> hardware (targets.toml), config.json -> model, checkpoint -> quant; the
installed wheel must hold that (hw, model, quant) tuple. Every refusal is one AtlasError line
that says what to do instead. The memory check counts what the run will hold (footprint.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import AtlasError
from ..run_plan import RunPlan
from .footprint import DeviceFootprint, device_footprint
from .kernel_images import TupleKey, installed_tuples, load_image
from .memory import GIB

if TYPE_CHECKING:
    from ...config import ModelSpec
    from ...targets import Registry
    from .backend import CudaBackend
    from .driver import Driver


@dataclass(frozen=True)
class Selection:
    key: TupleKey
    kind: str  # "cubin" or "ptx"


def select_tuple(
    cc: tuple[int, int], model: str | None, quant: str, installed: list[TupleKey], registry: Registry
) -> Selection:
    """The installed tuple for this GPU, model and quant (native cubin first, then PTX JIT)."""
    from ...targets import hardware_candidates

    if model is None:
        known = ", ".join(registry.models)
        raise AtlasError(
            f"this checkpoint is none of the models atlas has GPU kernels for ({known}); "
            "use --device cpu"
        )
    candidates = hardware_candidates(cc, registry)
    if not candidates:
        raise AtlasError(
            f"no atlas hardware target serves this GPU (compute capability {cc[0]}.{cc[1]}; "
            f"targets: {', '.join(registry.hardware)}); use --device cpu"
        )
    have = set(installed)
    for hw in candidates:
        key = TupleKey(hw.name, model, quant)
        if key in have:
            native = hw.has_cubin and f"{cc[0]}.{cc[1]}" in hw.serves
            return Selection(key, "cubin" if native else "ptx")
    best = candidates[0].name
    held = ", ".join(str(k) for k in installed) or "no GPU kernels (a CPU-only +cpu wheel)"
    raise AtlasError(
        f"the installed atlas wheel holds {held}, not {best}/{model}/{quant} for this GPU "
        f"(compute capability {cc[0]}.{cc[1]}); build it with "
        f"`ATLAS_TARGET_HW={best} ATLAS_TARGET_MODEL={model} ATLAS_TARGET_QUANT={quant} pip wheel .` "
        "and install that wheel, or use --device cpu"
    )


HEADROOM_BYTES = 512 << 20  # arena growth on long prompts, the kernel module, CUDA graphs, per-step buffers


def check_fits(footprint: DeviceFootprint, free_bytes: int, total_bytes: int, headroom: int = HEADROOM_BYTES) -> None:
    """One line with the sizes when the run cannot fit, before anything is allocated."""
    if footprint.total + headroom > free_bytes:
        raise AtlasError(
            f"this run needs {(footprint.total + headroom) / GIB:.2f} GiB of GPU memory "
            f"({footprint.describe()}, +{headroom / GIB:.2f} GiB headroom) but the GPU has "
            f"{free_bytes / GIB:.2f} GiB free of {total_bytes / GIB:.1f} GiB; free GPU memory, use a "
            "smaller quantization (an fp8 or nvfp4 checkpoint), or use --device cpu"
        )


def checkpoint_footprint(model_dir: Path, spec: ModelSpec | None, run: RunPlan | None) -> DeviceFootprint:
    from ...config import load_spec
    from ...safetensors import Checkpoint

    checkpoint = Checkpoint.open(model_dir)
    try:
        return device_footprint(spec or load_spec(model_dir), checkpoint, run)
    finally:
        checkpoint.close()


def device_ordinal(env: Mapping[str, str] = os.environ) -> int:
    """ATLAS_CUDA_DEVICE (default 0): which GPU the backend opens."""
    value = env.get("ATLAS_CUDA_DEVICE", "0").strip()
    if not (value.isascii() and value.isdigit()):
        raise AtlasError(f"ATLAS_CUDA_DEVICE={value!r} is not a GPU index; set it to 0, 1, ... or unset it")
    return int(value)


def check_gpu_settings(environ: Mapping[str, str] = os.environ) -> None:
    """Every GPU setting checked (AtlasError on a bad value): ATLAS_CUDA_DEVICE,
    ATLAS_CUDA_BINDING and each kernel-form switch, some of which are read only when their op
    first runs. --device auto checks them before it looks for a GPU, so a mistyped value is the
    same one line on a machine without one as on one with, not a quiet fall-back to the CPU."""
    from .driver import binding_name
    from .ops_dense import ATTENTION_PREP_SWITCH, GEMM_SWITCH, PREFILL_ATTENTION_SWITCH, SAMPLE_SWITCH
    from .ops_delta_decode import DECODE_SWITCH
    from .norm_fusion import NORM_SWITCH
    from .ops_linear_moe import DELTA_RULE_SWITCH, ROUTER_SWITCH
    from .runtime import CHECK_SWITCH, GRAPHS_SWITCH, LAUNCH_SWITCH, PREFETCH_SWITCH, RUN_AHEAD_SWITCH

    device_ordinal(environ)
    binding_name(environ)
    for switch in (GEMM_SWITCH, PREFILL_ATTENTION_SWITCH, ATTENTION_PREP_SWITCH, DECODE_SWITCH, DELTA_RULE_SWITCH,
                   ROUTER_SWITCH, NORM_SWITCH, SAMPLE_SWITCH, CHECK_SWITCH, GRAPHS_SWITCH, LAUNCH_SWITCH,
                   PREFETCH_SWITCH, RUN_AHEAD_SWITCH):
        switch.read(environ=environ)


def _open(driver: Driver, selection: Selection, eager: bool = False) -> CudaBackend:
    """eager: no CUDA graphs whatever ATLAS_CUDA_GRAPHS says (else it decides)."""
    from .backend import CudaBackend
    from .runtime import CHECK_SWITCH, LAUNCH_SWITCH, PREFETCH_SWITCH, CudaRuntime, RuntimeOptions

    options = RuntimeOptions(check_launches=CHECK_SWITCH.read() == "1", programmatic=LAUNCH_SWITCH.read() == "pdl",
                             prefetch=PREFETCH_SWITCH.read() == "l2")
    runtime = CudaRuntime(driver, load_image(selection.key, selection.kind), options)
    return CudaBackend(runtime, use_graphs=False if eager else None)


def open_backend(model_dir: Path, spec: ModelSpec | None = None, run: RunPlan | None = None) -> CudaBackend:
    """The CUDA backend for this checkpoint, or an AtlasError saying why it cannot run; `run`
    (default: `atlas run`'s context and KV cache) sizes what is held beside the weights."""
    from ...config import read_json_object
    from ...targets import load_registry, recognise_model, recognise_quant
    from .driver import open_driver

    check_gpu_settings()
    registry = load_registry()
    # the spec when given: config.json as loaded, --hf-overrides applied (its fields are the registry's names)
    config = asdict(spec) if spec is not None else read_json_object(Path(model_dir) / "config.json")
    model = recognise_model(config, registry)
    quant = recognise_quant(model_dir, registry)
    driver = open_driver(device_ordinal())
    selection = select_tuple(driver.device_info().cc, model, quant, installed_tuples(), registry)
    footprint = checkpoint_footprint(Path(model_dir), spec, run)
    free, total = driver.mem_get_info()
    check_fits(footprint, free, total)
    return _open(driver, selection, eager=run is not None and run.eager)  # the loader shows the weight progress bar


def open_backend_for_model(model: str, quant: str = "bf16") -> CudaBackend:
    """The CUDA backend for a registry model by name, without a checkpoint (tests, benchmarks)."""
    from ...targets import load_registry
    from .driver import open_driver

    check_gpu_settings()
    driver = open_driver(device_ordinal())
    selection = select_tuple(driver.device_info().cc, model, quant, installed_tuples(), load_registry())
    return _open(driver, selection)
