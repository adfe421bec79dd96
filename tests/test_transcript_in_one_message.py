"""A whole conversation in one prompt text (walk of issue 31): glaive-function-calling-v2 writes each conversation as
one `chat` string ("USER: ... ASSISTANT: <functioncall> ... FUNCTION RESPONSE: ... USER: And to JPY?"). Read with
`format: prompt, field: chat` it is one user message; regen sends it as it stands (what is sent and the prompt ids do
not change) but counts it by field, `regen validate` warns, and generate's report (its log, `regen status`) says it."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.cli import main as regen_main
from pipeline.core.config import load_config
from pipeline.prompts.report import report_lines
from pipeline.prompts.transcript import looks_like_transcript, transcript_markers
from pipeline.store.promptset import report_document, stage_prompt_set

SYSTEM = ("SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
          '{\n    "name": "get_exchange_rate",\n    "parameters": {"type": "object", "properties": {}}\n}')
CHATS = [
    'USER: What is the exchange rate from USD to EUR?\n\n\nASSISTANT: <functioncall> {"name": "get_exchange_rate", '
    '"arguments": \'{"base_currency": "USD", "target_currency": "EUR"}\'} <|endoftext|>\n\n\nFUNCTION RESPONSE: '
    '{"exchange_rate": 0.85}\n\n\nASSISTANT: The current exchange rate is 0.85. <|endoftext|>\n\n\nUSER: And to JPY?',
    "USER: Can you book a flight for me?\n\n\nASSISTANT: I'm sorry, I cannot book flights. <|endoftext|>\n\n\n",
    "USER: Tell me a joke about USER: and ASSISTANT: tags.",  # one turn that names the markers: not a transcript
]


def setup(tmp_path: Path) -> str:
    data = tmp_path / "glaive.jsonl"
    data.write_text("".join(json.dumps({"system": SYSTEM, "chat": chat}) + "\n" for chat in CHATS))
    spec = tmp_path / "glaive.yaml"
    spec.write_text(yaml.safe_dump({"name": "glaive", "kind": "jsonl", "path": str(data), "format": "prompt",
                                    "field": "chat"}))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"run_name": "glaive", "model": "m", "sources": [{"spec": str(spec)}],
                                      "endpoints": [{"url": "http://127.0.0.1:1"}]}))
    return str(config)


def test_a_glaive_transcript_in_one_prompt_is_sent_as_it_stands_and_counted_and_said_by_field(tmp_path, capsys):
    config = setup(tmp_path)
    assert regen_main(["validate", "--no-secrets", config]) == 0
    out = capsys.readouterr().out
    assert ("warning: transcript_in_one_message: the field 'chat' of 2 of the first records reads as a whole "
            "conversation (lines beginning 'USER:' and 'ASSISTANT:')") in out, out
    assert "sends each as one user message, as it stands" in out and "docs/sources.md" in out
    staged = stage_prompt_set(load_config(config))
    try:
        rows = pq.read_table(str(staged.prompts.path)).to_pylist()
        document = report_document(staged)
    finally:
        staged.discard()
    assert len(rows) == 3
    for row in rows:  # what is sent does not change: the system text, then the whole chat as one user message
        assert [m["role"] for m in row["messages"]] == ["system", "user"]
        assert row["messages"][1]["content"] in {chat.strip() for chat in CHATS}
    [source] = document["sources"]
    assert source["transcript_in_one_message"] == {"chat": 2}
    lines = report_lines(document["sources"])  # generate's log and `regen status` print these
    assert any("transcript_in_one_message: the field 'chat' of 2 prompts reads as a whole conversation" in line
               for line in lines), lines


@pytest.mark.parametrize("text, markers", [
    ("USER: hi\n\n\nASSISTANT: hello <|endoftext|>\n\n\nUSER: more", ("USER:", "ASSISTANT:")),
    ("USER: weather?\nFUNCTION RESPONSE: {}", ("USER:", "FUNCTION RESPONSE:")),  # glaive's tool turn
    ("\n\nHuman: hi\n\nAssistant: hello", ("Human:", "Assistant:")),  # HH-RLHF
    ("### Human: hi### Assistant: hello\n### Human: more\n### Assistant: ok", ("### Human:", "### Assistant:")),
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello", ("<|im_start|>user", "<|im_start|>assistant")),
    ("<|user|>\nhi\n<|assistant|>\nhello", ("<|user|>", "<|assistant|>")),
    ("USER: hi, ASSISTANT: hello", None),  # the assistant's marker does not begin a line
    ("USER: what does ASSISTANT: mean?\nIt is a role", None),
    ("user: hi\nassistant: hello", None),  # case-sensitive, as the datasets write them
    ("USER: hi\nAssistant: hello", None),  # markers of two families
    ("ASSISTANT: hello\nASSISTANT: again", None),  # no user turn
    ("Write a dialogue between a Human and an Assistant.", None),
    (["USER: hi", "ASSISTANT: hello"], None),  # not a text
])
def test_a_transcript_is_a_line_beginning_with_a_user_marker_and_one_with_an_assistant_marker(text, markers):
    assert transcript_markers(text) == markers
    assert looks_like_transcript(text) is (markers is not None)
