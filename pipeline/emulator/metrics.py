"""Prometheus text exposition of the emulator's state, with SGLang's metric names and labels."""
from __future__ import annotations

from .state import Histogram, ServerState


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    return repr(float(v))


def render_metrics(state: ServerState) -> str:
    cfg = state.cfg
    labels = f'engine_type="unified",model_name="{cfg.served_model_name}",pp_rank="0",tp_rank="0"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, value: float) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name}{{{labels}}} {_fmt(value)}")

    def histogram(name: str, help_: str, h: Histogram) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} histogram")
        lines.append(f"{name}_sum{{{labels}}} {_fmt(h.sum)}")
        cum = 0
        for le, n in zip(list(h.buckets) + [float("inf")], h.counts):
            cum += n
            lines.append(f'{name}_bucket{{le="{_fmt(le)}",{labels}}} {_fmt(cum)}')
        lines.append(f"{name}_count{{{labels}}} {_fmt(h.count)}")

    spec = cfg.is_speculative
    accept_len = cfg.accept_length if spec else 0.0
    accept_rate = spec_accept_rate(cfg.accept_length, cfg.speculative_num_steps) if spec else 0.0
    running, waiting, usage = state.gauges()
    metric("sglang:num_running_reqs", "gauge", "The number of running requests.", running)
    metric("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", waiting)
    metric("sglang:gen_throughput", "gauge", "The generation throughput (token/s).", state.gen_throughput())
    metric("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.", state.cache_hit_rate)
    metric("sglang:token_usage", "gauge", "The token usage.", usage)
    metric("sglang:spec_accept_length", "gauge", "The average acceptance length of speculative decoding.",
           accept_len)
    metric("sglang:spec_accept_rate", "gauge", "The average acceptance rate of speculative decoding.",
           accept_rate)
    metric("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
           state.prompt_tokens_total)
    metric("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.",
           state.generation_tokens_total)
    metric("sglang:num_retracted_requests_total", "counter", "Total number of retracted requests.", state.batch.retractions if state.batch is not None else 0)
    metric("sglang:num_requests_total", "counter", "Number of requests processed.", state.requests_total)
    histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
              state.e2e)
    histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", state.ttft)
    return "\n".join(lines) + "\n"


def spec_accept_rate(accept_length: float, num_steps: int) -> float:
    """Accepted draft tokens over proposed draft tokens: (accept_length - 1) / steps, clipped to [0, 1]."""
    if num_steps <= 0:
        return 0.0
    return max(0.0, min(1.0, (accept_length - 1.0) / num_steps))
