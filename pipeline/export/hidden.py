"""Exports of a capture (RUN/capture, written by `regen capture`) in each training library's own layout.

`export_hidden(run_dir, fmt, out_dir, speculators_data=None) -> dict` (the summary, with `notes`):

- `specforge-offline`: SpecForge's offline features (`data.hidden_states_path`), one `torch.save` file per
  sample at `rows_{g}-{g+2000}/data_{idx}.ckpt` with
      input_ids [T] int64, loss_mask [T] int64,
      aux_hidden_state [1, T, 3H] bf16 (the three aux states, concatenated: the draft's input),
      hidden_state [1, T, H] bf16 (the last layer after the final norm: the teacher, lm_head's input).
  T rows for T tokens. torch is needed for this format only (imported here, lazily).
- `speculators-hidden`: a speculators data folder: the rows (`input_ids`, `loss_mask`, `seq_len`) saved with
  `datasets` in torch format, as `speculators prepare-data` saves them, and `hidden_states/hs_{i}.safetensors`
  for row i, with `hidden_states` [T, 4, H] bf16 (aux layers, then the last layer BEFORE the final norm) and
  `token_ids` [T] int64. With `speculators_data` (a folder `speculators prepare-data` made from the
  `speculators` JSONL export), the files go into its `hidden_states/` instead, hs_i following ITS row order
  (prepare-data shuffles), matched by token ids; a row prepare-data cut at its seq_length matches the sample it
  is the start of, and that file holds the cut length's states.
Loss mask: 0 on the prompt, 1 on the completion (each library's own preprocessing gives the same mask), except a
record cut at max_tokens: its last position is 0, where a renderer would close the turn with an end-of-turn token
the model never generated. Both write `manifest.json` (layers, norm convention, files) last, and the whole folder
is staged beside the target and renamed into place (export/folders.py).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from ..core.errors import ConfigError
from ..hidden.layout import AUX, FINAL_POST_NORM, LAST_PRE_NORM, CaptureLayout
from ..hidden.errors import StoredLayoutMismatch
from ..hidden.parts import BF16, iter_hidden
from ..store.capture_ledger import capture_run_dir
from ..store.rundir import RunDir, atomic_write
from ..store.storage import Location
from . import folders
from .formats import Filters, conversation_id

FORMATS = ("specforge-offline", "speculators-hidden")
GROUP = 2000
TRUNCATED_NOTE = ("records cut at max_tokens keep their ids as generated; their last position has loss_mask 0 "
                  "(no end-of-turn the model never generated is ever a training target)")


def _torch():
    try:
        import torch
    except ImportError:
        raise ConfigError("--format specforge-offline needs torch (pip install torch; the CPU build is enough). "
                          "It is an optional extra used by this export only.") from None
    return torch


def loss_mask(n_tokens: int, n_prompt: int, truncated: bool) -> np.ndarray:
    mask = np.zeros(n_tokens, dtype=np.int64)
    mask[n_prompt:] = 1
    if truncated and n_tokens:
        mask[n_tokens - 1] = 0
    return mask


def _states(sample, layout: CaptureLayout, sample_id: str) -> np.ndarray:
    """The stored matrix as [T, K, H] bf16 bit patterns (uint16)."""
    if sample.width != layout.width or sample.n_rows != len(sample.token_ids):
        raise StoredLayoutMismatch(
            f"capture sample {sample_id}: stored as [{sample.n_rows}, {sample.width}] for {len(sample.token_ids)} "
            f"tokens, but capture.json's layout is [T, {layout.width}] ({len(layout.states)} states x "
            f"{layout.hidden_size}): this capture mixes models; delete RUN/capture and capture again")
    bits = np.ascontiguousarray(sample.hidden).view(np.uint16)
    return bits.reshape(sample.n_rows, len(layout.states), layout.hidden_size)


def _bf16_torch(torch, bits: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def _specforge_write(torch, states, sample, mask, idx: int, out: Path, layout: CaptureLayout) -> Path:
    group = (idx // GROUP) * GROUP
    folder = out / f"rows_{group}-{group + GROUP}"
    folder.mkdir(parents=True, exist_ok=True)
    T = sample.n_rows
    aux = states[:, layout.index(AUX)].reshape(T, -1)
    final = states[:, layout.index(FINAL_POST_NORM)[0]]
    obj = {"input_ids": torch.from_numpy(sample.token_ids.astype(np.int64)), "loss_mask": torch.from_numpy(mask),
           "aux_hidden_state": _bf16_torch(torch, aux).unsqueeze(0),
           "hidden_state": _bf16_torch(torch, final).unsqueeze(0)}
    path = folder / f"data_{idx}.ckpt"
    tmp = folders.partial(path)
    torch.save(obj, tmp)
    os.replace(tmp, path)
    return path


def _speculators_write(states, sample, idx: int, folder: Path, layout: CaptureLayout) -> Path:
    from safetensors.numpy import save_file

    picked = states[:, layout.index(AUX) + layout.index(LAST_PRE_NORM)]
    tensors = {"hidden_states": np.ascontiguousarray(picked).view(BF16) if BF16 != np.uint16 else picked,
               "token_ids": sample.token_ids.astype(np.int64)}
    path = folder / f"hs_{idx}.safetensors"
    tmp = folders.partial(path)
    save_file(tensors, str(tmp), metadata={"prompt_id": sample.prompt_id, "turn_index": str(sample.turn_index)})
    os.replace(tmp, path)
    return path


def _prepared_order(prepared: Path) -> dict[tuple[int, ...], list[int]]:
    """Row indices of a prepared speculators dataset, by token ids (rows with equal ids share a list)."""
    from datasets import load_from_disk

    try:
        rows = load_from_disk(str(prepared)).with_format(None)["input_ids"]
    except FileNotFoundError:
        raise ConfigError(f"--speculators-data {prepared}: not a dataset saved by `speculators prepare-data`") from None
    order: dict[tuple[int, ...], list[int]] = {}
    for i, ids in enumerate(rows):
        order.setdefault(tuple(ids), []).append(i)
    return order


def _cut(sample, n: int):
    """The sample's first n tokens (a prepared row cut at seq_length)."""
    import dataclasses

    return dataclasses.replace(sample, token_ids=sample.token_ids[:n], hidden=sample.hidden[:n],
                               loss_mask=sample.loss_mask[:n])


def _save_rows(out: Path, rows: dict[str, list]) -> None:
    from datasets import Dataset

    Dataset.from_dict(rows).with_format("torch").save_to_disk(str(out))


def _dropped_by(run: RunDir, filters: Filters | None) -> dict[tuple[str, int], str]:
    """(unit id, turn_index) of the run's records the token exports' filters drop, with the reason."""
    if filters is None or filters == Filters():
        return {}
    out: dict[tuple[str, int], str] = {}
    for part in RunDir.parts(run.data):
        samples = ["sample_index"] if "sample_index" in part.parquet_schema().names else []
        for rec in part.read_parquet(columns=["prompt_id", *samples, "turn_index", "source", "finish_reason",
                                              "flags"]).to_pylist():
            reason = filters.reason_to_drop(rec)
            if reason:  # the capture names a sample of a prompt by its unit id, as the token exports do
                out[(conversation_id(rec), int(rec["turn_index"] or 0))] = reason
    return out


def export_hidden(run_dir: str | Path | Location | RunDir, fmt: str, out_dir: str | Path,
                  speculators_data: str | Path | None = None, filters: Filters | None = None) -> dict[str, Any]:
    """Write every captured sample in `fmt` that `filters` keeps (the same record filter as the token exports, so
    both hold the same samples); returns the summary (also in manifest.json)."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown hidden-state export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    cap = capture_run_dir(run)
    if not cap.exists():
        raise ConfigError(f"{run.path} has no capture (RUN/capture/capture.json): run `regen capture` first")
    cap_manifest = cap.read_manifest()
    layout = CaptureLayout.from_dict(cap_manifest["layout"])
    ledger = {(r["prompt_id"], r["turn_index"]): r for r in
              (cap.read_table(cap.data, ["prompt_id", "turn_index", "sample_id", "finish_reason"]) or
               _empty()).to_pylist()}
    # `target`: the folder this export replaces whole (--out, or the prepared folder's hidden_states/)
    target = Path(speculators_data) / "hidden_states" if speculators_data else Path(out_dir)
    out = Path(speculators_data) if speculators_data else target
    prepared = _prepared_order(out) if speculators_data else None
    torch = _torch() if fmt == "specforge-offline" else None
    stage = folders.start(target, FORMATS)
    try:
        summary, index = _write(fmt, cap, layout, ledger, _dropped_by(run, filters), stage, prepared, torch,
                                speculators_data is not None)
        summary = {**summary, "run": str(run.path), "filters": (filters or Filters()).as_dict(),
                   "capture_fingerprint": cap_manifest.get("fingerprint"), "route": cap_manifest.get("route"),
                   "out": str(target)}
        atomic_write(stage / "manifest.json", orjson.dumps({**summary, "files": index}, option=orjson.OPT_INDENT_2))
        folders.finish(stage, target)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return summary


def _write(fmt, cap, layout, ledger, drop, stage: Path, prepared, torch, into_prepared: bool):
    """Every kept sample's file under `stage` (which becomes the target), and the summary without run facts."""
    hs_folder = stage if into_prepared else stage / "hidden_states"
    prefix = "hidden_states/" if into_prepared else ""
    if fmt == "speculators-hidden":
        hs_folder.mkdir(exist_ok=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    index, tokens, unmatched, cut = [], 0, [], 0
    # prepare-data cuts each row at its seq_length (`input_ids[:max_length]`): a cut row is as long as the longest
    seq_length = max(map(len, prepared), default=0) if prepared is not None else 0
    dropped: dict[str, int] = {}
    for sample in iter_hidden(cap):
        entry = ledger[(sample.prompt_id, sample.turn_index)]
        reason = drop.get((sample.prompt_id, sample.turn_index))
        if reason:
            dropped[reason] = dropped.get(reason, 0) + 1
            continue
        truncated = entry["finish_reason"] == "length"
        mask = loss_mask(len(sample.token_ids), sample.n_prompt, truncated)
        states = _states(sample, layout, entry["sample_id"])
        if fmt == "specforge-offline":
            path = _specforge_write(torch, states, sample, mask, len(index), stage, layout)
            idx = len(index)
        else:
            if prepared is not None:
                ids = tuple(int(t) for t in sample.token_ids)
                slots = prepared.get(ids) or (prepared.get(ids[:seq_length]) if len(ids) > seq_length else None)
                if not slots:
                    unmatched.append(entry["sample_id"])
                    continue
                idx = slots.pop(0)
                if len(ids) > seq_length and not prepared.get(ids):  # its row was cut: so are its states
                    sample, states, cut = _cut(sample, seq_length), states[:seq_length], cut + 1
            else:
                idx = len(rows["input_ids"])
                rows["input_ids"].append(sample.token_ids.astype(np.int64).tolist())
                rows["loss_mask"].append(mask.tolist())
                rows["seq_len"].append(len(sample.token_ids))
            path = _speculators_write(states, sample, idx, hs_folder, layout)
        index.append({"idx": idx, "file": prefix + str(path.relative_to(stage)), "sample_id": entry["sample_id"],
                      "prompt_id": sample.prompt_id, "turn_index": sample.turn_index,
                      "tokens": len(sample.token_ids), "n_prompt": sample.n_prompt, "truncated": truncated})
        tokens += len(sample.token_ids)
    if fmt == "speculators-hidden" and prepared is None:
        _save_rows(stage, rows)
    notes = [TRUNCATED_NOTE]
    if unmatched:
        notes.append(f"{len(unmatched)} captured samples have no row in the prepared data (filtered by "
                     f"prepare-data, or another export): {', '.join(unmatched[:5])}")
    if cut:
        notes.append(f"{cut} samples matched a row prepare-data cut at {seq_length} tokens: their files hold the "
                     f"first {seq_length} tokens' states")
    if prepared is not None:
        missing = sum(len(v) for v in prepared.values())
        if missing:
            notes.append(f"{missing} rows of the prepared data have no captured sample: speculators will "
                         "generate or skip them")
    states_used = ([s for s in layout.states if s.kind in (AUX, FINAL_POST_NORM)] if fmt == "specforge-offline"
                   else [s for s in layout.states if s.kind in (AUX, LAST_PRE_NORM)])
    summary = {
        "format": fmt, "samples": len(index), "tokens": tokens, "dropped": dropped,
        "layout": layout.as_dict(),
        "exported_states": [{"kind": s.kind, "layer": s.layer, "norm": s.norm} for s in states_used],
        "specforge_aux_hidden_state_layer_ids": [i - 1 for i in layout.aux_layer_ids],
        "speculators_eagle_aux_hidden_state_layer_ids": list(layout.aux_layer_ids),
        "dtype": "bf16", "notes": notes,
    }
    return summary, index


def _empty():
    import pyarrow as pa

    from ..store import schema

    return pa.Table.from_pylist([], schema=schema.CAPTURE).select(["prompt_id", "turn_index", "sample_id",
                                                                   "finish_reason"])
