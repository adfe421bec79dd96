"""Explicit Arrow schemas of everything a run writes. Bump SCHEMA_VERSION when a column is added (or retired), and
name the column in RECORDS_ADDED (or RECORDS_RETIRED): a run keeps the schema it was created with (run.json
`schema_version`), so every part of one run has the same columns and `datasets.load_dataset` reads them as one
table; added columns are nullable, and a retired column stays (null) in the runs created before it was retired."""
from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 6  # 2: `deterministic`; 3: `engine`, `engine_version`; 4: no `hidden_part`, `hidden_row`;
# 5: tool calls (`tools`, `tool_calls`, the MESSAGE struct's tool fields), `sample_index`, `conversation_end`;
# 6: content parts (MESSAGE6: a message's content a string or a list of PARTs: images, text parts), `source_ref`
RECORDS_ADDED = {"deterministic": 2, "engine": 3, "engine_version": 3,  # column -> the version that added it
                 "tools": 5, "tool_calls": 5, "sample_index": 5, "conversation_end": 5, "source_ref": 6}
TOOLS_VERSION = 5  # the first records schema that can store a prompt with tools
IMAGES_VERSION = 6  # the first records schema that can store a prompt whose content is a list of parts (images)
SAMPLES_VERSION = 5  # the first records schema with `sample_index` (samples_per_prompt > 1)
# column -> the first version without it. hidden_part/hidden_row named the generating request's hidden parts (a
# route retired for `regen capture`, whose ledger names its own parts): null in every row regen writes now.
RECORDS_RETIRED = {"hidden_part": 4, "hidden_row": 4}

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])  # records schemas 1-4
# Records schema 5 and the prompt set: a message with its tool fields, null where absent (a tool-free message has
# role and content only). `tool_calls`: canonical JSON text of the assistant step's calls (OpenAI objects, each
# `arguments` a JSON string); `tool_call_id`, `name`: a tool result's call and the tool called. `content` is null
# for a pure call.
TOOL_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.string()),
                          ("tool_call_id", pa.string()), ("name", pa.string())])
# A content part (core/images.py): `{"type": "text", "text"}` or `{"type": "image", "sha256", "media_type",
# "width", "height", "bytes"}` + `path` (images.store: reference); a key a part does not have is null.
PART = pa.struct([("type", pa.string()), ("text", pa.string()), ("sha256", pa.string()),
                  ("media_type", pa.string()), ("width", pa.int32()), ("height", pa.int32()),
                  ("bytes", pa.int64()), ("path", pa.string())])
# Records schema 6 and the prompt set: TOOL_MESSAGE with `parts`. A message's content is either `content` (a
# string; `parts` null: every text prompt, stored as before) or `parts` (`content` null); both null: a pure call.
MESSAGE6 = pa.struct([("role", pa.string()), ("content", pa.string()), ("parts", pa.list_(PART)),
                      ("tool_calls", pa.string()), ("tool_call_id", pa.string()), ("name", pa.string())])

# The materialised prompt set. `tools`, `reference_tool_calls` and the messages' tool fields came with issue 22,
# MESSAGE6 messages and `images` with issue 28; an older prompt set (MESSAGE or TOOL_MESSAGE messages, no tools or
# images columns) still reads: readers take what is there.
PROMPTS = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("source", pa.string()),
        ("origin", pa.string()),
        ("source_ref", pa.string()),
        ("messages", pa.list_(MESSAGE6)),
        ("reference", pa.string()),  # the text of the source's final assistant step (last_turn)
        ("reference_tool_calls", pa.string()),  # that step's calls, canonical JSON; null: it called none
        ("tools", pa.string()),  # canonical JSON of the OpenAI tools list; null: the prompt has none
        # The routing key (core/work.py affinity_key, tools included) for the prefix length in the schema's
        # metadata (prompt_reader.ROUTE_CHARS); a set staged without it has it computed when a run reads it.
        ("route_key", pa.uint64()),
        # The prompt's image parts (0: none): status counts image prompts from it, never reading an image.
        ("images", pa.int32()),
    ]
)

_EVERY_RECORD_COLUMN = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("turn_index", pa.int32()),  # which assistant turn of the conversation this row regenerated (0-based)
        ("n_turns", pa.int32()),  # assistant turns regenerated for this prompt (all_turns: the whole conversation)
        ("source", pa.string()),
        ("messages", pa.list_(MESSAGE)),  # exactly what was sent (5: TOOL_MESSAGE, 6: MESSAGE6; records_schema)
        ("reference", pa.string()),  # the source's original final assistant turn, if any
        # The tools sent with the request (canonical JSON of the list; null: none).
        ("tools", pa.string()),
        ("content", pa.string()),
        ("reasoning_content", pa.string()),
        ("finish_reason", pa.string()),
        # The target's calls in this row (canonical JSON list of OpenAI calls, `arguments` JSON strings; null: none).
        ("tool_calls", pa.string()),
        ("flags", pa.list_(pa.string())),  # quality flags: truncated, empty, leaked_think, repetition
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("cached_tokens", pa.int32()),
        ("reasoning_tokens", pa.int32()),
        ("endpoint", pa.string()),
        ("model", pa.string()),  # as reported by the server
        ("weight_version", pa.string()),
        ("config_fingerprint", pa.string()),
        ("latency_s", pa.float64()),
        ("attempts", pa.int32()),
        ("seed", pa.int64()),
        # The endpoint ran --enable-deterministic-inference (SGLang ignores the seed without it); null: unknown.
        ("deterministic", pa.bool_()),
        # The endpoint's inference engine (sglang, vllm, llamacpp; "openai": not identified) and its version.
        ("engine", pa.string()),
        ("engine_version", pa.string()),
        ("request_id", pa.string()),
        # Exact token ids from the server, null where it cannot give them (e.g. llama.cpp).
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("output_token_ids", pa.list_(pa.int32())),
        # Retired (RECORDS_RETIRED): the generating request's hidden part under hidden/ and the row in it.
        ("hidden_part", pa.string()),
        ("hidden_row", pa.int32()),
        ("created_at", pa.timestamp("ms", tz="UTC")),
        # samples_per_prompt k > 1: which sample of the prompt this row belongs to (0..k-1); null in a run of one
        # sample (readers take null as 0). Its unit of work is `<prompt_id>#s<j>` for j > 0 (core/work.py).
        ("sample_index", pa.int32()),
        # all_turns: on the last row of a conversation cut short, why and at which step; null otherwise.
        ("conversation_end", pa.string()),
        # The source's own id of the prompt (the prompt set's `source_ref`: the first source's, when several held
        # it); null where the source has none.
        ("source_ref", pa.string()),
    ]
)

# RUN/capture/hidden/part-*.parquet, written by a capture actor before the ledger row that references it. A sample
# is `n_chunks` consecutive rows (one row group each, so the Parquet writer never holds a whole 4K-token matrix
# twice); `hidden_row` of the ledger row is its first row, which also holds `token_ids`. Concatenated, the
# chunks' `hidden` bytes are bf16 row-major [n_rows, width]: row t holds the states after feeding token t of
# `token_ids` (prompt + completion), so n_rows = len(token_ids).
HIDDEN = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("turn_index", pa.int32()),
        ("chunk", pa.int32()),
        ("n_chunks", pa.int32()),
        ("token_ids", pa.list_(pa.int32())),  # on chunk 0; empty on the others
        ("n_prompt", pa.int32()),
        ("n_rows", pa.int32()),  # of the whole sample
        ("width", pa.int32()),
        ("dtype", pa.string()),  # "bf16": little-endian bfloat16 bit patterns
        ("hidden", pa.large_binary()),
    ]
)

# RUN/capture/data/part-*.parquet: the capture's ledger, one row per captured sample (an exported record or turn,
# `sample_id` the token exports' id). All samples of one prompt are committed together, after the actor has
# committed the hidden part that holds them (RUN/capture/hidden/, layout `HIDDEN` with T rows for T tokens).
CAPTURE = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("turn_index", pa.int32()),
        ("sample_id", pa.string()),
        ("n_tokens", pa.int32()),
        ("n_prompt", pa.int32()),
        ("finish_reason", pa.string()),
        ("hidden_part", pa.string()),
        ("hidden_row", pa.int32()),
        ("actor", pa.string()),
        ("capture_s", pa.float64()),  # the route's own time for this sample (the forward pass, or the request)
        ("capture_fingerprint", pa.string()),
        ("created_at", pa.timestamp("ms", tz="UTC")),
    ]
)

FAILURES = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("source", pa.string()),
        ("error_class", pa.string()),
        ("status", pa.int32()),
        ("message", pa.string()),  # the server's own message
        ("endpoint", pa.string()),
        ("attempts", pa.int32()),
        ("config_fingerprint", pa.string()),
        ("created_at", pa.timestamp("ms", tz="UTC")),
    ]
)

REJECTS = pa.schema(
    [
        ("source", pa.string()),
        ("origin", pa.string()),  # names the record: file:line or dataset[split]#row
        ("reason", pa.string()),
        ("raw", pa.string()),
        ("code", pa.string()),  # the reason's RejectCode (null in rejects written by older code)
    ]
)


def records_schema(version: int | None) -> pa.Schema:
    """The record columns of a run created at schema `version` (runs from before versions were kept are 1)."""
    version = version or 1
    fields = [f for f in _EVERY_RECORD_COLUMN
              if RECORDS_ADDED.get(f.name, 1) <= version < RECORDS_RETIRED.get(f.name, version + 1)]
    message = MESSAGE6 if version >= IMAGES_VERSION else TOOL_MESSAGE if version >= TOOLS_VERSION else MESSAGE
    fields = [pa.field("messages", pa.list_(message)) if f.name == "messages" else f for f in fields]
    return pa.schema(fields)


RECORDS = records_schema(SCHEMA_VERSION)  # what a new run writes
