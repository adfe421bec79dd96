"""Quality flags computed for every record at commit time. Pure and cheap (tens of microseconds for a
2K-token answer): no regexes over the whole text, no tokenizer.

Flags, always in this order:
    truncated           finish_reason == "length"
    truncated_thinking  ... and the output ended inside the thinking: empty content, non-empty reasoning, no call
    context_capped      ... with fewer completion tokens than the request's max_tokens: the context ran out
                        first (vLLM cuts max_tokens to what the context leaves, without an error)
    empty               content and reasoning both blank, and no tool call (a pure tool call, finish_reason
                        `tool_calls`, is an answer: its tokens are in the output ids)
    leaked_think        a `<think>` or `</think>` marker inside content or reasoning_content
                        (the server's reasoning parser did not split the output)
    repetition          a repetition loop in content or reasoning_content, by either rule:
        * tail loop: ignoring the last word (a truncated output may end mid-word), the text ends in
          a run with a period of p words (1 <= p <= 64), covering at least 8 periods and at least
          32 words. So "the same n-gram of >= 4 words repeated >= 8 times in a row at the end",
          where a 1-word loop needs 32 repeats and a 2-word loop 16.
        * line loop: the same non-blank line of at least 8 characters (stripped) appears at least
          5 times in a row, blank lines between them ignored. The length floor keeps code
          (`}`, `end`, `---`) and short list items from counting.
    truncated_call      finish_reason "length", a prompt sent with tools, no tool call and empty content though the output
                        went on after the reasoning (no reasoning, or fewer reasoning tokens than the output's
                        less one): the server's tool-call parser dropped a call cut before its end (SGLang keeps
                        only the text before the call section). Not truncated_thinking then: the thinking ended
    arguments_not_object  a call whose arguments are not a JSON object (not JSON, or another JSON type): a call
                        cut at max_tokens streams its arguments so far; SGLang refuses such arguments in a history
    spliced_other_arguments  all_turns, tool_result_match name: the history of this record holds a cached tool
                        result spliced into a call of the target whose arguments differ from the source's call
"""
from __future__ import annotations

from ..prompts.splice import not_objects

TRUNCATED = "truncated"
TRUNCATED_THINKING = "truncated_thinking"
CONTEXT_CAPPED = "context_capped"
EMPTY = "empty"
LEAKED_THINK = "leaked_think"
REPETITION = "repetition"
TRUNCATED_CALL = "truncated_call"
ARGUMENTS_NOT_OBJECT = "arguments_not_object"
SPLICED_OTHER_ARGUMENTS = "spliced_other_arguments"
QUALITY_FLAGS = (TRUNCATED, TRUNCATED_THINKING, CONTEXT_CAPPED, EMPTY, LEAKED_THINK, REPETITION, TRUNCATED_CALL,
                 ARGUMENTS_NOT_OBJECT, SPLICED_OTHER_ARGUMENTS)

THINK_MARKERS = ("<think>", "</think>")
TAIL_MAX_PERIOD_WORDS = 64
TAIL_MIN_REPEATS = 8
TAIL_MIN_WORDS = 32
LINE_MIN_REPEATS = 5
LINE_MIN_CHARS = 8


def _blank(text: str | None) -> bool:
    return not text or text.isspace()


def has_tail_loop(words: list[str]) -> bool:
    """True if `words` ends in a run of period p covering max(8p, 32) words (see module doc)."""
    n = len(words)
    for period in range(1, TAIL_MAX_PERIOD_WORDS + 1):
        span = max(TAIL_MIN_REPEATS * period, TAIL_MIN_WORDS)
        if span > n:
            return False  # spans only grow with the period
        # words[i] == words[i - period] for every i in the last span - period positions
        start = n - span + period
        i = n - 1
        while i >= start and words[i] == words[i - period]:
            i -= 1
        if i < start:
            return True
    return False


def has_line_loop(text: str) -> bool:
    previous, run = None, 0
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line == previous:
            run += 1
            if run >= LINE_MIN_REPEATS and len(line) >= LINE_MIN_CHARS:
                return True
        else:
            previous, run = line, 1
    return False


def is_repetitive(text: str | None) -> bool:
    if _blank(text):
        return False
    words = text.split()[:-1]  # the last word may be cut mid-token by max_tokens
    return has_tail_loop(words) or has_line_loop(text)


def quality_flags(content: str, reasoning_content: str | None, finish_reason: str,
                  completion_tokens: int | None = None, max_tokens: int | None = None,
                  tool_calls: list | None = None, tools_sent: bool = False,
                  reasoning_tokens: int | None = None) -> list[str]:
    """`completion_tokens` and `max_tokens` (the request's): a length finish short of max_tokens is capped.
    `tool_calls`: the target's calls in this answer (None or empty: it called none); `tools_sent`: the request had
    tools; `reasoning_tokens`: as the server counted them (None: not reported). The record builder adds
    spliced_other_arguments, which the answer alone cannot tell."""
    flags: list[str] = []
    content = content or ""
    cut_call = finish_reason == "length" and tools_sent and not tool_calls and _blank(content) and (
        _blank(reasoning_content) or (completion_tokens is not None and bool(reasoning_tokens)
                                      and completion_tokens > reasoning_tokens + 1))
    if finish_reason == "length":
        flags.append(TRUNCATED)
        if _blank(content) and not _blank(reasoning_content) and not cut_call and not tool_calls:
            flags.append(TRUNCATED_THINKING)  # a call (or a call cut and dropped) comes after the thinking
        if completion_tokens is not None and max_tokens is not None and 0 < completion_tokens < max_tokens:
            flags.append(CONTEXT_CAPPED)
    if _blank(content) and _blank(reasoning_content) and not tool_calls:
        flags.append(EMPTY)
    if any(marker in text for text in (content, reasoning_content or "") for marker in THINK_MARKERS):
        flags.append(LEAKED_THINK)
    if is_repetitive(content) or is_repetitive(reasoning_content):
        flags.append(REPETITION)
    if cut_call:
        flags.append(TRUNCATED_CALL)
    if tool_calls and not_objects(tool_calls):
        flags.append(ARGUMENTS_NOT_OBJECT)
    return flags


# --- what the default exports drop (one definition: export/ and the goodput accounting read these) -----------
def cut_at_max_tokens(record: dict) -> bool:
    """Cut at max_tokens: the conversation export drops it unless --keep-truncated (a token export masks its end)."""
    return record.get("finish_reason") == "length" or TRUNCATED in (record.get("flags") or [])


def lacks_content(record: dict) -> bool:
    """No answer text and no tool call: the conversation export drops it (SpecForge needs non-empty content, or a
    tool-calling step's calls)."""
    return not (record.get("content") or "").strip() and not record.get("tool_calls")


def whole_conversation_cut(turns: list[dict], reason_to_drop) -> tuple[int, str | None]:
    """all_turns, the whole-conversation export: `turns` are one conversation's records in turn order. It keeps
    them up to the first turn dropped or missing (a later turn's history holds that one): returns how many it
    keeps, and why the first one left out is dropped (None: nothing is left out, or a turn is missing there)."""
    for position, record in enumerate(turns):
        if record["turn_index"] != position:
            return position, None
        reason = reason_to_drop(record)
        if reason is not None:
            return position, reason
    return len(turns), None


def default_export_drop(record: dict) -> str | None:
    """Why `regen export --format specforge` with no option drops a record: `truncated_thinking` (cut inside the
    thinking), `truncated` (cut at max_tokens), `empty` (no answer text); None: it is exported."""
    if cut_at_max_tokens(record):
        return TRUNCATED_THINKING if TRUNCATED_THINKING in (record.get("flags") or []) else TRUNCATED
    if lacks_content(record):
        return EMPTY
    return None
