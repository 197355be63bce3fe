"""Per-layer traces of one forward pass: atlas through its dump hook, transformers through hooks.

Both give each decoder layer's output (the residual stream after the layer), its router logits and
chosen experts, and the logits of every position, as numpy arrays for atlas.compare.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import AtlasError

if TYPE_CHECKING:
    from .engine import Engine

TRACED_NAME = re.compile(r"^layer\.(\d+)\.(out|mlp\.router_logits|mlp\.router_ids)$")


@dataclass
class LayerTrace:
    outputs: list[np.ndarray]  # per layer [T, H]
    router_logits: list[np.ndarray | None]  # per layer [T, E]; None for a layer without a router
    chosen: list[np.ndarray | None]  # per layer [T, k] expert ids
    logits: np.ndarray  # [T, V]


def atlas_trace(engine: Engine, ids: list[int], num_layers: int) -> LayerTrace:
    """Teacher-forced forward of `ids` from a fresh state; an ATLAS_DUMP hook keeps receiving."""
    captured: dict[str, np.ndarray] = {}
    previous = engine.dump

    def capture(name: str, tensor: Any) -> None:
        if previous is not None:
            previous(name, tensor)
        if TRACED_NAME.match(name):
            captured[name] = engine.backend.to_numpy(tensor)

    engine.dump = capture
    try:
        logits = engine.logits(ids)  # [T, V]
    finally:
        engine.dump = previous
    return LayerTrace(
        outputs=[captured[f"layer.{i}.out"] for i in range(num_layers)],
        router_logits=[captured.get(f"layer.{i}.mlp.router_logits") for i in range(num_layers)],
        chosen=[captured.get(f"layer.{i}.mlp.router_ids") for i in range(num_layers)],
        logits=logits,
    )


def oracle_device(requested: str, atlas_device: str) -> str:
    """--oracle-device -> a torch device. auto: cuda when atlas ran there and torch sees a GPU."""
    torch = import_torch()
    if requested == "auto":
        return "cuda" if atlas_device.startswith("cuda") and torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise AtlasError("--oracle-device cuda: torch sees no GPU; use --oracle-device cpu")
    return requested


def transformers_trace(model_dir: Path, ids: list[int], num_layers: int, device: str) -> LayerTrace:
    """The float32 transformers model's trace on the torch `device`."""
    torch = import_torch()
    model = load_oracle(model_dir, device, num_layers)
    layers = decoder_layers(model, num_layers)
    outputs: dict[int, np.ndarray] = {}
    routers: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    hooks = [layer.register_forward_hook(keep_output(outputs, i)) for i, layer in enumerate(layers)]
    for i, layer in enumerate(layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None:
            hooks.append(gate.register_forward_hook(keep_router(routers, i)))
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    return LayerTrace(
        outputs=[outputs[i] for i in range(num_layers)],
        router_logits=[routers[i][0] if i in routers else None for i in range(num_layers)],
        chosen=[routers[i][1] if i in routers else None for i in range(num_layers)],
        logits=to_numpy(logits),
    )


def to_numpy(tensor: Any) -> np.ndarray:
    return tensor.detach().float().cpu().numpy()


def keep_output(store: dict[int, np.ndarray], index: int) -> Any:
    def hook(module: Any, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output  # [1, T, H]
        store[index] = to_numpy(hidden).reshape(-1, hidden.shape[-1])

    return hook


def keep_router(store: dict[int, tuple[np.ndarray, np.ndarray]], index: int) -> Any:
    def hook(module: Any, args: Any, output: Any) -> None:
        router_logits, _, chosen = output  # [T, E], [T, k] weights, [T, k] ids
        store[index] = (to_numpy(router_logits), chosen.cpu().numpy().astype(np.int32))

    return hook


def import_torch() -> Any:
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as err:
        raise AtlasError(
            f"atlas.compare needs torch and transformers ({err}); pip install 'atlas[oracle]'"
        ) from None
    return torch


def load_oracle(model_dir: Path, device: str, num_layers: int) -> Any:
    """AutoModelForCausalLM, or the image-text-to-text class for a nested (text_config) config,
    cut to its first `num_layers` layers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    nested = "text_config" in json.loads((Path(model_dir) / "config.json").read_text())
    auto = AutoModelForImageTextToText if nested else AutoModelForCausalLM
    try:
        config = AutoConfig.from_pretrained(model_dir)
        text = config.text_config if nested else config
        if text.num_hidden_layers > num_layers:
            text.num_hidden_layers = num_layers
            text.layer_types = list(text.layer_types[:num_layers])
        with quiet_transformers():  # the cut layers' weights are reported as unexpected
            model = auto.from_pretrained(model_dir, config=config, dtype=torch.float32)
    except Exception as err:  # transformers raises many kinds; the user needs the first line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise AtlasError(
            f"transformers cannot load {model_dir} ({first}); check the checkpoint or --reference"
        ) from None
    return model.to(device).eval()


@contextmanager
def quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)


def decoder_layers(model: Any, num_layers: int) -> list[Any]:
    """The text decoder's layer list (not the vision tower's, not an MTP head's)."""
    import torch

    for name, module in model.named_modules():
        outside_text = any(part in name for part in ("visual", "vision", "mtp"))
        if name.endswith("layers") and isinstance(module, torch.nn.ModuleList) and not outside_text:
            if len(module) == num_layers:
                return list(module)
    raise AtlasError(
        f"no {num_layers}-layer decoder found in the transformers model; is this a qwen3_5_moe checkpoint?"
    )
