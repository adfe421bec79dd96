"""ShareGPT as it is in the wild (issue 17): role aliases, leading assistant turns, blank system messages, a BOM,
NUL characters, a huge message, max_prompt_tokens, and a source with no valid prompt. Exact counts."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import orjson
import pytest

from pipeline.prompts.errors import NoValidPrompts
from pipeline.prompts.prompt_set import build_prompt_set, normalise
from pipeline.prompts.records import InvalidRecord
from pipeline.prompts.sources import SourceSpec
from pipeline.prompts.tokens import load_length_check

HUGE = "word " * 60_000  # 300,000 characters in one message


def m(role: str, text: str) -> dict:
    return {"from": role, "value": text}


WILD = [
    {"id": "aliases", "conversations": [m("human", "Hi, who are you?"), m("chatgpt", "A model."), m("user", "And?"),
                                        m("bing", "Search."), m("Human", "Bard?"), m("bard", "Also.")]},
    {"id": "leading", "conversations": [m("gpt", "Hello! How can I help?"), m("gpt", "Anyone?"),
                                        m("human", "What is 2+2?"), m("gpt", "4")]},
    {"id": "blank-system", "conversations": [m("system", ""), m("human", "Name a colour.")]},
    {"id": "space-system", "conversations": [m("system", " \n\t"), m("human", "Name a fruit."), m("gpt", "Fig.")]},
    {"id": "nul", "conversations": [m("human", "Qu\u0000estion with a NUL?")]},
    {"id": "huge", "conversations": [m("human", HUGE), m("gpt", "That is a lot of words.")]},
    {"id": "only-assistant", "conversations": [m("gpt", "I talk to myself."), m("gpt", "Still me.")]},
    {"id": "raw-nul", "conversations": [m("human", "RAWNUL here?")]},
]


def encode_wild(kind: str) -> bytes:
    """The rows as a BOM-prefixed file, with a raw NUL byte (invalid in JSON text) inside one string."""
    if kind == "jsonl":
        body = b"".join(orjson.dumps(r) + b"\n" for r in WILD)
    else:
        body = json.dumps(WILD, indent=2).encode()
    return b"\xef\xbb\xbf" + body.replace(b"RAWNUL", b"RAW\x00NUL")


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_sharegpt_in_the_wild_with_exact_counts(tmp_path, kind):
    f = tmp_path / f"wild.{kind}"
    f.write_bytes(encode_wild(kind))
    ps = build_prompt_set([(SourceSpec("wild", kind, str(f), "sharegpt", id_field="id"), None)])
    (r,) = ps.reports
    assert (r.read, r.valid, r.rejected, r.selected, r.duplicates) == (8, 7, 1, 7, 0)
    assert r.rejected_by_reason == {"no_user_turn": 1}
    assert r.dropped_turns == {"leading_assistant": 2, "blank_system": 2}, "only kept records' turns count"
    assert r.nul_removed == 2  # one escaped \u0000 in a string, one raw byte in the file
    by_id = {p.source_ref: p for p in ps.prompts}
    assert [x["role"] for x in by_id["aliases"].messages] == ["user", "assistant", "user", "assistant", "user"]
    assert by_id["aliases"].reference == "Also."
    assert by_id["leading"].messages == ({"role": "user", "content": "What is 2+2?"},) and \
        by_id["leading"].reference == "4"
    assert by_id["blank-system"].messages == ({"role": "user", "content": "Name a colour."},)
    assert by_id["nul"].messages[0]["content"] == "Question with a NUL?"
    assert by_id["raw-nul"].messages[0]["content"] == "RAWNUL here?"
    assert len(by_id["huge"].messages[0]["content"]) == len(HUGE.strip()), "a huge message is kept as it is"


def test_blank_system_message_was_a_reject_and_is_now_dropped():
    # Regression: `{"from": "system", "value": ""}` rejected the whole record as blank_content.
    conversation = [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."}]
    assert normalise(conversation) == (({"role": "user", "content": "Hi"},), "Hello.")
    dropped: dict[str, int] = {}
    normalise([{"role": "system", "content": " \n"}] + conversation, dropped=dropped)
    assert dropped == {"blank_system": 2}


def test_a_blank_reference_is_dropped_under_last_turn_but_a_blank_sent_turn_rejects():
    # Regression: a blank last assistant turn (the reference a new answer replaces) rejected the whole record.
    sent = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "Q2"}]
    dropped: dict[str, int] = {}
    assert normalise(sent + [{"role": "assistant", "content": " "}], dropped=dropped) == (tuple(sent), None)
    assert dropped == {"blank_reference": 1}
    blank_history = [sent[0], {"role": "assistant", "content": ""}, sent[2], {"role": "assistant", "content": "A2"}]
    with pytest.raises(InvalidRecord, match="message 2 \\(assistant\\) is blank") as exc:
        normalise(blank_history)  # it would be sent as the context of the turn regenerated
    assert exc.value.code.value == "blank_content"
    with pytest.raises(InvalidRecord, match="message 4 \\(assistant\\) is blank"):
        normalise(sent + [{"role": "assistant", "content": ""}], mode="all_turns")


def tiny_tokenizer(folder: Path) -> Path:
    """A real Hugging Face tokenizer, built here: one token per whitespace-separated word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "word": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(folder))
    return folder


def test_max_prompt_tokens_rejects_a_huge_prompt_before_sending(tmp_path):
    pytest.importorskip("transformers")
    f = tmp_path / "wild.jsonl"
    f.write_bytes(encode_wild("jsonl"))
    check = load_length_check(1000, str(tiny_tokenizer(tmp_path / "tok")))
    assert check is not None
    ps = build_prompt_set([(SourceSpec("wild", "jsonl", str(f), "sharegpt", id_field="id"), None)],
                          length_check=check)
    (r,) = ps.reports
    assert (r.read, r.valid, r.rejected, r.selected) == (8, 6, 2, 6)
    assert r.rejected_by_reason == {"no_user_turn": 1, "prompt_too_long": 1}
    (too_long,) = [x for x in ps.rejects if x.code == "prompt_too_long"]
    assert "60,000 tokens" in too_long.reason and "max_prompt_tokens 1,000" in too_long.reason
    assert check.tokenized == 1, "short prompts fit by their byte length and are never tokenized"


def test_max_prompt_tokens_without_a_tokenizer_keeps_the_prompt_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="regen"):
        assert load_length_check(1000, str(tmp_path / "no-such-tokenizer")) is None
    assert any("no tokenizer could be loaded" in r.getMessage() for r in caplog.records)


def test_a_source_with_no_valid_prompt_is_an_error_naming_its_three_commonest_reasons(tmp_path):
    rows = ([{"conversations": [m("human", "a"), m("human", "b")]}] * 5
            + [{"conversations": [m("human", "   ")]}] * 3 + [{"messages": []}] * 2 + [["not a record"]])
    f = tmp_path / "wrong.jsonl"
    f.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    with pytest.raises(NoValidPrompts) as exc:
        build_prompt_set([(SourceSpec("wrong", "jsonl", str(f), "sharegpt"), None)])
    text = str(exc.value)
    assert "source 'wrong' has no valid prompt: all 11 records were rejected" in text
    assert exc.value.top_reasons[0][:2] == ("roles_not_alternating", 5)
    assert [code for code, _, _ in exc.value.top_reasons] == ["roles_not_alternating", "blank_content",
                                                               "missing_field"]
    assert "not_object" not in text and "Nothing was written" in text
