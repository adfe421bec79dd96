"""Runs whose records hold image prompts, built by hand on real parts (real Parquet, real PNG files made with
Pillow), for the export, card and capture tests.

Records schema 6 (store/schema.py: a message's `parts` beside a null `content`, a `source_ref` column), messages
written by prompts/tool_calls.py `message_row` as a run writes them. Copied images are at RUN/images/<sha[:2]>/<sha>
(core/images.py stored_image_path); a referenced one has its `path`.
"""
from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa

from pipeline.core.images import image_part, stored_image_path, text_part
from pipeline.prompts.tool_calls import canonical_json, message_row
from pipeline.store import schema
from pipeline.store.quality import quality_flags
from pipeline.store.rundir import RunDir

SAMPLING = {"temperature": 0.6, "max_tokens": 64}


def png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    image = Image.new("RGB", (width, height))
    image.putdata([((x * 7 + seed) % 256, (y * 5 + seed) % 256, (x + y + seed) % 256)
                   for y in range(height) for x in range(width)])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def copied_image(run: Path, width: int, height: int, seed: int) -> dict[str, Any]:
    """A PNG copied into the run (images.store: copy): its part has no path."""
    data = png(width, height, seed)
    sha = hashlib.sha256(data).hexdigest()
    where = run / stored_image_path(sha)
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_bytes(data)
    return image_part(sha, "image/png", width, height, len(data))


def referenced_image(folder: Path, width: int, height: int, seed: int) -> dict[str, Any]:
    """A PNG read in place (images.store: reference): its part names its absolute path."""
    data = png(width, height, seed)
    folder.mkdir(parents=True, exist_ok=True)
    where = folder / f"photo-{seed}.png"
    where.write_bytes(data)
    return image_part(hashlib.sha256(data).hexdigest(), "image/png", width, height, len(data), str(where))


def image_record(prompt_id: str, turn_index: int, messages: list[dict[str, Any]], content: str, *,
                 n_turns: int = 1, reasoning: str | None = None, finish: str = "stop", source: str = "vision",
                 source_ref: str | None = None, tools: list | None = None, calls: list | None = None,
                 image_tokens: int = 0) -> dict[str, Any]:
    """A record as a run commits it; ids below SmolLM2's vocabulary size (the loaders decode them)."""
    base = 100 + 3000 * (int(hashlib.sha256(f"{prompt_id}{turn_index}".encode()).hexdigest(), 16) % 10)
    prompt_ids = [base + i for i in range(4 * len(messages) + image_tokens)]
    output_ids = [base + 1000 + i for i in range(len(content.split()) + 2)]
    return {
        "prompt_id": prompt_id, "turn_index": turn_index, "n_turns": n_turns, "source": source,
        "messages": [message_row(m) for m in messages], "tools": canonical_json(tools) if tools else None,
        "content": content, "reasoning_content": reasoning, "finish_reason": finish,
        "tool_calls": orjson.dumps(calls).decode() if calls else None,
        "flags": quality_flags(content, reasoning, finish, tool_calls=calls), "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(output_ids), "endpoint": "e0", "model": "kimi-k2.5", "weight_version": "w1",
        "config_fingerprint": "fp-img", "prompt_token_ids": prompt_ids, "output_token_ids": output_ids,
        "sample_index": 0, "source_ref": source_ref}


def write_run(path: Path, mode: str, parts: list[list[dict[str, Any]]]) -> RunDir:
    run = RunDir(path)
    run.create()
    run.write_manifest({"schema_version": 6, "fingerprint": "fp-img", "created_at": "2026-01-01T00:00:00+00:00",
                        "generation": {"model": "kimi-k2.5", "mode": mode, "sampling": SAMPLING,
                                       "chat_template_kwargs": {"thinking": True}, "hidden_states": None,
                                       "tool_reasoning_history": "current_turn"}})
    for rows in parts:
        run.write_part(run.data, pa.Table.from_pylist(rows, schema=schema.RECORDS))
    return run


TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up",
                                           "parameters": {"type": "object", "properties": {
                                               "word": {"type": "string"}}}}}]
CALL = {"id": "functions.lookup:0", "type": "function", "function": {"name": "lookup", "arguments": '{"word":"ox"}'}}


def user(*parts: dict[str, Any] | str) -> dict[str, Any]:
    content = [text_part(p) if isinstance(p, str) else p for p in parts]
    return {"role": "user", "content": content if len(content) > 1 or not isinstance(parts[0], str) else parts[0]}


def last_turn_run(path: Path, elsewhere: Path) -> tuple[RunDir, dict[str, dict[str, Any]]]:
    """Text, tool and image records of a last_turn run at `path`; returns the run and its image parts by name."""
    cat, dog = copied_image(path, 24, 16, 1), copied_image(path, 8, 8, 2)
    ref = referenced_image(elsewhere, 12, 20, 3)
    history = [{"role": "user", "content": "Define ox"},
               {"role": "assistant", "content": "", "tool_calls": [CALL]},
               {"role": "tool", "content": "a bovine animal", "tool_call_id": CALL["id"], "name": "lookup"}]
    records = [
        image_record("t-text", 0, [user("Say hello")], "Hello there", source="chat", source_ref="chat-1"),
        image_record("t-tool", 0, history, "An ox is a bovine.", source="agent", source_ref="agent-7",
                     tools=TOOLS, reasoning="The tool said bovine."),
        image_record("t-img", 0, [user(cat, "What is in this image?")], "A gradient of colours.",
                     reasoning="It looks like a gradient.", source_ref="coco-123", image_tokens=6),
        image_record("t-img2", 0, [{"role": "system", "content": "Be brief."}, user("Compare", ref, dog)],
                     "The first is taller.", source="llava", source_ref=None, image_tokens=9),
        image_record("t-img-hist", 0, [user(cat, "What is it?"), {"role": "assistant", "content": "A square."},
                                       user("And its colours?")], "Red and green.", source_ref="coco-124",
                     image_tokens=6),
        image_record("t-img-cut", 0, [user(dog, "Describe it at length")], "It is a small", finish="length",
                     source_ref="coco-125", image_tokens=6),
    ]
    return write_run(path, "last_turn", [records[:3], records[3:]]), {"cat": cat, "dog": dog, "ref": ref}


def all_turns_run(path: Path) -> tuple[RunDir, dict[str, dict[str, Any]]]:
    """An image conversation of two turns, a tool conversation of two steps and a text prompt, all_turns."""
    cat = copied_image(path, 24, 16, 1)
    first = user(cat, "What is this?")
    img = [image_record("a-img", 0, [first], "A gradient.", n_turns=2, reasoning="Colours fade.",
                        source_ref="coco-9", image_tokens=6),
           image_record("a-img", 1, [first, {"role": "assistant", "content": "A gradient."}, user("Which colours?")],
                        "Red into green.", n_turns=2, reasoning="Top left is red.", source_ref="coco-9",
                        image_tokens=6)]
    ask = {"role": "user", "content": "Define ox"}
    step = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    result = {"role": "tool", "content": "a bovine animal", "tool_call_id": CALL["id"], "name": "lookup"}
    tool = [image_record("a-tool", 0, [ask], "", n_turns=2, tools=TOOLS, calls=[CALL], finish="tool_calls",
                         reasoning="I should look it up.", source="agent", source_ref="agent-3"),
            image_record("a-tool", 1, [ask, step, result], "An ox is a bovine.", n_turns=2, tools=TOOLS,
                         reasoning="Now I know.", source="agent", source_ref="agent-3")]
    text = [image_record("a-text", 0, [user("Say hello")], "Hello.", source="chat", source_ref="chat-2")]
    return write_run(path, "all_turns", [img + tool, text]), {"cat": cat}
