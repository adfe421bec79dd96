"""`regen status RUN_DIR`: counts from the ledger (committed parts), never from memory, so it is right
during a run and after a SIGKILL. Live figures (tok/s, endpoints) come from status.json."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import orjson
import pyarrow.compute as pc

from ..core.identity import samples_per_prompt
from ..prompts.fileid import file_states
from ..prompts.report import report_lines
from .capture_ledger import capture_counts
from .goodput import Goodput, resumed_goodput, summary_line
from .progress import duration
from .prompt_reader import PendingScan
from .rundir import RunDir, RunLock
from .tool_counts import tool_counts


def ledger_counts(run_dir: RunDir) -> dict[str, Any]:
    """Counted from the prompt set's id column, a row group at a time: the set is never loaded whole. With
    samples_per_prompt k > 1 the counts are of samples (prompts x k), `samples_per_prompt` says k."""
    manifest = run_dir.read_manifest()
    prompts = run_dir.prompt_set_reader(manifest.get("prompt_set_version"))
    committed, failed = run_dir.committed_units(), run_dir.failed_units()
    samples = samples_per_prompt(manifest.get("generation"))
    scan = PendingScan([], 0, 0, 0)
    if prompts is not None:
        scan = prompts.pending(committed, failed, True, 0, listed=False, samples=samples)
    return {
        "samples_per_prompt": samples,
        "total": scan.total,
        "done": scan.done,
        "failed": scan.failed,
        "pending": scan.waiting,
        "rejects": run_dir.rejects_count(),
        "vanished_with_records": pc.count_distinct(committed).as_py() - scan.done,
        "parts": len(run_dir.parts(run_dir.data)),
        # prompts (samples) with images, from the set's `images` column (no image is read); absent: none
        **({"image_prompts": {"total": scan.image_total, "done": scan.image_done, "pending": scan.image_waiting,
                              "failed": scan.image_total - scan.image_done - scan.image_waiting}}
           if scan.image_total else {}),
    }


def run_goodput(run_dir: RunDir, status: dict[str, Any] | None) -> Goodput:
    """The run's goodput over every session: its committed records' counts summed from the records parts' footers
    (committed with them, so a SIGKILL loses none), the tokens thrown away from status.json (store/goodput.py)."""
    return resumed_goodput((part.parquet_file().metadata.metadata for part in run_dir.parts(run_dir.data)), status)


def counts_line(run_dir: RunDir) -> str:
    """The ledger's counts in a line, for the end of a run's log (never raises: the run is ending)."""
    try:
        counts = ledger_counts(run_dir)
    except Exception as exc:  # noqa: BLE001 - a store that cannot be read is named; the run still ends
        return f"counts unavailable ({exc})"
    line = f"{counts['done']} done, {counts['failed']} failed, {counts['pending']} pending of {counts['total']}"
    return line if counts["samples_per_prompt"] == 1 else f"{line} samples ({counts['samples_per_prompt']} a prompt)"


def run_state(run_dir: RunDir, counts: dict[str, Any]) -> str:
    lock = RunLock(run_dir)
    if lock.is_held():
        holder = lock.holder() or {}
        return f"running (pid {holder.get('pid', '?')} on {holder.get('host', '?')})"
    if counts["pending"] == 0 and counts["total"]:
        return "complete"
    last = (run_dir.read_status() or {}).get("state")
    if last == "complete" and counts["pending"]:
        return "stopped"  # the ledger decides: complete once, then more to do (a raised samples_per_prompt)
    return "stopped" if last in (None, "running") else last  # "running" with no lock holder: it was killed


def print_status(path: str | Path, as_json: bool = False) -> int:
    run_dir = RunDir(path)
    if not run_dir.exists():
        print(f"regen: error: {path} is not a run directory (no run.json)", file=sys.stderr)
        return 2
    counts = ledger_counts(run_dir)
    live = run_dir.read_status() or {}
    manifest = run_dir.read_manifest()
    sources = (manifest.get("prompt_report") or {}).get("sources", [])
    files = file_states(manifest.get("source_files") or {})
    state = run_state(run_dir, counts)
    endpoints = live.get("endpoints") or {}
    if not state.startswith("running"):  # a driver killed mid-run left its in-flight work in status.json
        endpoints = {label: {**stats, "in_flight": 0} for label, stats in endpoints.items()}
    report = {"run_dir": str(path), "state": state, **counts,
              "fingerprint": manifest.get("fingerprint"), "sources": sources, "source_files": files,
              "last_update": live.get("updated_at"), "endpoints": endpoints,
              "this_session": live.get("this_session", {}), "rates": live.get("rates", {}),
              "eta_s": live.get("eta_s") if state.startswith("running") else None,
              "metrics_url": live.get("metrics_url") if state.startswith("running") else None,
              "capture": capture_counts(run_dir),
              # counted from the parts, as the card counts: a driver killed after a commit wrote none of it
              "goodput": run_goodput(run_dir, live).as_dict() if counts["parts"] or live.get("goodput") else None,
              "quality_gate": live.get("quality_gate"),
              # each endpoint's concurrency at the end of the earlier sessions (the last one's: `endpoints`)
              "concurrency_sessions": live.get("concurrency_sessions") or []}
    tools = tool_counts(run_dir)
    report["tools"] = tools.as_dict() if tools is not None else None
    if as_json:
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    print(f"{path}: {report['state']}")
    k = counts["samples_per_prompt"]
    unit = "prompts" if k == 1 else "samples"  # the rates count what the totals count
    what = "prompts" if k == 1 else f"samples ({k} per prompt, {counts['total'] // k} prompts)"
    print(f"  {what} {counts['total']}: done {counts['done']}, failed {counts['failed']}, "
          f"pending {counts['pending']}; rejected inputs {counts['rejects']}; parts {counts['parts']}")
    if counts.get("image_prompts"):
        images = counts["image_prompts"]
        print(f"  of them with images {images['total']}: done {images['done']}, failed {images['failed']}, "
              f"pending {images['pending']}")
    for line in report_lines(sources) + [f"  {line}" for line in files]:
        print(line)
    if tools is not None and tools.any():
        print(f"  {tools.summary()}")
    if not sources and counts["total"]:
        print("  (no source report: the prompt set was built by an older regen)")
    session = report["this_session"]
    if session:
        print(f"  {'this' if state.startswith('running') else 'last'} session: {session.get('done', 0)} records, "
              f"{session.get('tok_s', 0)} tok/s, {duration(session.get('elapsed_s'))} "
              f"(status of {report['last_update']})")
    for window, rates in report["rates"].items():
        print(f"  {window} rate: {rates.get('prompts_s', 0):.2f} {unit}/s, {rates.get('tok_s', 0):.0f} tok/s "
              f"(over {duration(rates.get('window_s'))})")
    if state.startswith("running"):
        print(f"  ETA {duration(report['eta_s'])} at the recent rate"
              + (f"; metrics at {report['metrics_url']}" if report["metrics_url"] else ""))
    if report["goodput"]:
        print(f"  {summary_line(report['goodput'])}")
    for finding in (report["quality_gate"] or {}).get("findings", []):
        print(f"  QUALITY GATE ({report['quality_gate']['action']}): {finding['message']}")
    cap = report["capture"]
    if cap:
        print(f"  capture ({cap['route']}, {cap['fingerprint']}): {cap['state']}; {cap['captured']} of "
              f"{cap['capturable']} samples captured ({cap['tokens']} tokens); {cap['failed_prompts']} prompts "
              f"failed; records refused: {cap['refused_no_token_ids']} without token ids, "
              f"{cap['refused_count_mismatch']} whose ids disagree with their counts, "
              f"{cap.get('refused_images', 0)} image prompts (no route captures images)")
        if cap["failed_prompt_ids"]:
            print(f"  capture failed prompts (tried again by the next run): {', '.join(cap['failed_prompt_ids'][:10])}"
                  + (" ..." if len(cap["failed_prompt_ids"]) > 10 else ""))
    if report["endpoints"]:
        print("  endpoints (throughput of the session):")
    for label, stats in report["endpoints"].items():
        # a status.json of an older regen has no session figures per endpoint: "-", not a false 0
        done, prompts_s = stats.get("session_done", "-"), stats.get("session_prompts_s")
        print(f"  {label:<28} {stats.get('state', '?'):<10} on {stats.get('node', '?'):<15} "
              f"in flight {stats.get('in_flight', 0):>4}  {done:>7} done  "
              f"{'-' if prompts_s is None else f'{prompts_s:.2f}':>7} {unit}/s  "
              f"{stats.get('session_tok_s', stats.get('tok_s', 0)):>8} tok/s  errors {stats.get('errors', {})}"
              + _auto(stats))
    return 0


def _auto(stats: dict) -> str:
    """The concurrency of an endpoint: a set number, `auto` or an unset one (a status.json of an older regen says
    nothing of a set number, and no mode for auto): the limit, whether auto drives it, the server's running and
    waiting counts, the batch regen believes and the `concurrency_cap` where it bounds auto below that batch."""
    if stats.get("concurrency") is None:
        return ""
    fixed = not_auto(stats)
    if fixed is not None:
        return f"  {fixed}"
    return (f"  concurrency auto {stats['concurrency']} ({'not set; ' if stats.get('concurrency_unset') else ''}"
            f"server running {count(stats.get('server_running'))}, waiting {count(stats.get('server_waiting'))}, "
            f"batch {stats.get('server_batch')}{capped(stats)})")


def not_auto(stats: dict, ended: bool = False) -> str | None:
    """An endpoint's concurrency where auto does not drive it (a set number; an unset one pinned to 8 or not yet
    decided), as status and the card say it; None where auto drives it (an older status.json: no mode, auto).
    `ended`: of a session that is over (the card), whose undecided endpoint will not decide any more."""
    undecided = "(not set; the server's limits were never read)" if ended else \
        "(not set; auto or 8 once the server's limits are read)"
    said = {"fixed": "(set)", "pinned": "(not set; the server reports no batch)", "deciding": undecided}.get(
        stats.get("concurrency_mode", "auto"))
    return None if said is None else f"concurrency {stats['concurrency']} {said}"


def count(value: Any) -> Any:
    """A count from the server's gauges (floats in the Prometheus text, and in an older status.json): an integer."""
    return round(value) if isinstance(value, float) else value


def capped(stats: dict) -> str:
    """`; capped at 24 by concurrency_cap` where the user's cap bounds auto below the server's batch, else ''."""
    cap, batch = stats.get("concurrency_cap"), stats.get("server_batch")
    return f"; capped at {cap} by concurrency_cap" if cap and batch and cap < batch else ""


# what an earlier session's concurrency keeps in status.json's `concurrency_sessions` (the card reads it)
SESSION_KEYS = ("concurrency", "concurrency_mode", "concurrency_unset", "concurrency_highest", "server_batch",
                "concurrency_cap")
KEPT_SESSIONS = 8


def concurrency_sessions(last: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The concurrency each endpoint ended the earlier sessions at, oldest first, for this session's status.json:
    the last status.json's own list and its endpoints (the session that wrote it). At most the last 8 sessions; a
    session whose endpoints reported no concurrency (killed before its first answer, an older regen) adds none."""
    last = last or {}
    kept = [s for s in last.get("concurrency_sessions") or [] if isinstance(s, dict)]
    endpoints = {label: {k: stats[k] for k in SESSION_KEYS if stats.get(k) is not None}
                 for label, stats in (last.get("endpoints") or {}).items()
                 if isinstance(stats, dict) and stats.get("concurrency") is not None}
    if endpoints:
        kept.append({"ended": last.get("updated_at"), "endpoints": endpoints})
    return kept[-KEPT_SESSIONS:]
