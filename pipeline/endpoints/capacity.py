"""What a server batches and how full it is: its limits (read once by the preflight, again on recovery) and its
gauges (read by `concurrency: auto` while the run goes), for SGLang and vLLM.

- SGLang (0.5.14 to 0.5.23, the same fields): `/server_info` has the launch argument `max_running_requests`
  (usually null), the effective limit `internal_states[i].effective_max_running_requests_per_dp` (times `dp_size`),
  `max_total_num_tokens` (the KV pool) and `max_queued_requests`. `/metrics` (only with --enable-metrics):
  `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`, `sglang:num_retracted_requests_total`.
- vLLM 0.32: `max_num_seqs` only through the dev-mode `/server_info?config_format=json`
  (`vllm_config.scheduler_config.max_num_seqs`, the pool `cache_config.num_gpu_blocks * block_size`); `/metrics`
  always: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`.
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any

from ..core.errors import EndpointDown

FAR_BELOW = 0.5   # the preflight warns when the concurrency is below this share of the server's batch


@dataclass(frozen=True)
class Limits:
    max_running: int | None = None      # requests the server batches at once (all its data-parallel ranks)
    max_queued: int | None = None       # its waiting queue's bound (past it: 503)
    pool_tokens: int | None = None      # its KV pool in tokens

    def ceiling(self, cap: int) -> int:
        """The most requests worth keeping in flight: the batch plus a headroom, never past its queue's bound."""
        top = cap
        if self.max_running:
            top = min(top, self.max_running + headroom(self.max_running))
            if self.max_queued is not None:
                top = min(top, self.max_running + max(0, self.max_queued - 1))
        return max(1, top)


@dataclass(frozen=True)
class Gauges:
    running: float
    waiting: float
    retracted_total: float | None = None
    at: float = 0.0                     # when it was read (the reader's monotonic clock)


def headroom(batch: int) -> int:
    """Requests beyond the batch that keep it full while the next one travels: 5%, at least 2."""
    return max(2, batch // 20)


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


def _dict(v: Any) -> dict:
    return v if isinstance(v, dict) else {}


def sglang_limits(info: dict) -> Limits:
    """Empty Limits (no batch reported) where a field has another shape than SGLang's."""
    states = info.get("internal_states")
    per_dp = [_int(s.get("effective_max_running_requests_per_dp"))
              for s in (states if isinstance(states, list) else []) if isinstance(s, dict)]
    per_dp = [p for p in per_dp if p]
    dp = _int(info.get("dp_size")) or 1
    running = per_dp[0] * dp if per_dp else _int(info.get("max_running_requests"))
    queued = info.get("max_queued_requests")
    return Limits(running, queued if isinstance(queued, int) and not isinstance(queued, bool) and queued >= 0
                  else None, _int(info.get("max_total_num_tokens")))


def vllm_limits(info: dict) -> Limits:
    cfg = info.get("vllm_config")
    if not isinstance(cfg, dict):
        return Limits()
    sched, cache = _dict(cfg.get("scheduler_config")), _dict(cfg.get("cache_config"))
    blocks, size = _int(cache.get("num_gpu_blocks")), _int(cache.get("block_size"))
    return Limits(_int(sched.get("max_num_seqs")), None, blocks * size if blocks and size else None)


# a reading to take again: the server busy or a gateway before it timing out or limiting the rate
_READ_AGAIN = (408, 429)


async def read_limits(client: Any, engine: str) -> Limits | None:
    """The server's limits, empty Limits where it answers without them (no dev mode, another engine), None where
    it could not be asked (down, a 5xx, 408, 429): a reading to take again, never "no limits"."""
    path = {"sglang": "/server_info", "vllm": "/server_info?config_format=json"}.get(engine)
    if path is None:
        return Limits()
    try:
        status, body = await client.get_json(path, timeout_s=10.0)
        if status == 404 and engine == "sglang":
            status, body = await client.get_json("/get_server_info", timeout_s=10.0)
    except EndpointDown:
        return None
    if status >= 500 or status in _READ_AGAIN:
        return None
    if status != 200 or not isinstance(body, dict):
        return Limits()
    return sglang_limits(body) if engine == "sglang" else vllm_limits(body)


async def server_limits(client: Any, engine: str, sglang_info: dict | None) -> Limits:
    """The preflight's reading: SGLang's from the /server_info it has already read, vLLM's from its dev mode."""
    if engine == "sglang" and isinstance(sglang_info, dict):
        return sglang_limits(sglang_info)
    return (await read_limits(client, engine) or Limits()) if engine == "vllm" else Limits()


def batch_cell(concurrency: int | str, limits: Limits | None) -> str:
    """The preflight table's `batch` column: "64/512 (12%)", "auto/512", "8/?" where the server does not say."""
    if limits is None or not limits.max_running:
        return f"{concurrency}/?"
    if concurrency == "auto":
        return f"auto/{limits.max_running}"
    return f"{concurrency}/{limits.max_running} ({min(1.0, int(concurrency) / limits.max_running):.0%})"


_RUNNING = ("sglang:num_running_reqs", "vllm:num_requests_running")
_WAITING = ("sglang:num_queue_reqs", "vllm:num_requests_waiting")
_RETRACTED = ("sglang:num_retracted_requests_total",)


def parse_gauges(text: str, at: float) -> Gauges | None:
    """Running, waiting (summed over the series: data-parallel ranks) and retractions from Prometheus text."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _RUNNING or name in _WAITING or name in _RETRACTED:
            try:
                value = float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
            if math.isfinite(value):  # Prometheus text may say NaN or +Inf: no count of requests
                sums[name] = sums.get(name, 0.0) + value
    running = next((sums[n] for n in _RUNNING if n in sums), None)
    waiting = next((sums[n] for n in _WAITING if n in sums), None)
    if running is None or waiting is None:
        return None
    return Gauges(running, waiting, next((sums[n] for n in _RETRACTED if n in sums), None), at)


def capacity_line(concurrency: int | str, limits: Limits) -> str:
    """The preflight's per-endpoint comparison: "concurrency 64, the server batches up to 512: at most 12% of its
    batch"."""
    if not limits.max_running:
        return f"concurrency {concurrency}, the server does not report its batch"
    if concurrency == "auto":
        return f"concurrency auto, the server batches up to {limits.max_running}"
    share = min(1.0, int(concurrency) / limits.max_running)
    return (f"concurrency {concurrency}, the server batches up to {limits.max_running}: at most {share:.0%} of "
            "its batch")


def far_below(concurrency: int | str, limits: Limits) -> bool:
    return concurrency != "auto" and bool(limits.max_running) and int(concurrency) < FAR_BELOW * limits.max_running


def shown_concurrency(endpoint: Any, limits: Limits | None) -> int | str:
    """The concurrency an endpoint will run at, as the preflight says it: `auto` where it is not set and the
    server reports its batch (config_sections.Endpoint.auto_by_default), else the configured value."""
    if getattr(endpoint, "auto_by_default", False) and limits is not None and limits.max_running is not None:
        return "auto"
    return endpoint.concurrency
