"""A whole conversation written into one prompt text (`transcript_in_one_message`), counted by field.

glaive-function-calling-v2 writes each conversation as one string: `chat` = "USER: ...\n\n\nASSISTANT: <functioncall>
{...} <|endoftext|>\n\n\nFUNCTION RESPONSE: {...}\n\n\nASSISTANT: ...\n\n\nUSER: And to JPY?". Read with
`format: prompt, field: chat` (or as an alpaca `instruction`, a `question`), the whole transcript becomes one user
message. regen does not parse such text into turns (every dataset writes its own); it sends it as it stands, and
counts it, so the run does not do so without a word.

The definition (`looks_like_transcript`): the text has a line that begins with a user-role marker and a line that
begins with an assistant-role marker of the same family (a line begins at the start of the text or after "\n"),
case-sensitive, as the datasets write them:

  USER: / ASSISTANT: (or glaive's FUNCTION RESPONSE:)   glaive-function-calling-v2, Vicuna
  Human: / Assistant:                                   Anthropic HH-RLHF
  ### Human: / ### Assistant:                           OpenAssistant Guanaco
  <|im_start|>user / <|im_start|>assistant              ChatML
  <|user|> / <|assistant|>                              Zephyr, Tulu

A prompt that only names a role ("USER: hello", "the assistant said") is not one. Cheap first: the precise check
runs only on a text holding a newline and an assistant-side marker at the start of a line (one `in` test and one
regex scan whose literal "\n" prefix the engine searches for), so a prompt source pays about two microseconds a
kilobyte of prompt (docs/sources.md, section A conversation in one prompt text).
"""
from __future__ import annotations

import re
from typing import Any

# (user-role markers, assistant-side markers) of one family; each must begin a line
FAMILIES: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("USER:",), ("ASSISTANT:", "FUNCTION RESPONSE:")),
    (("Human:",), ("Assistant:",)),
    (("### Human:",), ("### Assistant:",)),
    (("<|im_start|>user",), ("<|im_start|>assistant",)),
    (("<|user|>",), ("<|assistant|>",)),
)
_ANY_ASSISTANT = tuple(marker for _, assistant in FAMILIES for marker in assistant)
# an assistant-side marker after a newline: one scan (the regex engine looks for its "\n" prefix, then the markers)
_ASSISTANT_LINE = re.compile("\n(?:" + "|".join(re.escape(marker) for marker in _ANY_ASSISTANT) + ")")


def _begins_a_line(text: str, marker: str) -> bool:
    return text.startswith(marker) or ("\n" + marker) in text


def transcript_markers(value: Any) -> tuple[str, str] | None:
    """(the user marker, the assistant-side marker) that make `value` a transcript in one text; None: it is not
    one (or not a string)."""
    if not isinstance(value, str) or "\n" not in value:
        return None
    if not value.startswith(_ANY_ASSISTANT) and _ASSISTANT_LINE.search(value) is None:
        return None
    for users, assistants in FAMILIES:
        user = next((m for m in users if _begins_a_line(value, m)), None)
        if user is None:
            continue
        assistant = next((m for m in assistants if _begins_a_line(value, m)), None)
        if assistant is not None:
            return user, assistant
    return None


def looks_like_transcript(value: Any) -> bool:
    return transcript_markers(value) is not None
