"""GET /metrics: the server's counters in Prometheus' text format (as vLLM's and llama.cpp's
servers expose theirs): requests by outcome, prompt / cached / generated tokens, MTP speculation's
verify passes, drafted and accepted tokens (vLLM's spec_decode counters), histograms of queue
time, time to first token and request time, and the requests waiting and running now."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
OUTCOMES = ("finished", "failed", "cancelled")
SPEC_COUNTERS = {"passes": ("atlas_spec_verify_passes_total", "verify passes of the main model"),
                 "drafted": ("atlas_spec_draft_tokens_total", "tokens the head drafted"),
                 "accepted": ("atlas_spec_accepted_tokens_total", "drafted tokens the main model kept")}


@dataclass
class Histogram:
    name: str
    help: str
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))  # the last: above every bucket
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self.total += seconds

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, count in zip([*map(str, BUCKETS_S), "+Inf"], self.counts, strict=True):
            running += count
            out.append(f'{self.name}_bucket{{le="{bound}"}} {running}')
        return [*out, f"{self.name}_sum {self.total}", f"{self.name}_count {running}"]


@dataclass(frozen=True)
class SpecCounts:
    """One request's MTP speculation (all 0 when it did not speculate)."""

    passes: int = 0  # verify passes of the main model
    drafted: int = 0  # tokens the head proposed
    accepted: int = 0  # of those, the ones the main model kept


@dataclass(frozen=True)
class RequestRecord:
    """One request as the engine thread saw it."""

    outcome: str  # one of OUTCOMES
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    queue_s: float = 0.0
    first_token_s: float | None = None  # from the start of its run; None: no token
    run_s: float = 0.0
    spec: SpecCounts = SpecCounts()


class Metrics:
    """Written by the engine thread, read by /metrics: one lock around both."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = dict.fromkeys(OUTCOMES, 0)
        self.tokens = {"prompt": 0, "cached": 0, "generated": 0}
        self.spec = {"passes": 0, "drafted": 0, "accepted": 0}
        self.queue = Histogram("atlas_queue_seconds", "Time a request waited for the engine.")
        self.first_token = Histogram("atlas_time_to_first_token_seconds", "From the start of a request's run to its first token.")
        self.run = Histogram("atlas_request_run_seconds", "Time the engine spent on a request.")
        self.running = 0
        self.turned_away = 0  # generation requests refused with a 503 (--max-waiting)

    def rejected(self) -> None:
        with self._lock:
            self.turned_away += 1

    def started(self) -> None:
        with self._lock:
            self.running += 1

    def record(self, request: RequestRecord) -> None:
        with self._lock:
            self.running -= 1
            self.requests[request.outcome] += 1
            self.tokens["prompt"] += request.prompt_tokens
            self.tokens["cached"] += request.cached_tokens
            self.tokens["generated"] += request.generated_tokens
            for kind in self.spec:
                self.spec[kind] += getattr(request.spec, kind)
            self.queue.observe(request.queue_s)
            self.run.observe(request.run_s)
            if request.first_token_s is not None:
                self.first_token.observe(request.first_token_s)

    def render(self, waiting: int) -> str:
        with self._lock:
            lines = ["# HELP atlas_requests_total Requests the engine ran, by outcome.", "# TYPE atlas_requests_total counter"]
            lines += [f'atlas_requests_total{{outcome="{k}"}} {v}' for k, v in self.requests.items()]
            lines += ["# HELP atlas_requests_rejected_total Requests turned away busy (503: --max-waiting waiting).",
                      "# TYPE atlas_requests_rejected_total counter", f"atlas_requests_rejected_total {self.turned_away}"]
            for kind, value in self.tokens.items():
                name = f"atlas_{kind}_tokens_total"
                lines += [f"# HELP {name} Tokens: {kind} (cached: prompt tokens the prompt cache held).",
                          f"# TYPE {name} counter", f"{name} {value}"]
            for kind, (name, what) in SPEC_COUNTERS.items():
                lines += [f"# HELP {name} MTP speculation: {what}.", f"# TYPE {name} counter", f"{name} {self.spec[kind]}"]
            for name, value in (("atlas_requests_waiting", waiting), ("atlas_requests_running", self.running)):
                lines += [f"# HELP {name} Requests {name.rsplit('_', 1)[1]} now.", f"# TYPE {name} gauge", f"{name} {value}"]
            for histogram in (self.queue, self.first_token, self.run):
                lines += histogram.lines()
        return "\n".join(lines) + "\n"
