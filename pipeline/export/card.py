"""`regen card RUN_DIR`: a dataset card (RUN_DIR/README.md) and histograms (RUN_DIR/card/*.png).

Everything is counted from committed parts only, so a card made during a run is consistent with the
parts it names. The README's YAML header lets the Hugging Face Hub load `data/part-*.parquet`.
"""
from __future__ import annotations

import argparse
import io
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from ..core.errors import RegenError
from ..core.identity import samples_per_prompt
from ..core.work import record_unit
from ..prompts.report import report_table
from ..store.capture_ledger import has_part_messages
from ..store.goodput import ESTIMATED, KEPT, PURPOSES, THROWN_AWAY, Goodput
from ..store.rundir import RunDir
from .card_concurrency import concurrency_lines
from ..store.storage import Location
from ..store.tool_counts import ToolCounts, tool_counts
from .card_images import EXAMPLES, ImageContents, example_lines, image_lines
from .diversity import diversity_lines, sample_diversity
from .writer import SourceRefs, read_run_manifest

CARD_DIR = "card"
DATA_GLOB = "data/part-*.parquet"  # part-* rather than *: never a temporary file of a running writer
CARD_COLUMNS = ["prompt_id", "sample_index", "source", "finish_reason", "flags", "prompt_tokens", "completion_tokens",
                "reasoning_tokens", "reasoning_content", "endpoint", "model", "weight_version", "config_fingerprint"]
GOODPUT_COLUMNS = ["content", "tool_calls", "turn_index"]  # what store/goodput.py reads beyond CARD_COLUMNS
# records schema 6: the source's own id (the examples), and the messages where they hold content parts (images)
OPTIONAL_COLUMNS = ["source_ref"]


class MissingDependency(RegenError):
    """An optional package this command needs is not installed."""


@dataclass(frozen=True)
class LengthStats:
    count: int
    mean: float
    p50: float
    p95: float
    max: int

    @classmethod
    def of(cls, values: list[int]) -> "LengthStats | None":
        if not values:
            return None
        array = np.asarray(values, dtype=np.float64)
        return cls(len(values), float(array.mean()), float(np.percentile(array, 50)),
                   float(np.percentile(array, 95)), int(array.max()))


@dataclass
class RunContents:
    """What the card reports, gathered in one pass over the committed parts."""

    records: int = 0
    prompts: set[str] = field(default_factory=set)
    units: set[str] = field(default_factory=set)  # unit ids of the committed samples (core/work.py record_unit)
    by_source: Counter = field(default_factory=Counter)
    finish_reasons: Counter = field(default_factory=Counter)
    flags: Counter = field(default_factory=Counter)
    flagged_records: int = 0
    by_endpoint: Counter = field(default_factory=Counter)
    models: Counter = field(default_factory=Counter)
    weight_versions: Counter = field(default_factory=Counter)
    fingerprints: Counter = field(default_factory=Counter)
    prompt_tokens: list[int] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    reasoning_tokens: list[int] = field(default_factory=list)  # where the server reported them
    reasoning_words: list[int] = field(default_factory=list)  # fallback: records without reasoning_tokens
    goodput: Goodput = field(default_factory=Goodput)  # the committed records' tokens by purpose
    images: ImageContents = field(default_factory=ImageContents)  # image figures and the examples

    def add(self, row: dict[str, Any]) -> None:
        self.images.add(row)
        self.records += 1
        self.prompts.add(row["prompt_id"])
        self.units.add(record_unit(row))  # sample 0's unit id is its prompt id (the same string)
        self.by_source[row.get("source") or "?"] += 1
        self.finish_reasons[row.get("finish_reason") or "?"] += 1
        flags = row.get("flags") or []
        self.flags.update(flags)
        self.flagged_records += bool(flags)
        self.by_endpoint[row.get("endpoint") or "?"] += 1
        self.models[row.get("model") or "?"] += 1
        self.weight_versions[row.get("weight_version") or "unreported"] += 1
        self.fingerprints[row.get("config_fingerprint") or "?"] += 1
        for column, values in (("prompt_tokens", self.prompt_tokens), ("completion_tokens", self.completion_tokens)):
            if row.get(column) is not None:
                values.append(row[column])
        if row.get("reasoning_tokens") is not None:
            self.reasoning_tokens.append(row["reasoning_tokens"])
        elif row.get("reasoning_content"):
            self.reasoning_words.append(len(row["reasoning_content"].split()))


def gather(run_dir: RunDir, whole_conversations: bool = False) -> RunContents:
    """`whole_conversations`: an all_turns run, whose default export writes whole conversations (store/goodput.py)."""
    contents = RunContents()
    for part in RunDir.parts(run_dir.data):
        present = set(part.parquet_schema().names)
        parts_column = ["messages"] if has_part_messages(part.parquet_schema()) else []
        rows = part.read_parquet(columns=[c for c in CARD_COLUMNS + GOODPUT_COLUMNS + OPTIONAL_COLUMNS
                                          if c in present] + parts_column).to_pylist()
        if not parts_column and len(contents.images.examples) < EXAMPLES and rows:  # text only: the first messages
            batch = next(part.parquet_file().iter_batches(batch_size=EXAMPLES, columns=["messages"]))
            for row, messages in zip(rows, batch.column(0).to_pylist()):
                row["messages"] = messages
        for row in rows:
            contents.add(row)
        contents.goodput.add_records(rows, whole_conversations)  # a part holds every turn of its prompts
    _examples_source_refs(run_dir, contents.images)
    return contents


def _examples_source_refs(run_dir: RunDir, images: ImageContents) -> None:
    """The examples' source ids from the prompt set, for a run whose records predate the `source_ref` column."""
    shown = images.examples + ([images.image_example] if images.image_example else [])
    missing = {e["prompt_id"] for e in shown if e["source_ref"] is None}
    if missing:
        refs = SourceRefs(run_dir, only=missing)
        for example in shown:
            example["source_ref"] = example["source_ref"] or refs.of(example["prompt_id"])


def failure_and_reject_counts(run_dir: RunDir, committed: set[str]) -> tuple[int, Counter, int, Counter]:
    failures = run_dir.read_table(run_dir.failures, columns=["prompt_id", "error_class"])
    failed: dict[str, str] = {}
    if failures is not None:
        for row in failures.to_pylist():
            if row["prompt_id"] not in committed:  # a later retry that succeeded wins
                failed[row["prompt_id"]] = row["error_class"] or "?"
    rejects = run_dir.rejects_table()
    reject_reasons = Counter()
    if rejects is not None:  # by reason code where the rejects carry one (older ones hold only the sentence)
        codes = rejects.column("code").to_pylist() if "code" in rejects.column_names else [None] * rejects.num_rows
        reject_reasons = Counter(code or reason for code, reason in zip(codes, rejects.column("reason").to_pylist()))
    return len(failed), Counter(failed.values()), sum(reject_reasons.values()), reject_reasons


# --- rendering -------------------------------------------------------------------------------------
def _count_table(header: str, counts: Counter, total: int) -> list[str]:
    lines = [f"| {header} | records | share |", "|---|---:|---:|"]
    for key, count in counts.most_common():
        lines.append(f"| {key} | {count} | {100 * count / total:.1f}% |" if total else f"| {key} | {count} | - |")
    if not counts:
        lines.append("| (none) | 0 | - |")
    return lines


def _stats_table(rows: list[tuple[str, LengthStats | None]], header: str = "length") -> list[str]:
    lines = [f"| {header} | count | mean | p50 | p95 | max |", "|---|---:|---:|---:|---:|---:|"]
    for label, stats in rows:
        if stats is None:
            lines.append(f"| {label} | 0 | - | - | - | - |")
        else:
            lines.append(f"| {label} | {stats.count} | {stats.mean:.1f} | {stats.p50:.1f} | "
                         f"{stats.p95:.1f} | {stats.max} |")
    return lines


def reasoning_label(contents: RunContents) -> str:
    if contents.reasoning_words and not contents.reasoning_tokens:
        return "reasoning length (words; the server reported no reasoning_tokens)"
    return "reasoning length (tokens)"


def write_histograms(run_dir: RunDir, contents: RunContents) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingDependency("regen card needs matplotlib for its histograms: pip install matplotlib") from exc
    folder = run_dir.path / CARD_DIR
    folder.mkdir()
    reasoning = contents.reasoning_tokens or contents.reasoning_words
    plots = [("completion_length.png", contents.completion_tokens, "completion length (tokens)"),
             ("reasoning_length.png", reasoning, reasoning_label(contents))]
    written = []
    for name, values, label in plots:
        figure, axes = plt.subplots(figsize=(6, 3.5), dpi=100)
        if values:
            axes.hist(values, bins=min(50, max(5, len(set(values)))), color="#4472c4")
        else:
            axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes)
        axes.set_xlabel(label)
        axes.set_ylabel("records")
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        plt.close(figure)
        path = folder / name
        path.write_atomic(buffer.getvalue())
        written.append(path)
    return written


def _compact_json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _prompt_sources(manifest: dict[str, Any]) -> list[str]:
    reports = (manifest.get("prompt_report") or {}).get("sources")
    if not reports:
        return []
    return ["How the prompt set was read from each source (duplicates: within the source, or held by an earlier "
            "one; dropped turns: blank system messages and assistant turns before the first user turn):", "",
            *report_table(reports), ""]


def render_card(run_dir: RunDir, manifest: dict[str, Any], contents: RunContents) -> str:
    generation = manifest.get("generation") or {}
    # a failure row names its unit: a prompt, or `<id>#s<j>`, committed only if that sample has records (a
    # prompt whose sample 1 is committed does not make its failed sample 0 committed)
    failed, failure_classes, rejected, reject_reasons = failure_and_reject_counts(run_dir, contents.units)
    k = samples_per_prompt(generation)
    name = run_dir.path.name
    reasoning_rows = [("reasoning (tokens)", LengthStats.of(contents.reasoning_tokens))]
    if contents.reasoning_words:
        label = "reasoning (words, where no reasoning_tokens)"
        reasoning_rows.append((label, LengthStats.of(contents.reasoning_words)))
    lines = [
        "---", "configs:", "- config_name: default", f"  data_files: {DATA_GLOB}", "---", "",
        f"# {name}", "",
        f"Regenerated by `regen` through the target model: {contents.records} records "
        f"({len(contents.prompts)} prompts{'' if k == 1 else f', {k} samples of each'}) in "
        f"{len(RunDir.parts(run_dir.data))} committed parts.", "",
        "## Generation", "",
        f"- model (config): `{generation.get('model')}`",
        "- model (reported by the server): " + ", ".join(f"`{m}` ({n})" for m, n in contents.models.most_common()),
        "- weight version(s): " + ", ".join(f"`{w}` ({n})" for w, n in contents.weight_versions.most_common()),
        f"- config fingerprint: `{manifest.get('fingerprint')}`"
        + ("" if set(contents.fingerprints) <= {manifest.get("fingerprint")}
           else " (records also carry: " + ", ".join(f"`{f}`" for f in contents.fingerprints) + ")"),
        f"- mode: `{generation.get('mode', 'last_turn')}`",
        f"- sampling: `{_compact_json(generation.get('sampling') or {})}`",
        f"- chat_template_kwargs: `{_compact_json(generation.get('chat_template_kwargs') or {})}`",
        f"- created: {manifest.get('created_at')}; schema version {manifest.get('schema_version')}", "",
        *_tool_lines(tool_counts(run_dir)),
        *diversity_lines(sample_diversity(run_dir, k, len(contents.prompts))),
        "## Sources", "", *_count_table("source", contents.by_source, contents.records), "",
        *_prompt_sources(manifest),
        *example_lines(contents.images),
        "## Finish reasons", "", *_count_table("finish_reason", contents.finish_reasons, contents.records), "",
        "## Quality flags", "",
        f"{contents.flagged_records} of {contents.records} records carry at least one flag "
        "(a record may carry several).", "",
        *_count_table("flag", contents.flags, contents.records), "",
        *_goodput_lines(run_dir, contents),
        "## Token statistics", "",
        *_stats_table([("prompt (tokens)", LengthStats.of(contents.prompt_tokens)),
                       ("completion (tokens)", LengthStats.of(contents.completion_tokens)), *reasoning_rows]), "",
        "p50/p95 interpolate linearly. Reasoning lengths are the server's `reasoning_tokens` where it reported "
        "them, else a whitespace word count of `reasoning_content`, listed separately.", "",
        f"![completion length]({CARD_DIR}/completion_length.png)",
        f"![reasoning length]({CARD_DIR}/reasoning_length.png)", "",
        *image_lines(contents.images, _stats_table, LengthStats.of),
        "## Endpoints", "", *_count_table("endpoint", contents.by_endpoint, contents.records), "",
        *concurrency_lines(run_dir),
        "## Failures and rejects", "",
        f"- terminal failures ({'prompts' if k == 1 else 'samples'} without a record): {failed}"
        + ("" if not failure_classes else " — " + ", ".join(f"{c} {n}" for c, n in failure_classes.most_common())),
        f"- rejected inputs: {rejected}"
        + ("" if not reject_reasons else " — " + ", ".join(f"{r} {n}" for r, n in reject_reasons.most_common(10))),
        "",
        *_capture_lines(run_dir),
        "## Loading", "",
        "```python", "import datasets", "",
        f'ds = datasets.load_dataset("parquet", data_files="{run_dir.path}/{DATA_GLOB}", split="train")',
        "```", "",
        "Training files: `regen export RUN_DIR --format specforge|specforge-tokens|speculators|torchspec --out FILE`.",
        "",
    ]
    return "\n".join(lines)


def _goodput_lines(run_dir: RunDir, contents: RunContents) -> list[str]:
    """Committed tokens by purpose from the parts; tokens thrown away from the run's own count (status.json)."""
    thrown = Goodput.from_dict((run_dir.read_status() or {}).get("goodput"))
    total = contents.goodput + Goodput(Counter({p: thrown.tokens[p] for p in THROWN_AWAY}),
                                       Counter({p: thrown.items[p] for p in THROWN_AWAY}))
    generated = total.generated()
    if not generated:
        return []
    rows = ["| purpose | tokens | share | records or copies |", "|---|---:|---:|---:|"]
    rows += [f"| {p}{' (estimated)' if p in ESTIMATED else ''} | {total.tokens[p]} | "
             f"{100 * total.tokens[p] / generated:.1f}% | {total.items[p]} |" for p in PURPOSES if total.tokens[p]]
    return ["## Goodput", "",
            f"{100 * total.share():.1f}% of the {generated} completion tokens generated became training data "
            f"(what `regen export --format specforge` keeps: {' + '.join(KEPT)}). Committed records are counted from "
            "the parts; tokens thrown away (late duplicates, hedged copies cancelled at the end, turns before a "
            "retry or a failure) from the run's own count in status.json (docs/goodput.md).", "", *rows, ""]


def _tool_lines(counts: ToolCounts | None) -> list[str]:
    if counts is None or not counts.any():
        return []
    lines = ["## Tool calls", "",
             f"- {counts.prompts_line()}",
             f"- the target's tool calls: {counts.calls}, in {counts.records_with_calls} records "
             "(each tool-calling step is a record)",
             f"- all_turns conversations cut short: {sum(counts.cut_short.values())}"
             + ("" if not counts.cut_short else " — " + ", ".join(f"{reason} {n}" for reason, n
                                                                  in counts.cut_short.most_common())),
             f"- {counts.flags_text()}", ""]
    return lines


def _capture_lines(run_dir: RunDir) -> list[str]:
    from ..store.capture_ledger import capture_counts

    cap = capture_counts(run_dir)
    if cap is None:
        return ["## Hidden states", "", "Not captured (`regen capture RUN --config capture.yaml`).", ""]
    layers = ", ".join(f"{s['kind']} layer {s['layer']} ({s['norm']})" for s in cap["layers"])
    return ["## Hidden states", "",
            f"- capture ({cap['route']}, fingerprint `{cap['fingerprint']}`): {cap['state']}, {cap['captured']} of "
            f"{cap['capturable']} samples captured ({cap['tokens']} tokens), {cap['failed_prompts']} prompts failed "
            f"in its last pass{_named(cap['failed_prompt_ids'])}; {cap['refused_no_token_ids']} records refused "
            "without token ids" + (f", {cap['refused_images']} image prompts refused (no capture route sends "
                                   "images)" if cap.get("refused_images") else ""),
            f"- states per token, in order: {layers}",
            "- exports: `regen export RUN --format specforge-offline|speculators-hidden --out DIR`", ""]


def _named(prompt_ids: list[str]) -> str:
    return f" ({', '.join(prompt_ids[:10])}{', ...' if len(prompt_ids) > 10 else ''})" if prompt_ids else ""


def write_card(run_dir: str | Path | Location) -> Location:
    run = RunDir(run_dir)
    manifest = read_run_manifest(run)
    contents = gather(run, (manifest.get("generation") or {}).get("mode") == "all_turns")
    write_histograms(run, contents)
    path = run.path / "README.md"
    path.write_atomic(render_card(run, manifest, contents).encode())
    return path


# --- CLI (wired as `regen card`) -------------------------------------------------------------------
def run_card(args: argparse.Namespace) -> int:
    path = write_card(args.run_dir)
    print(f"wrote {path} and {path.parent / CARD_DIR}/*.png", file=sys.stderr)
    return 0
