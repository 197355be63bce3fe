"""Model families: model_type -> loader that builds the layer stack. A new family is a loader
module and an entry in FAMILIES."""

from __future__ import annotations

from collections.abc import Callable

from ..backends.base import Backend
from ..config import NESTED_MODEL_TYPE, TEXT_MODEL_TYPE, ModelSpec
from ..errors import AtlasError
from ..layers.decoder import CausalLM
from ..safetensors import Checkpoint
from .qwen3_5_moe import check_qwen3_5_moe, load_qwen3_5_moe

LoadModel = Callable[[ModelSpec, Checkpoint, Backend], CausalLM]
CheckModel = Callable[[ModelSpec, Checkpoint], None]

FAMILIES: dict[str, tuple[LoadModel, CheckModel]] = {
    NESTED_MODEL_TYPE: (load_qwen3_5_moe, check_qwen3_5_moe),
    TEXT_MODEL_TYPE: (load_qwen3_5_moe, check_qwen3_5_moe),
}


def _family(spec: ModelSpec) -> tuple[LoadModel, CheckModel]:
    family = FAMILIES.get(spec.model_type)
    if family is None:
        raise AtlasError(
            f"model_type {spec.model_type!r} has no loader; atlas runs {', '.join(sorted(FAMILIES))}"
        )
    return family


def load_model(spec: ModelSpec, checkpoint: Checkpoint, backend: Backend) -> CausalLM:
    return _family(spec)[0](spec, checkpoint, backend)


def check_checkpoint(spec: ModelSpec, checkpoint: Checkpoint) -> None:
    """The checks loading makes before reading any weight (AtlasError naming the first problem)."""
    _family(spec)[1](spec, checkpoint)
