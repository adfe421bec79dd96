"""The `regen export` command: its arguments, and the JSONL or hidden-state export they name."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..core.errors import ConfigError
from .formats import Filters
from .jsonl import FORMATS, export_run

HIDDEN_FORMATS = ("specforge-offline", "speculators-hidden")  # export/hidden.py


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (outputs/<run>, or an s3:// or gs:// URI)")
    parser.add_argument("--format", required=True, choices=FORMATS + HIDDEN_FORMATS, dest="format",
                        help="JSONL training rows (specforge, specforge-tokens, speculators, torchspec), or "
                             "hidden-state files: specforge-offline (one torch file per sample; needs torch) and "
                             "speculators-hidden (hs_{idx}.safetensors)")
    parser.add_argument("--out", required=True,
                        help="output JSONL path (written atomically), or a directory for the hidden-state formats")
    parser.add_argument("--per-turn", action="store_true",
                        help="specforge, all_turns runs: one row per assistant turn instead of whole conversations")
    parser.add_argument("--drop-truncated", action="store_true", help="drop records that hit max_tokens")
    parser.add_argument("--keep-truncated", action="store_true",
                        help="specforge, torchspec: keep records that hit max_tokens (dropped by default: the trainer "
                             "renders an end-of-turn token after them that the model never generated)")
    parser.add_argument("--image-prefix", action="append", dest="image_prefixes", metavar="OLD=NEW",
                        help="speculators, torchspec: rewrite the start OLD of each image path the rows name to NEW, "
                             "the same folder as the trainer's machines see it (repeatable; the longest OLD that "
                             "matches wins). Default: the run's own path (RUN/images/...) or the referenced file")
    parser.add_argument("--speculators-data", metavar="DIR",
                        help="speculators-hidden: a folder made by `speculators prepare-data`; hs_{i} files go into "
                             "its hidden_states/ in its row order")
    parser.add_argument("--drop-flagged", action="store_true", help="drop records with any quality flag")
    parser.add_argument("--source", action="append", dest="sources", metavar="NAME",
                        help="keep only records of this source (repeatable)")


def local_out(out: str) -> Path:
    """Exports are read by a trainer from local or shared disk; the run itself may be on an object store."""
    if "://" in out:
        raise ConfigError(f"--out {out}: exports are written to a local or shared path (copy them up afterwards)")
    return Path(out)


def run_export(args: argparse.Namespace) -> int:
    if args.format in HIDDEN_FORMATS:
        from .hidden import export_hidden

        if args.keep_truncated or args.per_turn or args.image_prefixes:
            raise ConfigError(f"--format {args.format}: --keep-truncated, --per-turn and --image-prefix are for the "
                              "JSONL formats (a hidden-state export keeps truncated samples with their last position "
                              "masked, and holds no image record: capture refuses them)")
        filters = Filters(args.drop_truncated, args.drop_flagged, frozenset(args.sources) if args.sources else None)
        result = export_hidden(args.run_dir, args.format, local_out(args.out), args.speculators_data, filters)
        for note in result.get("notes", []):
            print(f"regen: {note}", file=sys.stderr)
        for reason, count in sorted(result.get("dropped", {}).items()):
            print(f"regen: dropped ({reason}): {count}", file=sys.stderr)
        print(f"regen: {args.format}: {result['samples']} samples in {result['out']} "
              f"(manifest.json says which layers and which norm convention)", file=sys.stderr)
        return 0
    summary = export_run(args.run_dir, args.format, local_out(args.out), drop_truncated=args.drop_truncated,
                         drop_flagged=args.drop_flagged, sources=args.sources, per_turn=args.per_turn,
                         keep_truncated=args.keep_truncated, image_prefixes=args.image_prefixes)
    print(summary.table(), file=sys.stderr)
    return 0
