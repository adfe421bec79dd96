"""What `regen preflight` judges the fleet against: the prompt set the run will send, read as `regen generate` reads
it. A run that exists: its stored, pinned prompt set (the run `generate` would open: store/resume.py choose_run);
else the sources, read into a temporary staged set exactly as a new run stages them, then discarded.

From the set: whether it has tools (the fleet must return the target's calls in tool_calls) and images (the fleet must
take image parts), and its longest prompts. Those are told by their length in bytes (vectorised, a row group at a
time), and the few longest are measured with the target's tokenizer (the chat template applied, tools included) where
the config names one (`tokenizer`, or `max_prompt_tokens`, which loads it for `generate` too): a server whose context
cannot hold the longest prompt plus `sampling.max_tokens` fails those prompts, so the preflight warns of it.

The cost is stated: reading the stored set is a footer and a pass over two columns (milliseconds to a second);
reading the sources is the whole read a new run makes (a 125 MB dump: about 9 s), which `generate` then repeats.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from ..core.config import RunConfig
from ..core.errors import ConfigError, DriftError
from ..store.prompt_reader import PendingPrompt, PromptSetReader
from ..store.storage import Location
from .needs import has_images

LONGEST_MEASURED = 8  # the longest prompts (by bytes) measured with the tokenizer


@dataclass(frozen=True)
class PromptNeeds:
    """What the prompt set needs of the fleet, and what finding it out cost."""

    tools: bool
    images: bool
    prompts: int
    where: str  # "the stored prompt set of <run>" or "the sources"
    seconds: float
    longest_bytes: int = 0  # the longest prompt's texts, tools and tool calls, in bytes
    longest_tokens: int | None = None  # the longest measured prompt, with the tokenizer (None: not measured)
    tokenizer: str | None = None  # what measured it

    def line(self) -> str:
        what = [f"{self.prompts} prompts", f"tools {'yes' if self.tools else 'no'}",
                f"images {'yes' if self.images else 'no'}"]
        if self.longest_tokens is not None:
            what.append(f"longest prompt {self.longest_tokens} tokens ({self.tokenizer})")
        else:
            what.append(f"longest prompt {self.longest_bytes} bytes (name a `tokenizer:` to measure it in tokens)")
        return f"prompt set: {', '.join(what)}; read from {self.where} in {self.seconds:.2f} s"

    def context_warning(self, context: int | None, max_tokens: int) -> str | None:
        """Why a server of `context` tokens fails the longest prompts; None: it holds them (or nothing is known)."""
        if self.longest_tokens is None or context is None or self.longest_tokens + max_tokens <= context:
            return None
        return (f"context is {context} tokens, shorter than the longest prompt ({self.longest_tokens} tokens) + "
                f"sampling.max_tokens ({max_tokens}): such prompts fail on this server (a terminal failure each). "
                "Set max_prompt_tokens to leave them out before sending, lower sampling.max_tokens, or launch "
                "with a longer context")


def stored_run(cfg: RunConfig):
    """The run `regen generate` would open with this config, if it exists and holds a prompt set; else None."""
    from ..store.resume import choose_run, committed_nothing, identity_drift

    try:
        chosen = choose_run(cfg, new_run=False, refresh_prompts=False)
    except (DriftError, ConfigError):
        return None  # generate refuses it (or starts another run with --new-run): judged by the sources
    run = chosen.run_dir
    if not run.exists() or not run.prompt_set_versions():
        return None
    if committed_nothing(run) and identity_drift(cfg, run, refresh_prompts=False):
        return None  # it takes this config, and reads its prompt set again from the sources (run.py open_run)
    return run


def prompt_needs(cfg: RunConfig) -> PromptNeeds:
    """The prompt set's needs: the stored set of the run, else the sources (module docstring)."""
    started = time.monotonic()
    run = stored_run(cfg)
    if run is not None:
        reader = run.prompt_set_reader(run.read_manifest().get("prompt_set_version"))
        return judge(reader, cfg, f"the stored prompt set of {run.path}", started)
    from ..endpoints.image_fetch import image_fetcher
    from ..store.promptset import stage_prompt_set

    staged = stage_prompt_set(cfg, fetch=image_fetcher(cfg.images))
    try:
        reader = PromptSetReader(Location.at(str(staged.prompts.path)))
        return judge(reader, cfg, "the sources (no run yet: `generate` reads them again)", started)
    finally:
        staged.discard()


def judge(reader: PromptSetReader, cfg: RunConfig, where: str, started: float) -> PromptNeeds:
    tools, images = reader.has_tools(), has_images(reader)
    longest = longest_prompts(reader, LONGEST_MEASURED)
    longest_bytes = longest[0][0] if longest else 0
    tokens, name = measure(reader, cfg, [PendingPrompt(pid, position, 0) for _, position, pid in longest])
    return PromptNeeds(tools, images, reader.num_rows, where, time.monotonic() - started, longest_bytes, tokens, name)


def _lengths(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    """Each string's length in bytes, 0 for a null."""
    return pc.fill_null(pc.binary_length(column), 0)


def longest_prompts(reader: PromptSetReader, count: int) -> list[tuple[int, int, str]]:
    """(bytes, position, prompt id) of the `count` longest prompts, longest first: a message's content, parts' texts and tool
    calls, plus the tools, in bytes (Arrow kernels; no Python object per prompt)."""
    best: list[tuple[int, int, str]] = []
    for start, table in reader.scan(["prompt_id", "messages", "tools"]):
        messages = table.column("messages").combine_chunks()
        flat = pc.list_flatten(messages)
        per_message = _lengths(pc.struct_field(flat, "content")).to_numpy(zero_copy_only=False).astype(np.int64)
        names = flat.type.names if pa.types.is_struct(flat.type) else []
        if "tool_calls" in names:
            per_message += _lengths(pc.struct_field(flat, "tool_calls")).to_numpy(zero_copy_only=False)
        if "parts" in names:
            parts = pc.struct_field(flat, "parts")
            texts = _lengths(pc.struct_field(pc.list_flatten(parts), "text")).to_numpy(zero_copy_only=False)
            owners = pc.list_parent_indices(parts).to_numpy()
            per_message += np.bincount(owners, weights=texts, minlength=len(flat)).astype(np.int64)
        owner = pc.list_parent_indices(messages).to_numpy()
        per_prompt = np.bincount(owner, weights=per_message, minlength=table.num_rows).astype(np.int64)
        if "tools" in table.column_names:
            per_prompt += _lengths(table.column("tools")).to_numpy(zero_copy_only=False)
        top = np.argsort(per_prompt)[::-1][:count]
        ids = table.column("prompt_id")
        best = sorted(best + [(int(per_prompt[i]), start + int(i), ids[int(i)].as_py()) for i in top],
                      reverse=True)[:count]
    return best


def measure(reader: PromptSetReader, cfg: RunConfig, longest: list[PendingPrompt]) -> tuple[int | None, str | None]:
    """The most tokens among these prompts, with the tokenizer `generate` loads (only where the config names one or
    sets max_prompt_tokens: the model's name alone is no tokenizer to fetch for a preflight)."""
    if not longest or (not cfg.tokenizer and cfg.max_prompt_tokens is None):
        return None, None
    from ..prompts.tokens import load_length_check

    check = load_length_check(cfg.max_prompt_tokens or 1 << 30, cfg.tokenizer_path(), cfg.served_chat_template(),
                              cfg.images.tokens_per_image)
    if check is None:
        return None, None
    rows = reader.rows(longest)
    counts = [check.count(tuple(row.messages), _tools(row.tools)) for row in rows]
    return max(counts), cfg.tokenizer_path()


def _tools(text: str | None) -> list[dict[str, Any]] | None:
    return orjson.loads(text) if text else None
