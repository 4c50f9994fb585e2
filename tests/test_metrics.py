"""The server's per-token series (serve/metrics.py) against prometheus-client's own Histogram and
Counter fed the same observations: the same samples in a scrape, bucket by bucket."""

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from serve.metrics import ITL_BUCKETS, TTFT_BUCKETS, Metrics
from serve.request import Output


def samples(text: bytes, names: set[str]) -> dict:
    """{(sample name, le): value} of a scrape, for the samples of the named metrics (no _created)."""
    return {(s.name, s.labels.get("le")): s.value for family in text_string_to_metric_families(text.decode())
            if family.name in names for s in family.samples if not s.name.endswith("_created")}


@pytest.mark.parametrize("seed", [0, 1])
def test_token_series_scrape_as_prometheus_clients_histograms_and_counter(seed):
    rng = random.Random(seed)
    metrics = Metrics("m")
    reference = CollectorRegistry()
    ttft = Histogram("vllm:time_to_first_token_seconds", "", ["model_name"], buckets=TTFT_BUCKETS,
                     registry=reference).labels("m")
    itl = Histogram("vllm:inter_token_latency_seconds", "", ["model_name"], buckets=ITL_BUCKETS,
                    registry=reference).labels("m")
    generated = Counter("vllm:generation_tokens", "", ["model_name"], registry=reference).labels("m")
    # Values on the bounds too: a bucket holds the values up to and including its bound.
    values = [rng.choice(ITL_BUCKETS + TTFT_BUCKETS) if rng.random() < 0.3 else rng.expovariate(20)
              for _ in range(500)]
    for i, value in enumerate(values):
        n = rng.randint(1, 4)  # an output of n merged tokens
        if i % 10 == 0:
            metrics.tokens.ttft.observe(value)
            ttft.observe(value)
        else:
            metrics.tokens.itl.observe(value, n)
            for _ in range(n):
                itl.observe(value)
        metrics.tokens.generated += n
        generated.inc(n)
    names = {"vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:generation_tokens"}
    ours = samples(metrics.render({"running": 0, "waiting": 0, "free_blocks": 1, "total_blocks": 1}), names)
    theirs = samples(generate_latest(reference), names)
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, rel=1e-12), key


def test_a_request_clock_counts_first_tokens_gaps_and_tokens():
    metrics = Metrics("m")
    clock = metrics.request()
    for tokens, reason in (([1], None), ([2, 3, 4], None), ([5], "length")):
        clock.output(Output("x", tokens, reason, 7, 5))
    series = metrics.tokens
    assert sum(series.ttft.counts) == 1 and sum(series.itl.counts) == 4 and series.generated == 5
