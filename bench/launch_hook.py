"""rt.launch wrapped for the length of a `with` block, so a bench can count, double or time the
launches of an engine's step without touching the runtime."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

Launch = Callable[..., None]  # CudaRuntime.launch(kernel, grid, block, params, smem)
Hook = Callable[[Launch, str, Any, Any, Any, int], None]  # (the real launch, kernel, grid, block, params, smem)


@contextmanager
def launch_hook(rt: Any, hook: Hook) -> Iterator[None]:
    """Every rt.launch inside the block goes through `hook`, which issues it (or not) itself."""
    launch = rt.launch

    def hooked(kernel: str, grid: Any, block: Any, params: Any, smem: int = 0) -> None:
        hook(launch, kernel, grid, block, params, smem)

    rt.launch = hooked
    try:
        yield
    finally:
        del rt.launch  # the class's method again


def step_launches(engine: Any, token: Any, position: int) -> list[tuple[str, Any]]:
    """(kernel, params) of every launch of one eager decode step from `token` (a [1] i32 device
    tensor) at `position`, in order."""
    launches: list[tuple[str, Any]] = []

    def recorded(launch: Launch, name: str, grid: Any, block: Any, params: Any, smem: int = 0) -> None:
        launches.append((name, params))
        launch(name, grid, block, params, smem)

    with launch_hook(engine.backend.rt, recorded):
        engine.eager_decode(token, position)
        engine.backend.rt.synchronize()
    return launches
