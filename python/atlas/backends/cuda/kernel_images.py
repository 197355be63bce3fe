"""The compiled kernel modules of the installed wheel (atlas._kernels, via atlas.kernels)."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import AtlasError
from .runtime import KernelImage


@dataclass(frozen=True, order=True)
class TupleKey:
    hw: str
    model: str
    quant: str

    def __str__(self) -> str:
        return f"{self.hw}/{self.model}/{self.quant}"


def installed_tuples() -> list[TupleKey]:
    """The (hw, model, quant) tuples the installed wheel holds; [] for a CPU-only wheel."""
    from ... import kernels

    return sorted(TupleKey(t.hw, t.model, t.quant) for t in kernels.tuples())


def load_image(key: TupleKey, kind: str) -> KernelImage:
    """The tuple's cubin (kind "cubin") or PTX (kind "ptx") bytes."""
    from ... import kernels

    read = kernels.cubin if kind == "cubin" else kernels.ptx
    try:
        data = read(key.hw, key.model, key.quant)
    except KeyError as err:
        raise AtlasError(f"the installed wheel lacks {key} ({err}); rebuild the wheel") from None
    if not data:
        raise AtlasError(f"the installed wheel's {key} has no {kind}; rebuild the wheel")
    from ...targets import load_registry

    return KernelImage(label=f"{key} ({kind})", data=bytes(data), kind=kind, sm=load_registry().hardware[key.hw].sm)
