"""The capture's ledger as `regen status` and the dataset card read it: RUN/capture is a run directory of its own
(capture.json for run.json, data/ the ledger of captured samples, hidden/ the states)."""
from __future__ import annotations

from typing import Any

import pyarrow as pa

from ..core.images import IMAGE
from .lock import RunLock
from .rundir import RunDir
from .partread import read_columns

CAPTURE_DIR = "capture"


def capture_run_dir(run: RunDir) -> "CaptureDir":
    return CaptureDir(run.path / CAPTURE_DIR)


class CaptureDir(RunDir):
    @property
    def manifest_path(self):
        return self.path / "capture.json"


def is_truncated(record: dict[str, Any]) -> bool:
    return record.get("finish_reason") == "length" or "truncated" in (record.get("flags") or [])


def record_token_ids(record: dict[str, Any]) -> list[int] | None:
    """prompt + completion ids of a record, or None when the server gave none."""
    if record.get("prompt_token_ids") is None or not record.get("output_token_ids"):
        return None
    return list(record["prompt_token_ids"]) + list(record["output_token_ids"])


def has_part_messages(records_schema: pa.Schema) -> bool:
    """Whether a records part's messages can hold content parts (records schema 6: the MESSAGE struct's `parts`)."""
    if "messages" not in records_schema.names:
        return False
    message = records_schema.field("messages").type.value_type
    return isinstance(message, pa.StructType) and message.get_field_index("parts") >= 0


def holds_image(messages: list[dict[str, Any]] | None) -> bool:
    """Whether message rows (as Parquet gives them) hold an image part."""
    return any(p.get("type") == IMAGE for m in messages or () for p in m.get("parts") or ())


def count_mismatch(rec: dict[str, Any]) -> str:
    """Why a record's token ids cannot be its own (its counts say other lengths), or "" (a count of 0 or none is
    a server that reported no usage: nothing to check)."""
    wrong = [f"{len(rec[ids])} {ids} but {counts} {rec[counts]}"
             for ids, counts in (("prompt_token_ids", "prompt_tokens"), ("output_token_ids", "completion_tokens"))
             if rec.get(counts) and rec[counts] != len(rec[ids])]
    return "; ".join(wrong)


def capture_counts(run: RunDir) -> dict[str, Any] | None:
    """Captured samples of the run's committed records (None: no capture started)."""
    cap = capture_run_dir(run)
    if not cap.exists():
        return None
    parts = RunDir.parts(cap.data)
    captured = set()
    tokens = 0
    if parts:
        table = read_columns(parts, ["sample_id", "n_tokens"]).to_pydict()
        captured = set(table["sample_id"])
        tokens = sum(table["n_tokens"])
    samples = refused = mismatched = images = 0
    for part in RunDir.parts(run.data):
        parts_column = ["messages"] if has_part_messages(part.parquet_schema()) else []
        for rec in part.read_parquet(columns=["prompt_token_ids", "output_token_ids", "prompt_tokens",
                                              "completion_tokens", *parts_column]).to_pylist():
            if parts_column and holds_image(rec["messages"]):
                images += 1
            elif record_token_ids(rec) is None:
                refused += 1
            elif count_mismatch(rec):
                mismatched += 1
            else:
                samples += 1
    lock = RunLock(cap)
    live = cap.read_status() or {}
    if lock.is_held():
        state = "running"
    elif samples and len(captured) >= samples:
        state = "complete"
    else:  # "finished": the last pass ended with prompts it could not capture (retried by the next)
        state = "finished" if live.get("state") == "finished" else "stopped"
    manifest = cap.read_manifest()
    return {"state": state, "route": manifest.get("route"), "fingerprint": manifest.get("fingerprint"),
            "captured": len(captured), "capturable": samples, "refused_no_token_ids": refused,
            "refused_count_mismatch": mismatched, "refused_images": images,
            "tokens": tokens, "ledger_parts": len(parts), "this_session": live.get("this_session", {}),
            "failed_prompts": live.get("failed_prompts", 0) if state != "complete" else 0,
            "failed_prompt_ids": live.get("failed_prompt_ids", []) if state != "complete" else [],
            "layers": (manifest.get("layout") or {}).get("states", [])}
