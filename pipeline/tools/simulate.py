"""`regen simulate CONFIG --endpoints N --tok-s X`: a dry run of the real pipeline before a two-day run.

It builds the config's real prompt set, takes a content-ranked sample (each prompt with its tools, as the run
sends it: the emulator answers a prompt with tools with calls, as the target does), and runs the real `regen generate`
(same sampling, mode, thinking, flush settings) against N emulated SGLang endpoints decoding at X tok/s per
request, time-compressed by `--speedup`. From the sample it predicts the full run's wall time, tokens and
disk, and it has checked the config end to end (sources, templates, dispatch, commits) on the way.

The prediction assumes the run is throughput-bound (many prompts per endpoint) and that the emulator's
answer lengths stand for the target's; pass `--mean-completion-tokens` to scale to a measured mean.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from ..core.config import load_config
from ..run import build_prompts


@dataclass
class Prediction:
    prompts: int
    sample: int  # samples (units) the simulated run sent: sampled prompts x samples_per_prompt
    sample_wall_s: float  # simulated, compressed time
    wall_s: float
    completion_tokens: int
    disk_bytes: int
    samples_per_prompt: int = 1
    with_tools: int = 0  # of the sampled prompts, those sent with tools
    failed: int = 0  # of the sampled samples, those that failed for good (a refused request: the real run's too)
    failure: str = ""  # the commonest failure's message
    concurrency: str = ""  # per endpoint, as the prediction assumed it: "auto (reaching about 256 ...)" or "16"

    def table(self) -> str:
        k = self.samples_per_prompt
        prompts = self.sample // k  # the sampled prompts (a prompt's k samples are one prompt)
        what = (f"sampled {prompts} of {self.prompts} prompts" if k == 1 else
                f"sampled {prompts} of {self.prompts} prompts ({self.sample} samples, {k} per prompt)")
        if self.with_tools:
            what += f", {self.with_tools} of them sent with their tools"
        failed = []
        if self.failed:
            share = self.failed / max(1, self.sample)
            failed = [f"{self.failed:,} samples failed for good ({share:.0%}; the full run would lose as many, "
                      f"predicted from the rest): the commonest, {self.failure}"]
        return "\n".join([
            f"{what}; the sample ran in {self.sample_wall_s:.1f}s", *failed,
            f"predicted wall time   {self.wall_s / 3600:.2f} h ({self.wall_s:.0f} s)"
            + (f" at concurrency {self.concurrency}" if self.concurrency else ""),
            f"predicted tokens      {self.completion_tokens:,} completion tokens",
            f"predicted disk        {self.disk_bytes / 1e9:.2f} GB",
        ])


def sample_row(prompt) -> dict:
    """A prompt as the run sends it: its messages and, where it has them, its tools (the tool path is simulated)."""
    row: dict = {"messages": list(prompt.messages)}
    if prompt.tools:
        row["tools"] = list(prompt.tools)
    return row


def write_sample(cfg_path: str, sample: int, work: Path) -> tuple[Path, int, object, int, int]:
    """The config's prompt set (sources read for real), a content-ranked sample of it as a JSONL source; returns
    the spec, the set's prompt count, the config, how many prompts were sampled and how many of them have tools."""
    cfg = load_config(cfg_path)
    prompt_set = build_prompts(cfg)
    prompts = sorted(prompt_set.prompts, key=lambda p: p.prompt_id)[:sample]  # prompt_ids are hashes: a fair sample
    data = work / "sample.jsonl"
    data.write_bytes(b"".join(orjson.dumps(sample_row(p)) + b"\n" for p in prompts))
    spec = work / "sample.yaml"
    spec.write_text(yaml.safe_dump({"name": "sample", "kind": "jsonl", "path": str(data), "format": "openai"}))
    return spec, len(prompt_set.prompts), cfg, len(prompts), sum(1 for p in prompts if p.tools)


def simulate(cfg_path: str, endpoints: int, tok_s: float, sample: int = 400, speedup: float = 20.0,
             concurrency: int | str | None = None, mean_completion_tokens: float | None = None,
             knee: int | None = None, batch: int = 256) -> Prediction:
    """`knee`: the real servers' throughput curve (the emulator's --throughput-curve): a decode step costs the
    same up to `knee` requests, then grows with the batch, so a server's tok/s stops growing there; `batch`: its
    max_running_requests (what `concurrency: auto` climbs to). None: every request decodes at tok_s, whatever the
    batch."""
    from ..emulator import start_emulator

    with tempfile.TemporaryDirectory(prefix="regen-simulate-") as tmp:
        work = Path(tmp)
        spec, total, cfg, sampled, with_tools = write_sample(cfg_path, sample, work)
        first = cfg.all_endpoints()[0] if cfg.all_endpoints() else None
        # not set: auto on the emulators, which report their batch (left unset: the run decides it as it would)
        unset = concurrency is None and first is not None and first.auto_by_default
        per_endpoint = concurrency or ("auto" if unset else first.concurrency if first else 64)
        cap = first.concurrency_cap if first else 512
        reach = min(cap, batch) if per_endpoint == "auto" else int(per_endpoint)  # what auto climbs to
        curve = {"throughput_curve": True, "step_ms": 1000.0 / (tok_s * speedup), "knee": knee} if knee else {
            "tok_per_s": tok_s * speedup}
        servers = [start_emulator(preset="kimi", served_model_name=cfg.model, enable_metrics=True,
                                  capacity=batch if per_endpoint == "auto" or knee else reach, **curve)
                   for _ in range(endpoints)]
        try:
            raw = yaml.safe_load(Path(cfg_path).read_text())
            for key in ("endpoints", "endpoints_file", "local_fleet", "ray"):
                raw.pop(key, None)
            raw.update(output_dir=str(work / "out"), run_name="simulated", sources=[{"spec": str(spec)}],
                       endpoints=[{"url": s.url, "concurrency_cap": cap,
                                   **({} if unset else {"concurrency": per_endpoint})} for s in servers])
            if raw.get("tokenizer"):  # the copy lives elsewhere: a tokenizer folder is named whole
                raw["tokenizer"] = cfg.tokenizer_path()
            sim_cfg = work / "config.yaml"
            sim_cfg.write_text(yaml.safe_dump(raw))
            started = time.monotonic()
            result = subprocess.run([sys.executable, "-m", "pipeline", "generate", "--config", str(sim_cfg)],
                                    capture_output=True, text=True, env=os.environ.copy())
            elapsed = time.monotonic() - started
            if result.returncode != 0:
                raise RuntimeError(f"the simulated run failed:\n{result.stderr[-3000:]}")
            run = work / "out" / "simulated"
            parts = sorted((run / "data").glob("part-*.parquet"))
            tokens = sum(sum(pq.read_table(p, columns=["completion_tokens"]).column(0).to_pylist()) for p in parts)
            disk = sum(p.stat().st_size for p in parts)
            failed, failure = _failures(run)
            generating = _generating_seconds(parts)
            answer_tokens = [n for p in parts for n in pq.read_table(p, columns=["completion_tokens"]).column(0)
                             .to_pylist()]
        finally:
            for server in servers:
                server.stop()
    units = total * cfg.samples_per_prompt  # samples_per_prompt: the sample ran k samples of each of its prompts
    sent = sampled * cfg.samples_per_prompt
    scale = units / max(1, sent)  # a sample that failed for good would fail in the full run too: no answer, no disk
    mean_tokens = tokens / max(1, sent)
    stretch = (mean_completion_tokens / mean_tokens) if mean_completion_tokens else 1.0
    startup = max(0.0, elapsed - generating)  # Ray, preflight, the last commit: not compressed
    # The compressed run checked the config end to end and measured the answer lengths; the wall time
    # follows from the work at real speed spread over the fleet's slots (dispatch keeps them >95% busy,
    # see BENCHMARKS.md), and is never shorter than the longest single answer.
    slots = endpoints * (min(reach, knee) if knee else reach)  # past the knee a server's tok/s is flat
    request_s = [n * stretch / tok_s for n in answer_tokens]
    generating_real = max(sum(request_s) * scale / slots, max(request_s, default=0.0))
    disk_total = disk * scale
    return Prediction(prompts=total, sample=sent, sample_wall_s=elapsed, wall_s=startup + generating_real,
                      completion_tokens=int(mean_tokens * stretch * units), disk_bytes=int(disk_total),
                      samples_per_prompt=cfg.samples_per_prompt, with_tools=with_tools, failed=failed,
                      failure=failure, concurrency=concurrency_assumed(per_endpoint, unset, cap, batch, knee))


def concurrency_assumed(per_endpoint: int | str, unset: bool, cap: int, batch: int, knee: int | None) -> str:
    """The concurrency the prediction spread the work over, per endpoint: auto climbs to the servers' batch
    (`--batch`) or `concurrency_cap`, the lower; a number is exact. Past `--knee` a server's tok/s stops growing."""
    if per_endpoint == "auto":
        reach = min(cap, batch)
        why = f"concurrency_cap {cap}" if cap < batch else f"the servers' batch, --batch {batch}"
        text = f"auto{' (not set)' if unset else ''}, reaching about {reach} per endpoint ({why})"
    else:
        reach, text = int(per_endpoint), f"{per_endpoint} per endpoint"
    return text + (f"; tok/s flat past --knee {knee}" if knee and knee < reach else "")


def _failures(run: Path) -> tuple[int, str]:
    """The simulated run's terminal failures and the commonest message (status and text, cut at 160
    characters)."""
    from collections import Counter

    messages: Counter = Counter()
    for part in sorted((run / "failures").glob("part-*.parquet")):
        table = pq.read_table(part, columns=["status", "message"])
        for status, message in zip(table.column("status").to_pylist(), table.column("message").to_pylist()):
            messages[f"{status}: {str(message)[:160]}"] += 1
    if not messages:
        return 0, ""
    top, n = messages.most_common(1)[0]
    return sum(messages.values()), f"{n:,}x {top}"


def _generating_seconds(parts: list[Path]) -> float:
    """From the first request to the last answer, read from the records: the part of the run that the
    time compression applies to (start-up and the final commit are not compressed)."""
    table = pa.concat_tables(pq.read_table(p, columns=["created_at", "latency_s"]) for p in parts)
    created = [c.timestamp() for c in table.column("created_at").to_pylist()]
    first_sent = min(c - latency for c, latency in zip(created, table.column("latency_s").to_pylist()))
    return max(created) - first_sent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="regen simulate", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--endpoints", type=int, required=True, help="emulated endpoints (the real fleet's size)")
    parser.add_argument("--tok-s", type=float, required=True, help="decode tok/s of one request on a real endpoint")
    parser.add_argument("--sample", type=int, default=400, help="prompts to run (content-ranked sample)")
    parser.add_argument("--speedup", type=float, default=20.0, help="time compression of the emulated run")
    parser.add_argument("--concurrency", type=lambda v: v if v == "auto" else int(v), default=None,
                        help="per endpoint, a number or auto (default: the config's)")
    parser.add_argument("--knee", type=int, default=None, help="the real servers' batch past which a decode step "
                        "grows (their tok/s stops growing): the emulators get this throughput curve")
    parser.add_argument("--batch", type=int, default=256, help="with --knee or auto: the servers' max running "
                        "requests")
    parser.add_argument("--mean-completion-tokens", type=float, default=None,
                        help="scale to a measured mean answer length of the target")
    args = parser.parse_args(argv)
    prediction = simulate(args.config, args.endpoints, args.tok_s, args.sample, args.speedup, args.concurrency,
                          args.mean_completion_tokens, args.knee, args.batch)
    print(prediction.table())
    print(emulated_only(args.config, args.endpoints))
    return 0


def emulated_only(config: str, endpoints: int) -> str:
    """What a simulation did not check: the real fleet."""
    cfg = load_config(config)
    real = [e.label for e in cfg.static_endpoints()] + ([f"the endpoints in {cfg.endpoints_file}"]
                                                        if cfg.endpoints_file else [])
    named = ", ".join(real[:4]) + (f" and {len(real) - 4} more" if len(real) > 4 else "")
    return (f"this ran against {endpoints} emulated SGLang endpoint{'s' if endpoints != 1 else ''} on 127.0.0.1, "
            f"serving {cfg.model}: none of the config's real endpoints ({named}) was contacted or checked. "
            f"`regen preflight {config}` checks them (model, weights, context, reasoning parser, the tool-call parser "
            "for prompts with tools, image input for prompts with images, the server's batch) without sending a prompt")
