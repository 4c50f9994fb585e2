"""`GET /metrics`: the server's numbers in Prometheus' text format (prometheus-client), under vLLM's
names, so that a dashboard made for vLLM reads them.

Per request, on the thread that receives the engine's outputs: time to first token, the time
between tokens (a merged output of k tokens counts its gap as k gaps of a k-th each), prompt and
generated tokens, and how it finished (`finished_reason`: stop, length, abort, error). At each
scrape, from the engine: requests running and waiting, the KV cache's use, the prefix cache's
queried and hit tokens.

The numbers that move with every generated token (the gaps between tokens, the tokens, the first
tokens) are plain counts, read into Prometheus' shapes at each scrape (`TokenSeries`):
prometheus-client's Histogram takes a lock for its sum and one for the bucket at each observation,
its Counter one more, and at hundreds of streams that thread's every microsecond is taken from the
event loop that writes the streams (docs/benchmarks/serve-notes.md).
"""

import time
from bisect import bisect_left
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
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


class Buckets:
    """A histogram's counts: observe is a bisect and two additions. One thread observes (the one
    that receives the outputs); a scrape reads on the event loop, the count derived from the
    buckets so that the two always agree."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += times  # a bucket holds the values <= its bound
        self.sum += value * times

    def family(self, name: str, documentation: str, model_name: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, documentation, labels=["model_name"])
        bounds = [repr(float(b)) for b in self.bounds] + ["+Inf"]  # as prometheus-client writes these (< 1e6)
        family.add_metric([model_name], list(zip(bounds, accumulate(self.counts))), self.sum)
        return family


class TokenSeries:
    """The per-token series (see the module docstring), a collector of the app's registry."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.ttft, self.itl = Buckets(TTFT_BUCKETS), Buckets(ITL_BUCKETS)
        self.generated = 0

    def describe(self):
        """The families a scrape holds: the registry checks their names against the others'."""
        return self.collect()

    def collect(self):
        m = self.model_name
        yield self.ttft.family("vllm:time_to_first_token_seconds", "Time from a request's arrival to its first token",
                               m)
        yield self.itl.family("vllm:inter_token_latency_seconds", "Time between a request's consecutive tokens", m)
        generated = CounterMetricFamily("vllm:generation_tokens", "Generated tokens", labels=["model_name"])
        generated.add_metric([m], self.generated)
        yield generated


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
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels,
                                   registry=r)
        self.tokens = TokenSeries(model_name)
        r.register(self.tokens)
        self.model_name = model_name
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
        n = len(out.token_ids)
        if n:
            now, tokens = time.monotonic(), m.tokens
            if self.first:
                tokens.ttft.observe(now - self.start)
                self.first = False
            else:
                tokens.itl.observe((now - self.last) / n, n)
            tokens.generated += n
            self.last = now
        if out.finish_reason is not None:
            name = m.model_name
            m.finished.labels(name, FINISHED.get(out.finish_reason, out.finish_reason)).inc()
            m.prompt_tokens.labels(name).inc(out.prompt_tokens)
