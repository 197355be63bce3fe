"""bench/launch_settings.py on a stand-in engine: every setting is set on the backend before it
is timed, the settings take turns round by round, each rate is the median of its rounds, a setting
whose tokens differ is named, and the backend's own setting comes back afterwards."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import launch_settings  # noqa: E402

FORMS = {True: ("fused", "fused", "fused"), False: ("split", "separate", "separate")}


@dataclass
class StandInBackend:
    rt: Any
    router_form: str = "fused"  # the run's own setting: only the router fused (no setting of the bench)
    delta_net_form: str = "separate"
    attention_prep_form: str = "separate"
    norm_form: str = "fused"

    def use_decode_forms(self, router: str, delta_net: str, attention_prep: str, norm: str) -> None:
        self.router_form, self.delta_net_form, self.attention_prep_form = router, delta_net, attention_prep
        self.norm_form = norm


@dataclass
class StandInEngine:
    backend: StandInBackend
    timed: list[str] = field(default_factory=list)
    resets: int = 0

    def reset(self) -> None:
        self.resets += 1

    def setting(self) -> str | None:
        """The bench setting the backend is in now (None: the forms of none, as the run's own)."""
        b = self.backend
        forms = (b.router_form, b.delta_net_form, b.attention_prep_form)
        if forms not in FORMS.values():
            return None
        return launch_settings.Setting(forms == FORMS[True], b.rt.programmatic, b.rt.prefetch, b.norm_form == "fused").name


def make_engine(cc: tuple[int, int], sm: int = 90) -> StandInEngine:
    driver = SimpleNamespace(programmatic=True, binding="cuda-bindings")
    rt = SimpleNamespace(programmatic=False, prefetch=sm >= 90, cc=cc, driver=driver, image=SimpleNamespace(sm=sm))
    return StandInEngine(StandInBackend(rt))


@pytest.mark.parametrize("cc,sm", [((9, 0), 90), ((8, 0), 80), ((9, 0), 80)])
def test_settings_take_turns_and_the_own_setting_comes_back(rng: np.random.Generator, cc: tuple[int, int],
                                                            sm: int) -> None:
    engine = make_engine(cc, sm)
    names = [s.name for s in launch_settings.SETTINGS]
    rates = {name: rng.uniform(100, 500, size=launch_settings.ROUNDS) for name in names}
    differs = str(rng.choice(names[1:]))

    def time_decode(e: StandInEngine, prompt: list[int], tokens: int) -> tuple[float, int]:
        assert e.resets > 0 and tokens == launch_settings.TOKENS
        name = e.setting()
        assert name is not None
        e.timed.append(name)
        return float(rates[name][e.timed.count(name) - 1]), tokens - 1

    def greedy_tokens(e: StandInEngine, prompt: list[int], count: int) -> list[int]:
        return [1] * count if e.setting() == differs else [0] * count

    result = launch_settings.time_settings(engine, [1, 2, 3], time_decode, greedy_tokens)
    ran = [n for n in names if sm >= 90 and cc >= (9, 0) or ("pdl" not in n and "l2" not in n)]
    assert engine.timed == ran * launch_settings.ROUNDS  # round by round, every setting once per round
    for name in names:
        if name in ran:
            assert result[name] == pytest.approx(float(np.median(rates[name])))
        elif cc < (9, 0) and "pdl" in name:
            assert result[name].startswith("not run: compute capability (8, 0)")
        else:
            assert result[name] == "not run: kernels built for sm_80"
    assert result["tokens_differ"] == ([differs] if differs in ran else [])
    b = engine.backend
    assert (b.rt.programmatic, b.rt.prefetch, b.router_form, b.delta_net_form, b.norm_form) == \
        (False, sm >= 90, "fused", "separate", "fused")


def test_sample_forms_take_turns_and_the_own_form_comes_back(rng: np.random.Generator) -> None:
    from atlas.backends.cuda.ops_dense import SAMPLE_FORMS

    engine = make_engine((9, 0))
    engine.backend.sample_form = "split"
    rates = {form: rng.uniform(100, 300, size=launch_settings.ROUNDS) for form in SAMPLE_FORMS}
    seen: list[str] = []
    sampling = object()

    def time_decode(e: StandInEngine, prompt: list[int], tokens: int, how: object) -> tuple[float, int]:
        assert how is sampling
        form = e.backend.sample_form
        seen.append(form)
        return float(rates[form][seen.count(form) - 1]), tokens - 1

    result = launch_settings.time_sample_forms(engine, [1, 2], time_decode, sampling)
    assert seen == list(SAMPLE_FORMS) * launch_settings.ROUNDS
    assert result == {**{f: pytest.approx(float(np.median(r))) for f, r in rates.items()}, "rounds": launch_settings.ROUNDS}
    assert engine.backend.sample_form == "split"


def test_run_ahead_and_in_turn_take_turns_and_the_own_setting_comes_back(rng: np.random.Generator) -> None:
    engine = make_engine((9, 0))
    engine.backend.runs_ahead = own = bool(rng.integers(0, 2))
    rates = {on: rng.uniform(100, 300, size=launch_settings.ROUNDS) for on in (True, False)}
    seen: list[bool] = []

    def time_decode(e: StandInEngine, prompt: list[int], tokens: int) -> tuple[float, int]:
        on = e.backend.runs_ahead
        seen.append(on)
        return float(rates[on][seen.count(on) - 1]), tokens - 1

    result = launch_settings.time_run_ahead(engine, [1, 2], time_decode)
    assert seen == [True, False] * launch_settings.ROUNDS
    assert result == {"ahead": pytest.approx(float(np.median(rates[True]))),
                      "in_turn": pytest.approx(float(np.median(rates[False]))), "rounds": launch_settings.ROUNDS}
    assert engine.backend.runs_ahead is own
    assert launch_settings.run_ahead_line(result).startswith(f"decode tok/s a step ahead {result['ahead']:.1f}, in turn ")


def test_a_failed_side_measure_is_recorded_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    import decode

    def fails() -> dict[str, Any]:
        raise RuntimeError("capture refused")

    assert decode.side_measure("settings", fails, str) == {"error": "RuntimeError: capture refused"}
    assert "capture refused" in capsys.readouterr().err
    assert decode.side_measure("settings", lambda: {"plain": 1.0}, str) == {"plain": 1.0}


def test_a_side_measure_waits_for_budget_left() -> None:
    """With fewer than SIDE_MIN_S seconds left the measure does not start, so the run still writes
    its main numbers inside the stage's time limit."""
    import time

    import decode

    ran: list[int] = []
    now = time.perf_counter()
    skipped = decode.side_measure("settings", lambda: ran.append(1) or {"plain": 1.0}, str,
                                  until=now + decode.SIDE_MIN_S - 5)
    assert ran == [] and skipped["error"].startswith("skipped: ")
    assert decode.side_measure("settings", lambda: ran.append(1) or {"plain": 1.0}, str,
                               until=now + decode.SIDE_MIN_S + 60) == {"plain": 1.0} and ran == [1]
