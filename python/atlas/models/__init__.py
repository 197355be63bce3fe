"""Model families: model_type -> loader that builds the layer stack. A new family is a loader
module and an entry in FAMILIES."""

from __future__ import annotations

from collections.abc import Callable

from ..backends.base import Backend
from ..config import NESTED_MODEL_TYPE, TEXT_MODEL_TYPE, ModelSpec
from ..errors import AtlasError
from ..layers.decoder import CausalLM
from ..safetensors import Checkpoint
from .qwen3_5_moe import load_qwen3_5_moe

LoadModel = Callable[[ModelSpec, Checkpoint, Backend], CausalLM]

FAMILIES: dict[str, LoadModel] = {
    NESTED_MODEL_TYPE: load_qwen3_5_moe,
    TEXT_MODEL_TYPE: load_qwen3_5_moe,
}


def load_model(spec: ModelSpec, checkpoint: Checkpoint, backend: Backend) -> CausalLM:
    family = FAMILIES.get(spec.model_type)
    if family is None:
        raise AtlasError(
            f"model_type {spec.model_type!r} has no loader; atlas runs {', '.join(sorted(FAMILIES))}"
        )
    return family(spec, checkpoint, backend)
