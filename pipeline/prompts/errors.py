"""Why a source cannot become prompts. Each error is one line for the user: the source, the cause, what to do.

`read_error` is the one place that maps an exception raised while opening or reading a source to its cause,
by the exception's type (never by its text), as `endpoints/classify.py: classify` does for HTTP.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import ConfigError

LOCAL_COPY_HINT = "download it and point the spec's `path` at the local copy (a file or a folder)"


class SourceError(ConfigError):
    """A source cannot be read (missing file, permission, unreachable hub, wrong kind, broken file)."""

    def __init__(self, source: str, cause: str, hint: str = ""):
        self.source, self.cause, self.hint = source, cause, hint
        super().__init__(f"source {source!r}: {cause}" + (f"; {hint}" if hint else ""))


class TruncatedSource(SourceError):
    """A file ends (or stops being valid JSON) in the middle of a record, and the spec has no `salvage: true`."""

    def __init__(self, source: str, file: str, cut: "Cut"):
        self.file, self.cut = file, cut
        # one count in both halves of the message: records 1 to N are complete (no zero-based index beside it)
        where = ((f"its {cut.records_kept:,} complete records end" if cut.records_kept != 1 else
                  "its 1 complete record ends") + f" at byte {cut.offset:,}" if cut.records_kept else
                 "it holds no complete record")
        super().__init__(source, f"{file} {cut.problem} at byte {cut.error_at:,} of {cut.size:,}: {where}",
                         f"nothing was run. Fix the file, or add `salvage: true` to the source spec to keep the "
                         f"{cut.records_kept:,} complete records and {cut.what_is_dropped}")


_SHAPE = "check the spec's kind, format and field (`regen validate` shows what the records look like)"
_TOOLS = ("the records' tool calls do not line up with their results (docs/sources-tool-calls.md says what a "
          "valid tool-calling conversation is)")
# The advice for the most common reject reason (a RejectCode value).
REJECT_HINTS = {
    "bad_json": "the file is not JSON Lines (or `kind` is wrong)",
    "not_object": _SHAPE, "missing_field": _SHAPE, "bad_conversation": _SHAPE, "bad_message": _SHAPE,
    "unknown_role": _SHAPE + "; the roles regen reads are listed in docs/sources-tool-calls.md",
    "non_string_content": "the contents are neither text nor lists of content parts",
    "roles_not_alternating": "the turns are not in conversation order (user, then assistant, ...)",
    "system_not_first": "a system message may only come first",
    "empty_conversation": "the conversations are empty", "blank_content": "the messages are blank",
    "no_user_turn": "the conversations have no user turn", "nothing_to_send": "the conversations hold only a "
                                                                              "system message",
    "prompt_too_long": "the prompts are longer than max_prompt_tokens: raise it, or pick shorter records",
    "tool_result_without_call": _TOOLS, "missing_tool_result": _TOOLS, "tool_result_mismatch": _TOOLS,
    "duplicate_call_id": _TOOLS,
    "tool_result_contradiction": "the records' tool results name one call by id and another by tool name",
    "arguments_not_json": "the tool calls' arguments are not JSON objects",
    "arguments_not_object": "the tool calls' arguments are not JSON objects",
    "bad_tool_call": "the tool calls have no function name", "bad_tools": "the records' tools lists cannot be read",
    "image_missing": "the images are not where the records say: set the spec's `image_root` to the folder that holds "
                     "them (docs/sources.md, section Images)",
    "image_outside_root": "the images resolve outside the source's image folder: set `image_root` to the folder "
                          "that holds them",
    "image_unreadable": "the image files cannot be read (permissions, or cut short)",
    "not_an_image": "the image references do not hold images", "image_format": "the images are in a format not "
                                                                              "sent (or animated)",
    "image_too_large": "the images are over images.max_bytes or images.max_pixels",
    "image_marker_mismatch": "the <image> markers do not match the records' images (check `image_field`)",
    "too_many_images": "the prompts hold more images than images.max_per_prompt",
    "remote_image": "the http(s) images cannot be fetched (or images.remote is refuse)",
    "image_in_assistant_turn": "the records hold images in assistant turns",
    "video_part": "the records hold video, which is out of scope", "audio_part": "the records hold audio",
    "file_part": "the records hold files", "unknown_part": "the records hold content parts regen does not read",
}


class NoValidPrompts(ConfigError):
    """A source gave no prompt at all: a run of it would do nothing and call itself complete. The hint follows
    the most common reason."""

    def __init__(self, source: str, read: int, top_reasons: list[tuple[str, int, str]]):
        self.source, self.read, self.top_reasons = source, read, top_reasons
        if not read:
            detail = "it holds no records"
        else:
            reasons = "; ".join(f"{code} {count:,} (e.g. {example})" for code, count, example in top_reasons)
            detail = f"all {read:,} records were rejected; the most common reasons: {reasons}"
        hint = REJECT_HINTS.get(top_reasons[0][0], _SHAPE) if read and top_reasons else _SHAPE
        super().__init__(f"source {source!r} has no valid prompt: {detail}. "
                         f"Nothing was written to the run directory; {hint}")


@dataclass(frozen=True)
class Cut:
    """Where a file stops being readable JSON: what was kept before it and what was dropped after it."""

    file: str
    offset: int  # the byte just after the last complete record
    records_kept: int
    size: int
    error_at: int  # where the parser gave up (the end of the file when it is cut short)
    truncated: bool  # True: the file ends early; False: invalid JSON before the end
    unclosed: bool = False  # cut right after a complete record: only separators or closing brackets follow it

    @property
    def bytes_dropped(self) -> int:
        return self.size - self.offset

    @property
    def problem(self) -> str:
        if self.unclosed:
            return "ends right after a complete record, without its closing brackets"
        return "ends in the middle of a record" if self.truncated else "is not valid JSON"

    @property
    def what_is_dropped(self) -> str:
        if self.unclosed:
            return "lose nothing of a record" + (f" (the last {self.bytes_dropped:,} bytes are separators)"
                                                if self.bytes_dropped else "")
        return f"drop the last {self.bytes_dropped:,} bytes"

    def as_dict(self) -> dict[str, object]:
        return {"file": self.file, "offset": self.offset, "records_kept": self.records_kept,
                "bytes_dropped": self.bytes_dropped, "size": self.size, "problem": self.problem,
                "unclosed": self.unclosed}


def read_error(source: str, exc: BaseException, what: str) -> SourceError:
    """The SourceError for an exception raised while opening or reading `what` (a file or a dataset)."""
    if isinstance(exc, SourceError):
        return exc
    hub = _hub_cause(exc)
    if hub is not None:
        return SourceError(source, f"cannot load {what} from the Hugging Face hub: {hub}", LOCAL_COPY_HINT)
    if isinstance(exc, FileNotFoundError):
        return SourceError(source, f"{what} is missing ({_detail(exc)})",
                           "check `path` (a relative path is read from the spec file's folder)")
    if isinstance(exc, PermissionError):
        return SourceError(source, f"{what}: permission denied ({_detail(exc)})", "make it readable by this user")
    if isinstance(exc, IsADirectoryError):
        return SourceError(source, f"{what} is a folder, not a file", "name a file or a glob, or use kind: hf")
    if isinstance(exc, UnicodeDecodeError):
        return SourceError(source, f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})")
    if isinstance(exc, OSError):
        return SourceError(source, f"cannot read {what}: {_detail(exc)}")
    return SourceError(source, f"cannot read {what}: {type(exc).__name__}: {_detail(exc)}")


def _detail(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _hub_cause(exc: BaseException) -> str | None:
    """The cause of a hub failure, from the exception's type (and the types it was raised from)."""
    try:
        from huggingface_hub import errors as hub_errors
    except ImportError:  # pragma: no cover - datasets depends on huggingface_hub
        return None
    chain = []
    current: BaseException | None = exc
    while current is not None and len(chain) < 8:
        chain.append(current)
        current = current.__cause__ or current.__context__
    for error in chain:
        if isinstance(error, hub_errors.OfflineModeIsEnabled):
            return "offline mode is on (HF_HUB_OFFLINE) and the dataset is not in the local cache"
        if isinstance(error, (hub_errors.GatedRepoError,)):
            return "the dataset is gated: accept its terms on the hub and log in (hf auth login)"
        if isinstance(error, hub_errors.RepositoryNotFoundError):
            return "no such dataset on the hub (or it is private)"
        if isinstance(error, hub_errors.LocalEntryNotFoundError):
            return "the hub is unreachable and the dataset is not in the local cache"
    try:
        from datasets.exceptions import DatasetNotFoundError
    except ImportError:  # pragma: no cover
        DatasetNotFoundError = ()  # type: ignore[assignment]
    if DatasetNotFoundError and isinstance(exc, DatasetNotFoundError):
        return "no such dataset on the hub (or it is private or gated)"
    if isinstance(exc, ConnectionError) or any(isinstance(e, hub_errors.HfHubHTTPError) for e in chain):
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            return "offline mode is on (HF_HUB_OFFLINE) and the dataset is not in the local cache"
        return "the hub is unreachable"
    return None
