"""The driver's opt-in Prometheus endpoint (`metrics:` in the run config): progress, rates, each endpoint's state,
in-flight work, request latency and error classes, as fleet operators already watch SGLang and vLLM.

A sink fed by the run: `status` with what status.json holds at each tick, `outcome` with each final outcome.
Its own registry, so two runs in one process never share a series. docs/observability.md names every metric.
"""
from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_wsgi_server

from ..core.config import MetricsServer, RunConfig
from ..core.errors import ConfigError
from ..core.work import DONE, Outcome

log = logging.getLogger("regen.metrics")

ENDPOINT_STATES = ("healthy", "probing", "open", "fatal", "restarting", "draining", "left")
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, float("inf"))


class RunMetrics:
    def __init__(self, run_name: str, model: str, fingerprint: str | None) -> None:
        self.registry = registry = CollectorRegistry()
        self.run = run_name  # every series carries `run`: one Prometheus may scrape several drivers
        Gauge("regen_run_info", "The run this driver serves (value 1)", ["run", "model", "fingerprint"],
              registry=registry).labels(run_name, model, fingerprint or "").set(1)
        self.prompts = Gauge("regen_prompts", "Prompts of the run by state (done, failed, pending, total), "
                             "counted over every session; samples of prompts when regen_samples_per_prompt > 1",
                             ["run", "state"], registry=registry)
        self.samples = Gauge("regen_samples_per_prompt", "samples_per_prompt k: regen_prompts counts samples "
                             "(prompts x k) when k > 1", ["run"], registry=registry)
        self.session = Counter("regen_session_outcomes", "Final outcomes of this session",
                               ["run", "endpoint", "outcome"], registry=registry)
        self.tokens = Counter("regen_completion_tokens", "Completion tokens committed this session, by endpoint",
                              ["run", "endpoint"], registry=registry)
        self.prompt_rate = Gauge("regen_prompts_per_second", "Prompts finished per second over a window "
                                 "(recent: the last five minutes; overall: this session)", ["run", "window"],
                                 registry=registry)
        self.token_rate = Gauge("regen_tokens_per_second", "Completion tokens per second over a window",
                                ["run", "window"], registry=registry)
        self.eta = Gauge("regen_eta_seconds", "Seconds until nothing is pending at the recent rate (-1: unknown)",
                         ["run"], registry=registry)
        self.state = Gauge("regen_endpoint_state", "1 for the endpoint's current state, 0 for the others",
                           ["run", "endpoint", "state"], registry=registry)
        self.in_flight = Gauge("regen_endpoint_in_flight", "Requests the endpoint's actor has in flight",
                               ["run", "endpoint"], registry=registry)
        self.capacity = Gauge("regen_endpoint_capacity", "concurrency auto or not set, per endpoint (what): the "
                              "concurrency, auto (1: auto drives it, 0: not set and pinned, the server reports no "
                              "batch), the server's running and waiting counts and the batch regen believes",
                              ["run", "endpoint", "what"], registry=registry)
        self.latency = Histogram("regen_request_latency_seconds", "Latency of each committed request (one turn)",
                                 ["run", "endpoint"], buckets=LATENCY_BUCKETS, registry=registry)
        self.errors = Counter("regen_endpoint_errors", "Errors by class (retryable, terminal, dropped, "
                              "endpoint_fatal, unexpected, circuit_opened, probe_error, readmission_refused)",
                              ["run", "endpoint", "class"], registry=registry)
        self.requeued = Gauge("regen_requeued", "Work items sent back to the queue this session", ["run"],
                              registry=registry)
        self.generated = Gauge("regen_generated_tokens", "Completion tokens the fleet generated, over every session, "
                               "by what became of them (purpose: training, flagged, truncated_thinking, truncated, "
                               "empty, follows_dropped_or_missing_turn, duplicate, hedge_cancelled (estimated), "
                               "retry, failed; docs/goodput.md)",
                               ["run", "purpose"], registry=registry)
        self.goodput = Gauge("regen_goodput_ratio", "Share of generated tokens that became training data (what the "
                             "default export keeps; -1: nothing generated yet)", ["run"], registry=registry)
        self._errors_seen: dict[str, dict[str, int]] = {}
        self._server: Any = None
        self.url: str | None = None

    # --- the sink -----------------------------------------------------------------------------------
    def outcome(self, outcome: Outcome) -> None:
        ok = outcome.kind == DONE
        self.session.labels(self.run, outcome.endpoint, "done" if ok else "failed").inc()
        if ok:
            self.tokens.labels(self.run, outcome.endpoint).inc(sum(c.completion_tokens for c in outcome.completions))
            for completion in outcome.completions:
                self.latency.labels(self.run, outcome.endpoint).observe(completion.latency_s)

    def status(self, status: dict[str, Any]) -> None:
        for key in ("done", "failed", "pending", "total"):
            self.prompts.labels(self.run, key).set(status.get(key, 0))
        self.samples.labels(self.run).set(status.get("samples_per_prompt", 1))
        for window, rates in (status.get("rates") or {}).items():
            self.prompt_rate.labels(self.run, window).set(rates.get("prompts_s", 0))
            self.token_rate.labels(self.run, window).set(rates.get("tok_s", 0))
        eta = status.get("eta_s")
        self.eta.labels(self.run).set(-1 if eta is None else eta)
        self.requeued.labels(self.run).set(status.get("requeued", 0))
        goodput = status.get("goodput") or {}
        for purpose, tokens in (goodput.get("tokens") or {}).items():
            self.generated.labels(self.run, purpose).set(tokens)
        share = goodput.get("share")
        self.goodput.labels(self.run).set(-1 if share is None else share)
        endpoints = status.get("endpoints") or {}
        for label, stats in endpoints.items():
            self._endpoint(label, stats.get("state", "healthy"), stats.get("in_flight", 0))
            self._count_errors(label, stats.get("errors") or {})
            for what in ("concurrency", "server_running", "server_waiting", "server_batch"):
                if stats.get(what) is not None and stats.get("concurrency_mode") != "fixed":  # auto or unset only
                    self.capacity.labels(self.run, label, what).set(stats[what])
            if stats.get("concurrency_mode") in ("auto", "pinned"):
                self.capacity.labels(self.run, label, "auto").set(stats["concurrency_mode"] == "auto")
        for label in set(self._errors_seen) - set(endpoints):
            self._endpoint(label, "left", 0)

    def _endpoint(self, label: str, state: str, in_flight: int) -> None:
        for known in ENDPOINT_STATES:
            self.state.labels(self.run, label, known).set(1 if known == state else 0)
        self.in_flight.labels(self.run, label).set(in_flight)
        self._errors_seen.setdefault(label, {})

    def _count_errors(self, label: str, errors: dict[str, int]) -> None:
        """An actor counts its errors from its start: a count below the last seen is a new actor's."""
        seen = self._errors_seen.setdefault(label, {})
        for kind, count in errors.items():
            before = seen.get(kind, 0)
            added = count - before if count >= before else count
            if added:
                self.errors.labels(self.run, label, kind).inc(added)
            seen[kind] = count
        for kind in ("retryable", "terminal", "endpoint_fatal"):  # every class is scraped from the start, at 0
            self.errors.labels(self.run, label, kind)

    # --- the server ---------------------------------------------------------------------------------
    def serve(self, where: MetricsServer) -> str:
        self._server, _thread = start_wsgi_server(where.port, addr=where.host, registry=self.registry)
        host, port = self._server.server_address[:2]
        self.url = f"http://{host}:{port}/metrics"
        log.info("metrics: serving %s", self.url)
        return self.url

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def serve_metrics(cfg: RunConfig, fingerprint: str | None) -> RunMetrics | None:
    """The run's /metrics if its config asks for one (`metrics`). A port that cannot be bound is refused with
    the keys to change."""
    if cfg.metrics is None:
        return None
    metrics = RunMetrics(cfg.run_name, cfg.model, fingerprint)
    try:
        metrics.serve(cfg.metrics)
    except OSError as exc:
        raise ConfigError(f"metrics: cannot listen on {cfg.metrics.host}:{cfg.metrics.port} ({exc}); change "
                          "metrics.port or metrics.host") from None
    return metrics
