"""`regen capture RUN --config capture.yaml`: the hidden states of a run's committed records, in RUN/capture/.

A prefill-only pass over prompt + completion ids, after generation (or beside it, on what it has committed), so
the generation fleet keeps its prefix cache. Layout of RUN/capture/:
    capture.json        identity: fingerprint (route, model, layers, dtype) and the layout (hidden/layout.py)
    run.lock, lock.json the capture's own lock (generation's lock is never taken)
    data/part-*.parquet the ledger: one row per captured sample (schema.CAPTURE), committed by this driver
    hidden/part-*.parquet  the states, bf16 [T, K*H], committed by the actors before the ledger rows naming them
    status.json         progress (`regen status RUN` counts from the ledger)
Exactly once: a prompt's samples are committed together; a prompt in the ledger is never captured again; hidden
parts no ledger row names (a kill between the two commits) are removed at every start.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from .core.capture_config import CaptureConfig, load_capture_config
from .core.errors import ConfigError, DriftError
from .core.work import record_unit
from .export.formats import turn_id
from .hidden.layout import capture_fingerprint
from .hidden.parts import remove_garbage_hidden_parts
from .hidden.routes import identity_for, layout_for, legacy_weights_digests
from .dispatch.stopping import StopFlag, setup_logging
from .run import EXIT_INTERRUPTED
from .store import schema
from .store.capture_ledger import (CaptureDir, capture_run_dir, count_mismatch, has_part_messages, holds_image,
                                   is_truncated, record_token_ids)
from .store.committer import Committer, signals_deferred
from .store.rundir import RunDir, RunLock, now_utc
from .store.untouched import Untouched

log = logging.getLogger("regen")


CAPTURE_ADVICE = ("Free space on that disk, copy the run to a disk with room and capture there, or capture a "
                  "subset (a run copy with fewer parts)")


CAPTURE_DRIFT_ADVICE = ("A capture keeps its route, model (config and weight files), layers and dtypes: restore "
                        "them to resume, or capture into another copy of the run (or delete RUN/capture to start "
                        "the capture over).")


@dataclass
class CaptureOptions:
    run_dir: str
    config: str
    force: bool = False  # start even if the estimated size exceeds the free space


# Why an image record is refused, per route: the states of an image prompt depend on its pixels, which no route
# sends; captured from its ids alone they would not be the target's states (never done, each record counted).
IMAGE_REFUSALS = {
    "transformers": ("route transformers feeds the model token ids only: an image prompt's ids hold the image's "
                     "placeholder tokens, not its pixels"),
    "vllm": ("route vllm sends token ids to /v1/completions, which carries no image; the prompt ids of an image "
             "record, with the image's placeholder tokens expanded, would be captured without the pixels"),
}


@dataclass
class Pending:
    prompts: list[list[Any]] = field(default_factory=list)  # each: the Samples of one prompt
    no_token_ids: int = 0  # records refused: the server gave no token ids (llama.cpp)
    count_mismatch: int = 0  # records refused: their ids disagree with their own token counts
    images: int = 0  # records refused: image prompts (IMAGE_REFUSALS)
    tokens: int = 0


def open_capture(run: RunDir, cfg: CaptureConfig) -> tuple[CaptureDir, dict[str, Any]]:
    """RUN/capture with its capture.json: created, or checked against this config (drift is refused)."""
    cap = capture_run_dir(run)
    for sub in (cap.data, cap.path / "hidden", cap.logs):
        sub.mkdir()
    for tmp in cap.cleanup_temp():
        log.info("removed uncommitted temporary file %s", tmp.name)
    layout = layout_for(cfg)
    identity = identity_for(cfg)
    warn_if_other_model(cfg, run.read_manifest())
    compute_dtype = cfg.torch_dtype if cfg.route == "transformers" else None  # route vllm: the server's dtype
    fingerprint = capture_fingerprint(cfg.route, layout, identity, compute_dtype)
    manifest = {"fingerprint": fingerprint, "route": cfg.route, "layout": layout.as_dict(),
                "model_identity": identity, "compute_dtype": compute_dtype,
                "run_fingerprint": run.read_manifest().get("fingerprint")}
    if cap.exists():
        before = upgraded_identity(cap, cap.read_manifest(), cfg, layout, identity, compute_dtype)
        if before.get("fingerprint") != fingerprint:
            diff = [f"{key}: {before.get(key)!r} -> {manifest[key]!r}" for key in ("route", "compute_dtype")
                    if before.get(key) != manifest[key]]
            old, new = before.get("layout", {}), manifest["layout"]
            diff += [f"layout.{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in
                     ("model", "num_layers", "hidden_size", "aux_layer_ids", "dtype") if old.get(key) != new.get(key)]
            old, new = before.get("model_identity", {}), identity
            diff += [f"model_identity.{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in
                     sorted(set(old) | set(new)) if old.get(key) != new.get(key)]
            raise DriftError(str(cap.path), diff + [f"fingerprint: {before.get('fingerprint')} -> {fingerprint}"],
                             CAPTURE_DRIFT_ADVICE)
        return cap, before
    cap.write_manifest({**manifest, "created_at": now_utc().isoformat(timespec="seconds")})
    return cap, cap.read_manifest()


def upgraded_identity(cap: CaptureDir, before: dict[str, Any], cfg: CaptureConfig, layout, identity: dict[str, Any],
                      compute_dtype: str | None) -> dict[str, Any]:
    """capture.json with an older identity_version whose digest, recomputed the older way, is this folder's: the
    same untouched model, so its identity is rewritten in the current form (atomically, logged). Otherwise as it is."""
    old = before.get("model_identity") or {}
    version = old.get("identity_version")
    if version == identity.get("identity_version"):
        return before
    how = ("weights", "identity_version", "weights_identity")
    if {k: v for k, v in old.items() if k not in how} != {k: v for k, v in identity.items() if k not in how}:
        return before  # more than the digest differs: drift, named as it is
    if before.get("fingerprint") != capture_fingerprint(cfg.route, layout, old, compute_dtype):
        return before  # the route, layout or dtype differ too: drift
    if "weights" in old and old["weights"] not in legacy_weights_digests(cfg.model, version):
        return before  # a hub model has no digest: its revision, compared above, is its identity
    upgraded = {**before, "model_identity": identity,
                "fingerprint": capture_fingerprint(cfg.route, layout, identity, compute_dtype),
                "upgraded_from": {"identity_version": version, "fingerprint": before.get("fingerprint")}}
    cap.write_manifest(upgraded)
    log.info("capture.json: model identity upgraded from version %s to %s (the same weight files; fingerprint %s -> "
             "%s)", version, identity["identity_version"], before.get("fingerprint"), upgraded["fingerprint"])
    return cap.read_manifest()


def _model_name(model: str | None) -> str:
    return (model or "").rstrip("/").rsplit("/", 1)[-1].lower()


def warn_if_other_model(cfg: CaptureConfig, run_manifest: dict[str, Any]) -> None:
    """run.json's generation.model is a served name, not an identity, so a differing name is a warning: the states
    are the capture model's, and a draft trained on them is a draft for that model."""
    generated_by = (run_manifest.get("generation") or {}).get("model")
    names = {_model_name(cfg.model)} | ({_model_name(cfg.vllm.model)} if cfg.vllm and cfg.vllm.model else set())
    if generated_by and _model_name(generated_by) not in names:
        log.warning("the capture model %s is not, by name, the model that generated this run's records (run.json "
                    "generation.model: %s); the states and the draft trained on them are %s's", cfg.model,
                    generated_by, cfg.model)


def pending_samples(run: RunDir, done: set[str], refused: set[tuple[str, int]], sample_factory,
                    settled: set[str] | None = None, route: str = "transformers") -> Pending:
    """The committed records' samples whose prompt is not captured yet, grouped by prompt. A record without
    token ids, or whose ids disagree with its own prompt_tokens / completion_tokens, is refused (added to
    `refused`, named), as the token exports drop it; its prompt's other turns are captured (an all_turns
    conversation is never split across parts, so no turn of it comes later). An image record is refused too
    (IMAGE_REFUSALS[route]), named. `settled`: the parts with nothing left to capture, skipped by the next listing
    (a follow capture polls); this listing adds to it."""
    out = Pending()
    settled = set() if settled is None else settled
    by_prompt: dict[str, dict[int, Any]] = {}
    for part in RunDir.parts(run.data):
        if str(part) in settled:
            continue
        # a sample of a prompt (samples_per_prompt) is captured as a prompt of its own, under its unit id
        unit_columns = ["prompt_id"] + (["sample_index"] if "sample_index" in part.parquet_schema().names else [])
        if done.issuperset(map(record_unit, part.read_parquet(columns=unit_columns).to_pylist())):
            settled.add(str(part))  # read its ids no more
            continue
        left = False
        parts_column = ["messages"] if has_part_messages(part.parquet_schema()) else []
        for rec in part.read_parquet(columns=[*unit_columns, "turn_index", "prompt_token_ids", "output_token_ids",
                                              "prompt_tokens", "completion_tokens", "finish_reason",
                                              "flags", *parts_column]).to_pylist():
            pid = record_unit(rec)
            if pid in done:
                continue
            ids = record_token_ids(rec)
            turn = int(rec["turn_index"] or 0)
            image = bool(parts_column) and holds_image(rec["messages"])
            mismatch = not image and ids is not None and count_mismatch(rec)
            if image or ids is None or mismatch:
                if (pid, turn) not in refused:
                    refused.add((pid, turn))
                    if image:
                        log.warning("record %s turn %d refused: an image prompt: %s", pid, turn,
                                    IMAGE_REFUSALS.get(route, IMAGE_REFUSALS["transformers"]))
                        out.images += 1
                    elif mismatch:
                        log.warning("record %s turn %d refused: %s", pid, turn, mismatch)
                        out.count_mismatch += 1
                    else:
                        out.no_token_ids += 1
                continue
            left = True
            by_prompt.setdefault(pid, {}).setdefault(turn, sample_factory(
                pid, turn, turn_id(pid, turn), ids, len(rec["prompt_token_ids"]),
                "length" if is_truncated(rec) else rec["finish_reason"]))
        if not left:
            settled.add(str(part))
    for turns in by_prompt.values():
        out.prompts.append([turns[t] for t in sorted(turns)])
        out.tokens += sum(len(s.token_ids) for s in turns.values())
    return out


def check_space(cap: RunDir, pending: Pending, width: int, force: bool) -> None:
    from .hidden.space import check_free_space, estimate_bytes, human_bytes

    needed = estimate_bytes(1, pending.tokens, width)
    if not cap.path.local:
        log.info("the capture needs about %s on %s (an object store: no capacity check)", human_bytes(needed),
                 cap.path)
        return
    fit = check_free_space(cap.path, needed, force=force, advice=CAPTURE_ADVICE)
    log.info("%s%s", fit["message"], "" if fit["fits"] else ": forced")


def capture(opts: CaptureOptions) -> int:
    cfg = load_capture_config(opts.config)
    run = RunDir(opts.run_dir)
    if not run.exists():
        raise ConfigError(f"{opts.run_dir} is not a run directory (no run.json)")
    stop = StopFlag()
    stop.install()
    cap = capture_run_dir(run)
    cap.path.mkdir()
    with RunLock(cap) as lock:
        # a capture refused (or failed) before its first ledger commit leaves RUN/capture as it was, and a new
        # one leaves no RUN/capture (store/untouched.py)
        before = Untouched.take(cap.path, "capture.json")
        setup_logging(cap)
        try:
            cap_manifest = open_capture(run, cfg)[1]
            removed = remove_garbage_hidden_parts(cap)
            if removed:
                log.info("removed %d hidden parts no ledger row names (left by a kill)", removed)
            return capture_loop(cfg, opts, run, cap, cap_manifest, stop, lock)
        except BaseException as exc:
            with signals_deferred():  # a signal now waits for the undo: it never leaves RUN/capture half put back
                if before.undo_after(exc):
                    before.restore()
                    lock.remove_folder_on_release = before.new
            raise


def capture_loop(cfg: CaptureConfig, opts: CaptureOptions, run: RunDir, cap: RunDir, cap_manifest: dict[str, Any],
                 stop: StopFlag, lock: RunLock) -> int:
    from .dispatch.capture_pool import CapturePool
    from .dispatch.capture_worker import Sample
    from .dispatch.cluster import init_ray

    fingerprint = cap_manifest["fingerprint"]
    width = int(cap_manifest["layout"]["hidden_size"]) * len(cap_manifest["layout"]["states"])
    done = cap.committed_ids()
    refused: set[tuple[str, int]] = set()
    refusals = {"no_token_ids": 0, "count_mismatch": 0, "images": 0}
    settled: set[str] = set()  # ledger parts with nothing left to capture: not read again by a follow's polls
    failed: set[str] = set()  # prompts the route could not capture, alone, in this session
    committer = Committer(cap, done, cfg.flush_records, cfg.flush_interval_s, schema.CAPTURE, lock=lock)
    session = {"samples": 0, "tokens": 0, "route_s": 0.0, "started": time.monotonic(), "failed_prompts": 0}

    def on_rows(rows) -> None:
        for prompt_rows in rows:
            stamped = [{**row, "created_at": now_utc()} for row in prompt_rows]
            if committer.add_records(stamped):
                session["samples"] += len(stamped)
                session["tokens"] += sum(r["n_tokens"] for r in stamped)
                session["route_s"] += sum(r["capture_s"] for r in stamped)
        committer.maybe_flush()

    def write_status(state: str) -> None:
        elapsed = time.monotonic() - session["started"]
        cap.write_status({"state": state, "updated_at": now_utc().isoformat(timespec="seconds"),
                          "captured_prompts": len(committer.done), "failed_prompts": len(failed),
                          "failed_prompt_ids": sorted(failed)[:100],
                          "refused_no_token_ids": refusals["no_token_ids"],
                          "refused_count_mismatch": refusals["count_mismatch"],
                          "refused_images": refusals["images"],
                          "this_session": {"samples": session["samples"], "tokens": session["tokens"],
                                           "elapsed_s": round(elapsed, 1),
                                           "tok_s": round(session["tokens"] / max(elapsed, 1e-9), 1),
                                           "route_tok_s": round(session["tokens"] / max(session["route_s"], 1e-9), 1),
                                           "failed_prompts": session["failed_prompts"]}})

    ticks = {"last": 0.0}

    def on_tick() -> None:
        committer.maybe_flush()
        if time.monotonic() - ticks["last"] > 2.0:
            ticks["last"] = time.monotonic()
            write_status("running")

    stop.graceful = True
    state = "complete"
    pool = None
    try:
        while True:
            # the lock before the listing: a listing made after seeing generation's lock released holds its last commit
            generation_live = cfg.follow and RunLock(run).is_held()
            pending = pending_samples(run, committer.done | committer.buffered | failed, refused, Sample, settled,
                                      cfg.route)
            refusals["no_token_ids"] += pending.no_token_ids
            refusals["count_mismatch"] += pending.count_mismatch
            refusals["images"] += pending.images
            if pending.images:
                log.warning("%d image records refused (named above): %s; they are never captured from their text "
                            "alone", pending.images, IMAGE_REFUSALS.get(cfg.route, IMAGE_REFUSALS["transformers"]))
            if pending.count_mismatch:
                log.warning("%d records refused: their token ids disagree with their own prompt_tokens / "
                            "completion_tokens (named above)", pending.count_mismatch)
            if pending.no_token_ids:
                log.warning("%d records refused: no token ids (a server that gives none, e.g. llama.cpp, cannot "
                            "be captured; regenerate with an engine that returns them)", pending.no_token_ids)
            if pending.prompts:
                check_space(cap, pending, width, opts.force)
                log.info("capturing %d prompts (%d tokens) on %d actor(s)", len(pending.prompts), pending.tokens,
                         cfg.actors)
                if pool is None:
                    init_ray(cfg.ray.address)
                    stop.install()  # again: ray.init replaced the SIGTERM handler
                    pool = CapturePool(cfg, cap.path.uri, fingerprint, on_rows, on_tick, stop, expected=cap_manifest)
                batches = [pending.prompts[i:i + cfg.prompts_per_call]
                           for i in range(0, len(pending.prompts), cfg.prompts_per_call)]
                failed.update(pool.run(batches))  # tried again by the next session, not by this one's next pass
                session["failed_prompts"] = len(failed)
                committer.flush()
            if stop():
                state = "interrupted"
                break
            if not generation_live:
                break  # one pass, or generation had released its lock before this listing: nothing more will come
            if not pending.prompts:
                time.sleep(cfg.poll_interval_s)
    except BaseException as exc:
        if pool is not None:
            failed.update(pool.failed_prompts)  # the prompts this pass failed before it stopped
            session["failed_prompts"] = len(failed)
        try:
            committer.flush()
        finally:  # a route or disk that cannot go on (resumable) is a stop, not an interruption
            write_status("interrupted" if isinstance(exc, KeyboardInterrupt) else "stopped")
        raise
    finally:
        if pool is not None:
            pool.close()
    committer.flush()
    if state == "complete" and failed:
        state = "finished"  # not complete: the failed prompts are tried again by the next run
    write_status(state)
    summary = {"captured_prompts": len(committer.done), "new_samples": session["samples"],
               "refused_no_token_ids": refusals["no_token_ids"], "refused_count_mismatch": refusals["count_mismatch"],
               "refused_images": refusals["images"], "failed_prompts": session["failed_prompts"]}
    counts = f"{len(committer.done)} prompts captured, {len(failed)} failed" + (
        " (named above; a rerun tries them again)" if failed else "")
    print(f"regen: capture {state}: {counts}: {orjson.dumps(summary).decode()}", file=sys.stderr)
    if state == "interrupted":
        return EXIT_INTERRUPTED
    if session["failed_prompts"]:
        return 1
    if refused and not committer.done:
        raise ConfigError(f"{run.path}: none of its {len(refused)} records can be captured ({refusals['no_token_ids']} "
                          f"without token ids, {refusals['count_mismatch']} whose ids disagree with their counts, "
                          f"{refusals['images']} image prompts)")
    return 0
