"""`regen export RUN_DIR --format F --out PATH`: training files from a run's committed parts.

Safety: only committed parts are read (`part-*.parquet`; a part being written has a `.tmp-` name), no
output id is ever emitted twice, and the output appears atomically (streamed to a temporary name in
the same directory, fsynced, renamed). `<out>.manifest.json` is written next to it.

Formats (row builders in formats.py, torchspec.py, speculators_images.py; the pass in exporter.py):
    specforge         conversations JSONL (with `tools` and the steps' `tool_calls` where the run has them).
                      all_turns: one whole conversation per prompt, or with --per-turn one row per
                      assistant step; last_turn: per-turn rows only, because the history's assistant
                      turns were written by the source dataset. No image records (SpecForge takes none).
    specforge-tokens  {"id", "input_ids", "loss_mask"}; needs token ids. No image records.
    speculators       speculators' regeneration rows; needs token ids. Image records: natural-language
                      conversations in `<out>.images.jsonl` (rendered by prepare-data's --render-endpoint).
    torchspec         TorchSpec's `id` + `conversations` rows, text, tool and image records alike.
Every row carries `source_ref`, the source's own id of its prompt (records schema 6; joined from the prompt set
for older runs; null where the source had none).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from ..core.errors import ConfigError
from ..store.rundir import RunDir, atomic_write, now_utc
from ..store.storage import Location
from . import torchspec
from .exporter import (  # noqa: F401 (the reasons a record is not exported, named here for the callers)
    DUPLICATE, EMPTY_CONTENT, FOLLOWS_DROPPED_TURN, HISTORY_NOT_TARGET, IMAGE_PROMPT, INVALID_CONVERSATION,
    NO_TOKEN_IDS, TOKEN_FORMATS, Exporter)
from .formats import FLAGGED, SOURCE_NOT_SELECTED, TRUNCATED, Filters  # noqa: F401 (the record filter)
from .messages import ImagePaths, parse_prefixes
from .speculators_images import NOTE as SPECULATORS_IMAGES_NOTE
from .templates import CHAT_TEMPLATE_NOTE, template_advice
from .writer import (  # noqa: F401 (the writing and reading every JSONL export shares)
    AtomicJsonlWriter, ExportSummary, NotARunDirectory, SourceRefs, committed_part_records, conversations_in,
    manifest_path, read_run_manifest)

FORMATS = ("specforge", "specforge-tokens", "speculators", "torchspec")

TRAIN_ONLY_LAST_TURN_NOTE = ("train SpecForge with `data.train_only_last_turn: true` (under `data:` in the training "
                             "YAML, or the override data.train_only_last_turn=true; a top-level key is rejected): "
                             "each row's earlier assistant turns are history{why}, only its last assistant turn is a "
                             "training target")
TRUNCATED_MASK_NOTE = ("records cut at max_tokens keep their ids as generated, and their last position has loss_mask "
                       "0: no library trains an end-of-turn there that the model never generated")
NO_IMAGES_NOTE = ("{fmt}: image records are not exported (`image_prompt`): SpecForge 0.2.0 takes no images "
                  "(specforge/inference/media.py), and an image prompt's token ids without its pixels train nothing "
                  "the target computed; export `torchspec` or `speculators` for them")


def images_path(out: Path) -> Path:
    """The speculators export's image conversations, beside its pre-tokenized rows."""
    stem = out.name[:-len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(f"{stem}.images.jsonl")


def _settings(last_turn: bool) -> dict[str, Any]:
    """SpecForge's own keys: `train_only_last_turn` is a DataConfig field (specforge/config/schema.py)."""
    value = "true" if last_turn else "false"
    return {"data": {"train_only_last_turn": last_turn}, "overrides": [f"data.train_only_last_turn={value}"]}


def _notes_and_settings(fmt: str, mode: str, per_turn: bool, model: str = "") -> tuple[list[str], dict[str, Any]]:
    if fmt == "specforge":
        notes, settings = _specforge_notes_and_settings(mode, per_turn)
        return notes + [f"chat template: {template_advice(model)['specforge']}", NO_IMAGES_NOTE.format(fmt=fmt)], \
            settings
    if fmt == "torchspec":
        return list(torchspec.NOTES), {}
    notes = [f"{fmt}: loss_mask is 1 exactly on the tokens the target generated (tool calls included); the prompt "
             "(including any source-written history and every tool result) is masked out", TRUNCATED_MASK_NOTE]
    return notes + ([NO_IMAGES_NOTE.format(fmt=fmt)] if fmt == "specforge-tokens" else []), {}


def _specforge_notes_and_settings(mode: str, per_turn: bool) -> tuple[list[str], dict[str, Any]]:
    if mode != "all_turns":
        why = " written by the source dataset (last_turn run)"
        return [TRAIN_ONLY_LAST_TURN_NOTE.format(why=why), CHAT_TEMPLATE_NOTE], _settings(True)
    if per_turn:
        return [TRAIN_ONLY_LAST_TURN_NOTE.format(why=" (per-turn rows)"), CHAT_TEMPLATE_NOTE], _settings(True)
    return (["whole all_turns conversations: every assistant turn is target-written and trainable",
             CHAT_TEMPLATE_NOTE], _settings(False))


def _earlier_images_file(out: Path) -> Path | None:
    """The image conversations file an earlier export into `out` wrote (its manifest names it), if any."""
    try:
        name = orjson.loads(manifest_path(out).read_bytes()).get("image_rows_file")
    except (OSError, orjson.JSONDecodeError, AttributeError):  # none, or not a regen manifest
        return None
    return out.with_name(name) if name else None


def export_run(run_dir: str | Path | Location, fmt: str, out: Path, *, drop_truncated: bool = False,
               drop_flagged: bool = False, sources: list[str] | None = None, per_turn: bool = False,
               keep_truncated: bool = False, image_prefixes: list[str] | None = None) -> ExportSummary:
    """`keep_truncated`: the conversation exports keep records cut at max_tokens (dropped by default: SpecForge and
    TorchSpec would close them with an end-of-turn token the model never generated). `image_prefixes`: `OLD=NEW`
    rewrites of the image paths the speculators and torchspec rows name."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt in ("specforge", "torchspec") and not keep_truncated:
        drop_truncated = True
    run = RunDir(run_dir)
    manifest = read_run_manifest(run)
    generation = manifest.get("generation") or {}
    mode = generation.get("mode", "last_turn")
    out = Path(out)
    filters = Filters(drop_truncated, drop_flagged, frozenset(sources) if sources else None)
    notes, settings = _notes_and_settings(fmt, mode, per_turn, generation.get("model") or "")
    summary = ExportSummary(format=fmt, mode=mode, out=out, notes=notes, specforge_settings=settings)
    paths = ImagePaths(run.path, parse_prefixes(image_prefixes))
    earlier_images = _earlier_images_file(out)
    with AtomicJsonlWriter(out) as writer, AtomicJsonlWriter(images_path(out), lazy=True) as images:
        exporter = Exporter(fmt, mode, generation.get("sampling") or {}, filters, per_turn, writer, summary,
                            generation.get("tool_reasoning_history", "current_turn"), paths,
                            images if fmt == "speculators" else None)
        for records in committed_part_records(run, SourceRefs(run)):
            exporter.add_part(records)
    if images.written:
        summary.notes.append(SPECULATORS_IMAGES_NOTE.format(out=out.name, images=images.out.name))
    elif earlier_images is not None:
        earlier_images.unlink(missing_ok=True)  # an earlier export's image rows: not this run's export any more
    atomic_write(manifest_path(out), orjson.dumps({
        "format": fmt,
        "out": out.name,
        "image_rows_file": images.out.name if images.written else None,
        "run_dir": str(run.path),
        "run_fingerprint": manifest.get("fingerprint"),
        "schema_version": manifest.get("schema_version"),
        "model": generation.get("model"),
        "mode": mode,
        "per_turn": fmt == "specforge" and exporter.per_turn,
        "filters": filters.as_dict(),
        "counts": summary.counts(),
        "notes": summary.notes,
        "specforge_settings": summary.specforge_settings,
        "torchspec_settings": torchspec.SETTINGS if fmt == "torchspec" else None,
        "chat_template": template_advice(generation.get("model") or "") if fmt == "specforge" else None,
        "image_prefixes": [f"{old}={new}" for old, new in paths.prefixes],
        "image_paths_rewritten": paths.rewritten,
        "created_at": now_utc().isoformat(timespec="seconds"),
    }, option=orjson.OPT_INDENT_2))
    return summary
