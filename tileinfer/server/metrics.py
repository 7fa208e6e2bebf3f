"""The server's Prometheus metrics (GET /metrics), in a registry of its own.

The engine process reports after every turn of its loop (events.Report): the gauges (requests running and
waiting, KV pages used, free and cached), its counters (preemptions, prompt tokens added and computed,
tokens generated), the gaps between each request's tokens this turn (inter-token latency), and per request
ended its time to first token, end-to-end latency and prompt tokens served by the prefix cache (the hit
rate). EngineClient hands each Report to `update` on the server's event loop. The handlers observe
http_ttft themselves (app.py): a streamed request's first token as the server sent it, HTTP and the pipes to
the engine process and back included.
"""
from __future__ import annotations

import bisect

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from .events import Report

# Seconds; fine steps below 0.1 s where decode steps and first tokens fall, coarse ones up to a minute.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5, 10, 20, 40, 80)


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("tileinfer_requests_running", "Requests the scheduler is running", registry=r)
        self.waiting = Gauge("tileinfer_requests_waiting", "Requests waiting to be admitted (or readmitted)",
                             registry=r)
        # Every page is used or free; cached pages are free ones the prefix cache still names (block_manager.py).
        self.kv_used = Gauge("tileinfer_kv_pages_used", "KV cache pages held by at least one sequence", registry=r)
        self.kv_free = Gauge("tileinfer_kv_pages_free",
                             "KV cache pages free to allocate, the prefix cache's cached pages included", registry=r)
        self.kv_cached = Gauge("tileinfer_kv_pages_cached",
                               "Free KV cache pages kept for prefix-cache hits (held by no sequence)", registry=r)
        self.hit_rate = Gauge("tileinfer_prefix_cache_hit_rate",
                              "Prompt tokens served by the prefix cache over all prompt tokens, finished requests",
                              registry=r)
        self.preemptions = Counter("tileinfer_preemptions", "Requests preempted (their pages released, recomputed)",
                                   registry=r)
        self.prompt_tokens = Counter("tileinfer_prompt_tokens", "Prompt tokens of the requests added", registry=r)
        self.prompt_tokens_computed = Counter(
            "tileinfer_prompt_tokens_computed",
            "Prompt positions run through the model by prefill steps (the others came from the prefix cache)",
            registry=r)
        self.generation_tokens = Counter("tileinfer_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("tileinfer_time_to_first_token_seconds",
                              "In the engine: from a request's arrival in the engine process to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.http_ttft = Histogram("tileinfer_http_time_to_first_token_seconds",
                                   "Streamed requests: from the HTTP request's arrival at the server to its first "
                                   "chunk with text handed to the connection", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = CountedHistogram("tileinfer_inter_token_latency_seconds", "Between a request's consecutive tokens",
                                    LATENCY_BUCKETS)
        r.register(self.itl)
        self.e2e = Histogram("tileinfer_e2e_request_latency_seconds", "From a request's arrival to its end",
                             buckets=LATENCY_BUCKETS, registry=r)
        self._last: Report | None = None
        self._prompt = self._cached = 0

    def update(self, report: Report) -> None:
        """One turn of the engine loop (on the server's event loop)."""
        self.running.set(report.running)
        self.waiting.set(report.waiting)
        self.kv_used.set(report.kv_used)
        self.kv_free.set(report.kv_free)
        self.kv_cached.set(report.kv_cached)
        last = self._last
        for counter, field in ((self.preemptions, "preemptions"), (self.prompt_tokens, "prompt_tokens"),
                               (self.prompt_tokens_computed, "prompt_tokens_computed"),
                               (self.generation_tokens, "generated_tokens")):
            grew = getattr(report, field) - (getattr(last, field) if last is not None else 0)
            if grew:
                counter.inc(grew)
        self._last = report
        for gap, count in report.itl.items():
            self.itl.observe(gap, count)
        for ttft, e2e, prompt, cached in report.finished:
            if ttft is not None:
                self.ttft.observe(ttft)
            if e2e is not None:
                self.e2e.observe(e2e)
            self._prompt += prompt
            self._cached += cached
        if report.finished:
            self.hit_rate.set(self._cached / self._prompt if self._prompt else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class CountedHistogram:
    """A Prometheus histogram that takes a value with how many times it was seen: a decode step's tokens share
    one gap since the step before, so the engine reports each gap once with its count."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]):
        self.name, self.documentation = name, documentation
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def collect(self):
        cumulative, buckets = 0, []
        for bound, count in zip([*map(floatToGoString, self.bounds), "+Inf"], self.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=self.sum)
