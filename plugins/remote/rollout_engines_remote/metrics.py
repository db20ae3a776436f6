"""Prometheus metrics of one server (a registry per app, so several apps can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rollout_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.latency = Histogram("rollout_request_seconds", "HTTP request latency by endpoint", ["endpoint"], registry=r,
                                 buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
        self.in_flight = Gauge("rollout_requests_in_flight", "HTTP requests being served", registry=r)
        self.prompt_tokens = Counter("rollout_prompt_tokens", "Prompt tokens of served generations", registry=r)
        self.generated_tokens = Counter("rollout_generated_tokens", "Tokens generated", registry=r)
        self.completions = Counter("rollout_completions", "Completions returned", ["finish_reason"], registry=r)
        self.weight_version = Gauge("rollout_weight_version", "Weight version being served", registry=r)
        self.weight_updates = Counter("rollout_weight_updates", "Weight updates by result", ["result"], registry=r)
        self.weight_bytes = Counter("rollout_weight_bytes", "Bytes received over the http transport", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
