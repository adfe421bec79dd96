"""What a reader produces: raw records, and rejects with their reason. No dependencies: every module of the
prompts stage uses these."""
from __future__ import annotations

from dataclasses import dataclass
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


class InvalidRecord(ValueError):
    """A record that cannot become a prompt. `reason` is a sentence meant for a human."""

    def __init__(self, code: RejectCode, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


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
