"""What a reader produces: raw records, and rejects with their reason. No dependencies: every module of the
prompts stage uses these."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

RAW_MAX_CHARS = 2000


class RejectCode(str, Enum):
    """Why a record was rejected, for code and counts; the human sentence is `reason`."""

    BAD_JSON = "bad_json"
    NOT_OBJECT = "not_object"
    MISSING_FIELD = "missing_field"
    BAD_CONVERSATION = "bad_conversation"  # the conversation field is not a list
    BAD_MESSAGE = "bad_message"  # a message is not an object or lacks its role/content key
    EMPTY = "empty_conversation"
    NO_USER_TURN = "no_user_turn"
    NON_STRING_CONTENT = "non_string_content"
    BLANK_CONTENT = "blank_content"
    UNKNOWN_ROLE = "unknown_role"
    NOT_ALTERNATING = "roles_not_alternating"
    SYSTEM_NOT_FIRST = "system_not_first"
    NOTHING_TO_SEND = "nothing_to_send"
    TOO_LONG = "prompt_too_long"  # over max_prompt_tokens, counted with the target's tokenizer
    # tool calling (docs/sources-tool-calls.md)
    TOOL_RESULT_WITHOUT_CALL = "tool_result_without_call"  # a tool result with no unanswered call before it
    MISSING_TOOL_RESULT = "missing_tool_result"  # a call whose result never comes, with more conversation after it
    TOOL_RESULT_MISMATCH = "tool_result_mismatch"  # a result whose id or name answers none of the step's calls
    # a result whose id names one call and whose name another tool, or a second result for a call that has one
    TOOL_RESULT_CONTRADICTION = "tool_result_contradiction"
    ARGUMENTS_NOT_JSON = "arguments_not_json"  # a call's arguments (or a Hermes <tool_call>) are not JSON
    ARGUMENTS_NOT_OBJECT = "arguments_not_object"  # JSON, but not an object of named arguments
    BAD_TOOL_CALL = "bad_tool_call"  # a call that is not an object, or has no function name
    DUPLICATE_CALL_ID = "duplicate_call_id"  # two calls of one step share an id: their results cannot be told apart
    BAD_TOOLS = "bad_tools"  # the tools list (a column, or a Hermes <tools> block) cannot be read
    # images (docs/sources.md, section Images); each reason names the record and the image as the source wrote it
    IMAGE_MISSING = "image_missing"  # no file there (or a placeholder with no image to fill it)
    IMAGE_UNREADABLE = "image_unreadable"  # permissions, a folder, a truncated or corrupt file, bad base64
    NOT_AN_IMAGE = "not_an_image"  # Pillow cannot identify it
    IMAGE_FORMAT = "image_format"  # an image, but not a format sent (core/images.py MEDIA_TYPES), or animated
    IMAGE_OUTSIDE_ROOT = "image_outside_root"  # a local path resolving (`..`, symlinks) outside image_root
    IMAGE_MARKER_MISMATCH = "image_marker_mismatch"  # more or fewer <image> markers than the record has images
    IMAGE_TOO_LARGE = "image_too_large"  # over images.max_bytes or images.max_pixels (decompression bombs)
    TOO_MANY_IMAGES = "too_many_images"  # over images.max_per_prompt
    REMOTE_IMAGE = "remote_image"  # an http(s) image refused (images.remote: refuse), not fetched, or failing
    IMAGE_IN_ASSISTANT_TURN = "image_in_assistant_turn"  # an assistant turn is what the target writes: text only
    # content parts of a kind regen does not carry: never sent as text, each counted under its own code
    VIDEO_PART = "video_part"  # video_url, video: out of scope
    AUDIO_PART = "audio_part"  # input_audio, audio_url, audio
    FILE_PART = "file_part"  # file, input_file
    UNKNOWN_PART = "unknown_part"  # any other part type (the reason names it)


# the codes whose reason names the record (its origin) as well as the image or part: prompt_set.py prefixes it
IMAGE_CODES = frozenset({
    RejectCode.IMAGE_MISSING, RejectCode.IMAGE_UNREADABLE, RejectCode.NOT_AN_IMAGE, RejectCode.IMAGE_FORMAT,
    RejectCode.IMAGE_OUTSIDE_ROOT, RejectCode.IMAGE_MARKER_MISMATCH, RejectCode.IMAGE_TOO_LARGE,
    RejectCode.TOO_MANY_IMAGES, RejectCode.REMOTE_IMAGE, RejectCode.IMAGE_IN_ASSISTANT_TURN, RejectCode.VIDEO_PART,
    RejectCode.AUDIO_PART, RejectCode.FILE_PART, RejectCode.UNKNOWN_PART})


class InvalidRecord(ValueError):
    """A record that cannot become a prompt. `reason` is a sentence meant for a human."""

    def __init__(self, code: RejectCode, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason

    def reason_of(self, origin: str) -> str:
        """The reason as a reject gives it: an image's or a part's names the record first."""
        return f"{origin}: {self.reason}" if self.code in IMAGE_CODES else self.reason


@dataclass
class Tally:
    """What normalising one record counted (merged into its source's report only if the record is kept).

    dropped: turns and characters taken out (leading_assistant, blank_system, blank_reference, nul, ...).
    changed: messages (or text parts) whose text was changed (whitespace_stripped, unicode_nfc): system, user and
    assistant text only; a tool result is sent as the source wrote it (docs/sources-tool-calls.md).
    uncarried: fields of the record that regen does not carry, by name (`record.KEY`, `message.KEY`,
    `tool_call.KEY`): the no-silent-drop rule of the readers.
    tools: tool-calling counts (tool_calls, tool_results, made_call_ids, calls_without_schema, ...).
    images: image counts (images, prompts_with_images, image_bytes, by where they came from; docs/sources.md)."""

    dropped: dict[str, int] = field(default_factory=dict)
    changed: dict[str, int] = field(default_factory=dict)
    uncarried: dict[str, int] = field(default_factory=dict)
    tools: dict[str, int] = field(default_factory=dict)
    images: dict[str, int] = field(default_factory=dict)
    # top-level fields not carried that look like tool schemas (schema_dialect.py looks_like_tools), by name
    tool_like: dict[str, int] = field(default_factory=dict)
    # one-prompt fields whose text reads as a whole conversation (transcript.py looks_like_transcript), by name
    transcripts: dict[str, int] = field(default_factory=dict)

    def drop(self, kind: str, n: int = 1) -> None:
        self.dropped[kind] = self.dropped.get(kind, 0) + n

    def change(self, kind: str, n: int = 1) -> None:
        self.changed[kind] = self.changed.get(kind, 0) + n

    def uncarry(self, name: str, n: int = 1) -> None:
        self.uncarried[name] = self.uncarried.get(name, 0) + n

    def tool(self, kind: str, n: int = 1) -> None:
        self.tools[kind] = self.tools.get(kind, 0) + n

    def image(self, kind: str, n: int = 1) -> None:
        self.images[kind] = self.images.get(kind, 0) + n


@dataclass(frozen=True)
class Reject:
    source: str
    origin: str
    reason: str
    raw: str  # the record text, truncated to RAW_MAX_CHARS
    code: str = ""  # a RejectCode value


@dataclass(frozen=True)
class RawRecord:
    source: str
    origin: str  # "sample/sharegpt.jsonl:17", "data.parquet#3", "HuggingFaceH4/ultrachat_200k[train_sft]#1234"
    data: Any
