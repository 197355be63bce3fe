"""GET /metrics: the server's counters in Prometheus' text format (as vLLM's and llama.cpp's
servers expose theirs): requests by outcome, prompt / cached / generated tokens, MTP speculation's
verify passes, drafted and accepted tokens (vLLM's spec_decode counters), histograms of queue
time, time to first token and request time, the requests waiting and running now and the KV cache's
share held. The same numbers go out under vLLM's names too (`vllm:*`, labelled with the served
model_name, vLLM's definitions: latencies counted from arrival), so a dashboard or alert written
for a vLLM server reads an atlas one."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))  # 1 .. 5e6 tokens, vLLM's 1-2-5 steps
OUTCOMES = ("finished", "failed", "cancelled")
SPEC_COUNTERS = {"passes": ("atlas_spec_verify_passes_total", "verify passes of the main model"),
                 "drafted": ("atlas_spec_draft_tokens_total", "tokens the head drafted"),
                 "accepted": ("atlas_spec_accepted_tokens_total", "drafted tokens the main model kept")}


@dataclass
class Histogram:
    name: str
    help: str
    bounds: tuple[float, ...] = BUCKETS_S
    counts: list[int] = field(default_factory=list)  # one per bound, and the last: above every bound
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def lines(self, labels: str = "") -> list[str]:
        """labels: 'k="v"' pairs every sample carries (before le)."""
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running, prefix = 0, f"{labels}," if labels else ""
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            running += count
            out.append(f'{self.name}_bucket{{{prefix}le="{bound}"}} {running}')
        braces = f"{{{labels}}}" if labels else ""
        return [*out, f"{self.name}_sum{braces} {self.total}", f"{self.name}_count{braces} {running}"]


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
    finish_reason: str = "error"  # vLLM's finished_reason: "stop", "length", "abort" (cancelled) or "error"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    queue_s: float = 0.0
    first_token_s: float | None = None  # from the start of its run; None: no token
    run_s: float = 0.0
    spec: SpecCounts = SpecCounts()


VLLM_FINISH_REASONS = ("stop", "length", "abort", "error")
VLLM_HISTOGRAMS = {  # name -> (help, bounds); each observed per request in VllmMetrics.record
    "time_to_first_token_seconds": ("From a request's arrival to its first token.", BUCKETS_S),
    "e2e_request_latency_seconds": ("From a request's arrival to its end.", BUCKETS_S),
    "request_queue_time_seconds": ("Time a request waited for the engine.", BUCKETS_S),
    "request_inference_time_seconds": ("Time the engine ran a request.", BUCKETS_S),
    "request_prefill_time_seconds": ("Time from a run's start to its first token (the prompt's prefill).", BUCKETS_S),
    "request_decode_time_seconds": ("Time from a run's first token to its end.", BUCKETS_S),
    "request_time_per_output_token_seconds": ("A request's decode time over its tokens after the first.", BUCKETS_S),
    "request_prompt_tokens": ("Prompt tokens of a request.", TOKEN_BUCKETS),
    "request_generation_tokens": ("Tokens a request generated.", TOKEN_BUCKETS),
}
VLLM_COUNTERS = {  # name (without _total) -> help
    "prompt_tokens": "Prompt tokens of finished requests.",
    "generation_tokens": "Tokens generated.",
    "prefix_cache_queries": "Prompt tokens looked up in the prompt cache.",
    "prefix_cache_hits": "Prompt tokens the prompt cache held.",
    "spec_decode_num_drafts": "MTP speculation: verify passes of the main model.",
    "spec_decode_num_draft_tokens": "MTP speculation: tokens the head drafted.",
    "spec_decode_num_accepted_tokens": "MTP speculation: drafted tokens the main model kept.",
}


class VllmMetrics:
    """The requests as vLLM's server counts them, under its metric names (kept by Metrics, under
    its lock)."""

    def __init__(self) -> None:
        self.histograms = {name: Histogram(f"vllm:{name}", text, bounds) for name, (text, bounds) in VLLM_HISTOGRAMS.items()}
        self.counters = dict.fromkeys(VLLM_COUNTERS, 0)
        self.success = dict.fromkeys(VLLM_FINISH_REASONS, 0)

    def record(self, request: RequestRecord) -> None:
        self.success[request.finish_reason] += 1
        for name, value in (("prompt_tokens", request.prompt_tokens), ("generation_tokens", request.generated_tokens),
                            ("prefix_cache_queries", request.prompt_tokens), ("prefix_cache_hits", request.cached_tokens),
                            ("spec_decode_num_drafts", request.spec.passes),
                            ("spec_decode_num_draft_tokens", request.spec.drafted),
                            ("spec_decode_num_accepted_tokens", request.spec.accepted)):
            self.counters[name] += value
        observed = {"e2e_request_latency_seconds": request.queue_s + request.run_s,
                    "request_queue_time_seconds": request.queue_s, "request_inference_time_seconds": request.run_s}
        if request.outcome != "failed":
            observed |= {"request_prompt_tokens": request.prompt_tokens,
                         "request_generation_tokens": request.generated_tokens}
        if (first := request.first_token_s) is not None:
            decode = request.run_s - first
            observed |= {"time_to_first_token_seconds": request.queue_s + first, "request_prefill_time_seconds": first,
                         "request_decode_time_seconds": decode}
            if request.generated_tokens > 1:
                observed["request_time_per_output_token_seconds"] = decode / (request.generated_tokens - 1)
        for name, value in observed.items():
            self.histograms[name].observe(value)

    def lines(self, model_name: str, gauges: Gauges) -> list[str]:
        label = f'model_name="{escaped(model_name)}"'
        lines = []
        for name, text, value in (("num_requests_running", "Requests running now.", gauges.running),
                                  ("num_requests_waiting", "Requests waiting now.", gauges.waiting),
                                  ("kv_cache_usage_perc", "KV-cache usage (1 = 100 percent).", gauges.kv_cache_usage)):
            lines += [f"# HELP vllm:{name} {text}", f"# TYPE vllm:{name} gauge", f"vllm:{name}{{{label}}} {value}"]
        for name, text in VLLM_COUNTERS.items():
            lines += [f"# HELP vllm:{name}_total {text}", f"# TYPE vllm:{name}_total counter",
                      f"vllm:{name}_total{{{label}}} {self.counters[name]}"]
        lines += ["# HELP vllm:request_success_total Requests that ended, by how (stop, length, abort, error).",
                  "# TYPE vllm:request_success_total counter"]
        lines += [f'vllm:request_success_total{{{label},finished_reason="{reason}"}} {count}'
                  for reason, count in self.success.items()]
        for histogram in self.histograms.values():
            lines += histogram.lines(label)
        return lines


@dataclass(frozen=True)
class Gauges:
    """What /metrics reads of the server now."""

    waiting: int  # requests queued behind the running one
    running: int
    kv_cache_usage: float  # the share of the KV cache's positions the running request holds


def escaped(value: str) -> str:
    """A Prometheus label value: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


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
        self.vllm = VllmMetrics()

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
            self.vllm.record(request)

    def render(self, waiting: int, model_name: str, kv_cache_usage: float = 0.0) -> str:
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
            lines += self.vllm.lines(model_name, Gauges(waiting, self.running, kv_cache_usage))
        return "\n".join(lines) + "\n"
