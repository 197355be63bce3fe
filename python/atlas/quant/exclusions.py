"""Which weights the quantizer converts: the matrices of attention, linear attention projections
and experts; never the embeddings, lm_head, norms, router, shared-expert gate, the small
linear-attention parameters, nor the vision tower and MTP head (which the runtime does not read)."""

from __future__ import annotations

from fnmatch import fnmatchcase

from .nvfp4 import GROUP_SIZE

EXCLUDED_MODULES = (
    "lm_head",
    "*embed_tokens",
    "*norm",
    "*.mlp.gate",
    "*.mlp.shared_expert_gate",
    "*.linear_attn.A_log",
    "*.linear_attn.conv1d",
    "*.linear_attn.dt_bias",
    "*.linear_attn.in_proj_a",
    "*.linear_attn.in_proj_b",
    "model.visual*",
    "mtp*",
)


def module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def is_excluded(module: str) -> bool:
    return any(fnmatchcase(module, pattern) for pattern in EXCLUDED_MODULES)


def converts(name: str, shape: tuple[int, ...], method: str) -> bool:
    """True when the quantizer stores this checkpoint tensor in `method`."""
    if method == "bf16" or not name.endswith(".weight") or len(shape) != 2:
        return False
    if method == "nvfp4" and shape[1] % GROUP_SIZE:
        return False
    return not is_excluded(module_of(name))
