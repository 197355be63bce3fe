"""The GPU op tests' own logic, checked on the CPU (no GPU needed).

test_gpu_ops, test_gpu_moe_shared and test_gpu_delta_chunked run here with the numpy backend
standing in for the CUDA one (bf16 storage rounded as the device stores it, a runtime whose
step calls do nothing). An exact stand-in must pass every one of those tests, and a stand-in whose
float results are 5 % off must fail them: a test that cannot pass, or cannot fail, shows here
instead of costing a device session.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import test_gpu_delta_chunked
import test_gpu_moe_shared
import test_gpu_ops
from atlas.backends.numpy_backend import NumpyBackend
from atlas.targets import load_registry

MODULES = (test_gpu_ops, test_gpu_moe_shared, test_gpu_delta_chunked)
HEAVY = {"test_linear_lm_head"}  # a [V, H] f32 matrix of Qwen3.6's vocabulary: 2 GB on the CPU
OFF_BY = np.float32(1.05)


class HostArray(np.ndarray):
    """A numpy array with the DeviceTensor members the tests use on uploaded tensors."""

    @property
    def ptr(self) -> int:
        return self.ctypes.data

    def rows(self, start: int, stop: int) -> HostArray:
        return self[start:stop]

    def elements(self, start: int, stop: int) -> HostArray:
        return self.reshape(-1)[start:stop]


class StandInRuntime:
    sm_count = 132

    def reset_step(self) -> None:
        pass

    def poison_scratch(self) -> None:
        pass

    def persistent(self, shape: tuple[int, ...], dtype: str) -> HostArray:
        return np.zeros(shape, np.int32 if dtype == "i32" else np.float32).view(HostArray)

    def copy(self, dst: HostArray, src: np.ndarray) -> None:
        dst[...] = src


class StandInBackend(NumpyBackend):
    """The reference backend behind the CUDA backend's test surface; `scale` multiplies every float
    result read back (1 = exact)."""

    def __init__(self, scale: np.float32 = np.float32(1)) -> None:
        super().__init__()
        self.rt = StandInRuntime()
        self.scale = scale

    def upload(self, array: np.ndarray, dtype: str) -> HostArray:
        host = np.array(array, np.int32 if dtype == "i32" else np.float32)
        return (test_gpu_ops.bf16_round(host) if dtype == "bf16" else host).view(HostArray)

    def to_numpy(self, t: Any) -> np.ndarray:
        out = np.array(t)
        return out * self.scale if np.issubdtype(out.dtype, np.floating) else out


def _cases(module: ModuleType) -> Iterator[tuple[Callable[..., None], dict[str, Any]]]:
    """Each test function of the module with each combination of its parametrize marks."""
    for name, test in inspect.getmembers(module, inspect.isfunction):
        if not name.startswith("test_") or test.__module__ != module.__name__:
            continue
        axes = []
        for mark in getattr(test, "pytestmark", []):
            if mark.name == "parametrize":
                names = [n.strip() for n in mark.args[0].split(",")]
                axes.append([dict(zip(names, v if len(names) > 1 else (v,))) for v in mark.args[1]])
        for combo in itertools.product(*axes):
            yield test, {k: v for part in combo for k, v in part.items()}


CASES = [(test, params) for module in MODULES for test, params in _cases(module)]


def _case_id(case: tuple[Callable[..., None], dict[str, Any]]) -> str:
    test, params = case
    return f"{test.__module__}.{test.__name__}[{'-'.join(map(str, params.values()))}]"


def _run(case: tuple[Callable[..., None], dict[str, Any]], backend: StandInBackend, model: str,
         rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    test, params = case
    env = test_gpu_ops.Env(model, backend, dict(load_registry().models[model].constants))
    fixtures = {"env": env, "sampler": env, "rng": rng, "monkeypatch": monkeypatch}  # sampler: env in each draw form
    wanted = inspect.signature(test).parameters
    test(**params, **{name: value for name, value in fixtures.items() if name in wanted})


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_exact_stand_in_passes_the_demo_gpu_tests(case: tuple[Callable[..., None], dict[str, Any]],
                                                  rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(case, StandInBackend(), "atlas-demo", rng, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c[0].__name__ not in HEAVY], ids=_case_id)
def test_exact_stand_in_passes_the_qwen_gpu_tests(case: tuple[Callable[..., None], dict[str, Any]],
                                                  rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(case, StandInBackend(), "qwen3.6-35b-a3b", rng, monkeypatch)


FLOAT_RESULT_TESTS = ("test_attention", "test_gated_delta_rule", "test_causal_conv1d", "test_linear",
                      "test_moe_experts", "test_norms_and_elementwise", "test_head_norm_rope",
                      "test_moe_experts_with_the_shared_slot", "test_chunked_delta_rule_matches_the_reference")


@pytest.mark.parametrize("name", FLOAT_RESULT_TESTS)
def test_stand_in_off_by_five_percent_fails(name: str, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    [case, *_] = [c for c in CASES if c[0].__name__ == name]
    with pytest.raises(AssertionError, match="err"):
        _run(case, StandInBackend(OFF_BY), "atlas-demo", rng, monkeypatch)
