"""The server's Prometheus metrics (GET /metrics), in a registry of its own.

The engine thread updates them (engine_thread.py): after every step the gauges (requests running and
waiting, KV pages used, free and cached) and the counters that grew (preemptions, prompt and generated
tokens), and the gauges again after it handled requests added or aborted (an abort frees pages without a
step when nothing else runs);
per request its time to first token, the gaps between its tokens (inter-token latency) and its
end-to-end latency, and its prompt tokens served by the prefix cache (the hit rate).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        self.generation_tokens = Counter("tileinfer_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("tileinfer_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tileinfer_inter_token_latency_seconds", "Between a request's consecutive tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tileinfer_e2e_request_latency_seconds", "From a request's arrival to its end",
                             buckets=LATENCY_BUCKETS, registry=r)
        self._preempted = self._generated = 0
        self._prompt = self._cached = 0

    def added(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def gauges(self, engine) -> None:
        """Requests running and waiting, KV pages used, free and cached, read now (engine thread)."""
        s, m = engine.scheduler, engine.scheduler.manager
        self.running.set(len(s.running))
        self.waiting.set(len(s.waiting))
        self.kv_free.set(m.num_free_pages)
        self.kv_used.set(m.num_pages - m.num_free_pages)
        self.kv_cached.set(m.num_cached_pages)

    def after_step(self, engine) -> None:
        """The gauges and the engine's counters, read after a step (engine thread)."""
        self.gauges(engine)
        st = engine.stats
        self.preemptions.inc(st.preemptions - self._preempted)
        self.generation_tokens.inc(st.generated_tokens - self._generated)
        self._preempted, self._generated = st.preemptions, st.generated_tokens

    def finished(self, req) -> None:
        """A request ended (engine thread): its latencies and prefix-cache hits."""
        if req.first_token_time is not None:
            self.ttft.observe(req.first_token_time - req.arrival_time)
        if req.finish_time is not None:
            self.e2e.observe(req.finish_time - req.arrival_time)
        self._prompt += req.num_prompt
        self._cached += req.num_cached_tokens
        self.hit_rate.set(self._cached / self._prompt if self._prompt else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
