"""`/metrics`: Prometheus text (prometheus_client, one registry per server), named as vLLM names them with the
`tpweave:` prefix, so dashboards built for vLLM need only the prefix changed."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tpweave.engine import LLMEngine

# seconds; vLLM's buckets for the same histograms
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)  # fmt: skip


class ServerMetrics:
    """The server's gauges (set by the engine loop after each step), counters and latency histograms (observed by
    the HTTP handlers)."""

    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(f"tpweave:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc, extra=()):
            c = Counter(f"tpweave:{name}", doc, labels + list(extra), registry=r)
            return c if extra else c.labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.free_blocks = gauge("num_free_kv_blocks", "KV-cache blocks on the free list.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated for finished and aborted requests.")
        self._success = counter("request_success", "Requests ended, by finish reason.", ["finished_reason"])
        self.ttft = Histogram("tpweave:time_to_first_token_seconds", "Time to first token (from the request's "
                              "arrival).", labels, buckets=TTFT_BUCKETS, registry=r).labels(model_name)  # fmt: skip
        self.tpot = Histogram("tpweave:time_per_output_token_seconds", "Time per output token after the first.",
                              labels, buckets=TPOT_BUCKETS, registry=r).labels(model_name)  # fmt: skip
        self.model_name = model_name

    def finished(self, reason: str) -> None:
        """Count a request that ended with this finish reason."""
        self._success.labels(self.model_name, reason).inc()

    def on_step(self, engine: LLMEngine) -> None:
        """The gauges from the engine's state after a step."""
        sched = engine.scheduler
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        blocks = sched.blocks
        self.free_blocks.set(blocks.num_free)
        self.kv_usage.set(1.0 - blocks.num_free / blocks.num_blocks if blocks.num_blocks else 0.0)

    def render(self) -> bytes:
        """Every metric in Prometheus' text format."""
        return generate_latest(self.registry)
