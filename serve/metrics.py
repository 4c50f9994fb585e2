"""`GET /metrics`: the server's numbers in Prometheus' text format (prometheus-client), under vLLM's
names, so that a dashboard made for vLLM reads them.

Per request, on the thread that receives the engine's outputs: time to first token, the time
between tokens (a merged output of k tokens counts its gap as k gaps of a k-th each), prompt and
generated tokens, and how it finished (`finished_reason`: stop, length, abort, error). At each
scrape, from the engine: requests running and waiting, the KV cache's use, the prefix cache's
queried and hit tokens.
"""

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .request import Output

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

# Bucket bounds in seconds (vLLM's): first tokens from a few ms to a long prefill behind a queue,
# gaps between tokens from a fast decode step to a stall.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
FINISHED = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()  # the app's own: two apps in one process (tests) do not clash
        labels, r = ["model_name"], self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a place in the batch", labels,
                             registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of the KV cache's blocks in use (1 = full)",
                              labels, registry=r)
        self.finished = Counter("vllm:request_success", "Finished requests, by how they finished",
                                [*labels, "finished_reason"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests (n choices: n times)",
                                     labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", labels, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels,
                                   registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time from a request's arrival to its first token",
                              labels, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between a request's consecutive tokens",
                             labels, buckets=ITL_BUCKETS, registry=r)
        self.model_name = model_name
        # This model's series, looked up once: every generated token observes one (labels() takes a
        # lock and a dict lookup each call, on the thread that hands out every stream's tokens).
        self.ttft_series, self.itl_series = self.ttft.labels(model_name), self.itl.labels(model_name)
        self.generated_series = self.generation_tokens.labels(model_name)
        self._prefix_seen = (0, 0)  # the engine's running totals at the last scrape

    def request(self) -> "RequestClock":
        """The clock of a request that arrives now."""
        return RequestClock(self)

    def render(self, stats: dict) -> bytes:
        """The text of a scrape, with the engine's numbers of now (its /health stats)."""
        m = self.model_name
        self.running.labels(m).set(stats["running"])
        self.waiting.labels(m).set(stats["waiting"])
        self.kv_usage.labels(m).set(1 - stats["free_blocks"] / stats["total_blocks"])
        prefix = stats.get("prefix_cache", {})
        totals = (prefix.get("prompt_tokens", 0), prefix.get("hit_tokens", 0))
        self.prefix_queries.labels(m).inc(max(0, totals[0] - self._prefix_seen[0]))
        self.prefix_hits.labels(m).inc(max(0, totals[1] - self._prefix_seen[1]))
        self._prefix_seen = totals
        return generate_latest(self.registry)


class RequestClock:
    """One request's times, fed each output as it arrives."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.start = self.last = time.monotonic()
        self.first = True

    def output(self, out: Output) -> None:
        m = self.metrics
        now = time.monotonic()
        if out.token_ids:
            if self.first:
                m.ttft_series.observe(now - self.start)
                self.first = False
            else:
                gap = (now - self.last) / len(out.token_ids)
                for _ in out.token_ids:
                    m.itl_series.observe(gap)
            m.generated_series.inc(len(out.token_ids))
            self.last = now
        if out.finish_reason is not None:
            name = m.model_name
            m.finished.labels(name, FINISHED.get(out.finish_reason, out.finish_reason)).inc()
            m.prompt_tokens.labels(name).inc(out.prompt_tokens)
