"""The table `regen preflight` prints: one line per endpoint, then each problem and warning in words.

    endpoint         status       model                 weights  context  reasoning  tool calls  server         images
    127.0.0.1:30001  ok           moonshotai/Kimi-K2.5  default  262144   kimi_k2    kimi_k2     sglang 0.5.23  yes
    127.0.0.1:30002  REFUSED      moonshotai/Kimi-K2.5  default  262144   none       kimi_k2     sglang 0.5.23  yes
    127.0.0.1:30003  unreachable  -                     -        -        -          -           -              -
      127.0.0.1:30002: thinking is requested (chat_template_kwargs thinking: true) but the server splits no
        reasoning out: ... Launch the server with --reasoning-parser kimi_k2
      127.0.0.1:30003: unreachable (warning; it gets work once it answers): no answer (/v1/models: ...)

The server column names the engine and version the preflight identified (sglang, vllm, llamacpp; `not SGLang`
for an unidentified one), and `n/a` marks where the SGLang-only checks were skipped. The images column says whether
the endpoint takes image parts: SGLang's /model_info says it, llama.cpp never does, and any other server is asked
only for a prompt set with images (the tiny image probe); `?` where nothing was asked. `reasoning` and `tool calls`
are the server's reasoning and tool-call parsers (SGLang reports both; `none`: launched without one); on another
engine the tool-call column says what the tiny tool probe found (`took tools`, `refused tools`), asked only for a
prompt set with tools. The batch column is the endpoint's concurrency over the requests the server batches at once
(`64/512 (12%)`; `?`: it does not say).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.config import RunConfig
    from .probes import EndpointReport

HEADER = ("endpoint", "status", "model", "weights", "context", "reasoning", "tool calls", "server", "batch", "images")


def _model(r: "EndpointReport", cfg: "RunConfig") -> str:
    if not r.models:
        return "-"
    name = cfg.model if cfg.model in r.models else ",".join(r.models)
    if r.model_path and r.model_path != name:
        name += f" ({r.model_path})"
    return name


def _row(r: "EndpointReport", cfg: "RunConfig") -> tuple[str, ...]:
    answered = bool(r.models) or r.sglang is not None
    if not answered:
        return (r.label, r.status) + ("-",) * (len(HEADER) - 2)
    not_sglang = r.sglang is False
    parser = "n/a" if not_sglang else ((r.reasoning_parser or "none") if r.sglang else "?")
    tool_parser = r.tool_call_parser or "?"
    if r.engine is not None and r.engine.engine != "openai":
        server = r.engine.describe()
    else:
        server = "not SGLang" if not_sglang else ("sglang" if r.sglang else "?")
    weights = r.weight_version or ("n/a" if not_sglang else "?")
    takes = r.images if r.images is not None else (False if r.engine is not None and r.engine.takes_images is False
                                                    else None)
    images = "?" if takes is None else ("yes" if takes else "no")
    return (r.label, r.status, _model(r, cfg), weights,
            str(r.context) if r.context is not None else "?", parser, tool_parser, server, _batch(r, cfg), images)


def _batch(r: "EndpointReport", cfg: "RunConfig") -> str:
    """The configured concurrency over the server's batch (capacity.py)."""
    from .capacity import batch_cell, shown_concurrency
    e = next((e for e in cfg.all_endpoints() if e.label == r.label), None)
    return batch_cell(shown_concurrency(e, r.limits) if e is not None else "?", r.limits)


def render_table(reports: list["EndpointReport"], cfg: "RunConfig", fleet_problems: list[str] = ()) -> str:
    rows = [HEADER] + [_row(r, cfg) for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    for r in reports:
        for p in r.problems:
            lines.append(f"  {r.label}: {p}")
        if not r.reachable and r.down_reason and not r.problems:
            lines.append(f"  {r.label}: unreachable (warning; it gets work once it answers): {r.down_reason}")
        for w in r.warnings:
            lines.append(f"  {r.label}: warning: {w}")
    for p in fleet_problems:
        lines.append(f"  fleet: {p}")
    return "\n".join(lines)
