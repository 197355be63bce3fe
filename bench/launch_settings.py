"""Greedy decode tok/s under each setting of the decode step: the default or the fused forms of
the decode ops (ATLAS_DELTANET_DECODE, ATLAS_ROUTER, ATLAS_ATTENTION_PREP all fused) x plain or
programmatic dependent launch (ATLAS_LAUNCH) x with or without L2 weight prefetch
(ATLAS_PREFETCH), and the norms taken into their readers (ATLAS_NORM=fused) alone, with pdl and
with the fused forms and pdl, each set on the backend and the decode graph captured again for
it; and sampled decode tok/s under each draw form (ATLAS_SAMPLE); and greedy decode tok/s with
the decode loop a step ahead or in turn (ATLAS_RUN_AHEAD).

Settings take turns over ROUNDS rounds and each rate is the median of its rounds, so a drift of
the device's clocks during the run falls on every setting alike (one run per setting, in separate
processes, put the fused forms and pdl within 2 % of plain either way, 2026-12-04). Each setting's
first CHECK_TOKENS greedy tokens are compared with those of the run's own setting: a kernel that
read its input before griddepcontrol.wait, or a prefetch that changed a result, shows there."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import product
from typing import Any

import numpy as np

ROUNDS = 2
TOKENS = 128  # timed per round and setting
CHECK_TOKENS = 32


@dataclass(frozen=True)
class Setting:
    fused: bool  # the fused DeltaNet decode kernel, router and attention prep
    programmatic: bool  # ATLAS_LAUNCH=pdl
    prefetch: bool  # ATLAS_PREFETCH=l2
    norm: bool = False  # ATLAS_NORM=fused

    @property
    def name(self) -> str:
        flags = (("fused", self.fused), ("norm", self.norm), ("pdl", self.programmatic), ("l2", self.prefetch))
        return "+".join(part for part, on in flags if on) or "plain"

    @property
    def forms(self) -> tuple[str, str, str, str]:
        """use_decode_forms' router, delta_net, attention_prep, norm."""
        fused = ("fused", "fused", "fused") if self.fused else ("split", "separate", "separate")
        return (*fused, "fused" if self.norm else "separate")


SETTINGS = [Setting(*flags) for flags in product((False, True), repeat=3)]  # "plain" first
SETTINGS += [Setting(False, False, False, norm=True), Setting(False, True, False, norm=True),
             Setting(True, True, False, norm=True)]

TimeDecode = Callable[..., tuple[float, int]]  # decode.time_decode(engine, prompt, tokens[, sampling])
GreedyTokens = Callable[[Any, list[int], int], list[int]]  # decode.greedy_tokens


def why_not(rt: Any, setting: Setting) -> str | None:
    """Why this device, binding or kernel tuple cannot run `setting` (None: it can)."""
    from atlas.backends.cuda.runtime import PDL_CC

    if setting.programmatic and (tuple(rt.cc) < PDL_CC or not rt.driver.programmatic):
        return f"not run: compute capability {rt.cc} or the {rt.driver.binding} binding"
    if (setting.programmatic or setting.prefetch) and rt.image.sm < PDL_CC[0] * 10:
        return f"not run: kernels built for sm_{rt.image.sm}"
    return None


def apply(engine: Any, programmatic: bool, prefetch: bool, *forms: str) -> None:
    """The backend decodes with these launch settings and decode forms (router, DeltaNet,
    attention prep, norm) from the next step on: the decode graph is captured again."""
    engine.backend.rt.programmatic, engine.backend.rt.prefetch = programmatic, prefetch
    engine.backend.use_decode_forms(*forms)
    engine.reset()


def use(engine: Any, setting: Setting) -> None:
    apply(engine, setting.programmatic, setting.prefetch, *setting.forms)


def interleaved_medians(names: list[str], use: Callable[[str], None], rate: Callable[[], float]) -> dict[str, float]:
    """name -> the median over ROUNDS rounds of rate() after use(name), the names taking turns."""
    rates: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(ROUNDS):
        for name in names:
            use(name)
            rates[name].append(rate())
    return {name: float(np.median(r)) for name, r in rates.items()}


def time_settings(engine: Any, prompt: list[int], time_decode: TimeDecode, greedy_tokens: GreedyTokens) -> dict[str, Any]:
    """setting name -> median tok/s (or why it did not run), and the settings whose greedy
    tokens differ from the run's own. The backend's own setting is restored afterwards."""
    backend = engine.backend
    saved = (backend.rt.programmatic, backend.rt.prefetch, backend.router_form, backend.delta_net_form,
             backend.attention_prep_form, backend.norm_form)
    skipped = {s.name: why for s in SETTINGS if (why := why_not(backend.rt, s)) is not None}
    by_name = {s.name: s for s in SETTINGS if s.name not in skipped}
    differ: list[str] = []
    try:
        reference = greedy_tokens(engine, prompt, CHECK_TOKENS)
        for setting in by_name.values():
            use(engine, setting)
            if greedy_tokens(engine, prompt, CHECK_TOKENS) != reference:
                differ.append(setting.name)
        rates = interleaved_medians(list(by_name), lambda name: use(engine, by_name[name]),
                                    lambda: time_decode(engine, prompt, TOKENS)[0])
    finally:
        apply(engine, *saved)
    result: dict[str, Any] = {s.name: rates.get(s.name, skipped.get(s.name)) for s in SETTINGS}
    return {**result, "tokens_differ": differ, "tokens_compared": CHECK_TOKENS, "rounds": ROUNDS}


def time_sample_forms(engine: Any, prompt: list[int], time_decode: TimeDecode, sampling: Any) -> dict[str, Any]:
    """Sampled decode tok/s (`sampling`) per ATLAS_SAMPLE form, the median of ROUNDS interleaved
    runs of TOKENS; the draw runs outside the decode graph, so a form needs no capture."""
    from atlas.backends.cuda.ops_dense import SAMPLE_FORMS

    backend = engine.backend
    own = backend.sample_form
    try:
        rates = interleaved_medians(list(SAMPLE_FORMS), lambda form: setattr(backend, "sample_form", form),
                                    lambda: time_decode(engine, prompt, TOKENS, sampling)[0])
    finally:
        backend.sample_form = own
    return {**rates, "rounds": ROUNDS}


def time_run_ahead(engine: Any, prompt: list[int], time_decode: TimeDecode) -> dict[str, Any]:
    """Greedy decode tok/s with the decode loop a step ahead ("ahead": step N+1 queued before token N
    is read) and in turn ("in_turn", ATLAS_RUN_AHEAD=0), the median of ROUNDS interleaved runs."""
    backend = engine.backend
    own = backend.runs_ahead
    try:
        rates = interleaved_medians(["ahead", "in_turn"], lambda name: setattr(backend, "runs_ahead", name == "ahead"),
                                    lambda: time_decode(engine, prompt, TOKENS)[0])
    finally:
        backend.runs_ahead = own
    return {**rates, "rounds": ROUNDS}


def run_ahead_line(result: dict[str, Any]) -> str:
    return (f"decode tok/s a step ahead {result['ahead']:.1f}, in turn {result['in_turn']:.1f} "
            f"(median of {result['rounds']} interleaved rounds)")


def summary_line(result: dict[str, Any]) -> str:
    rates = ", ".join(f"{s.name} {result[s.name]:.1f}" for s in SETTINGS if isinstance(result.get(s.name), float))
    differ = result["tokens_differ"]
    same = f"tokens differ: {', '.join(differ)}" if differ else "tokens equal"
    return f"decode tok/s by setting (median of {result['rounds']} interleaved rounds): {rates}; {same}"
