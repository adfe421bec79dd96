"""The exports of a tool-calling all_turns conversation through SpecForge's and speculators' own loaders
(tests/trainlib.py), on records built here with SmolLM2's tokenizer and a Hermes-style chat template (tools in a
system turn, calls in <tool_call>, results in <tool_response>) as a tool-calling server renders them: SpecForge
reads the export's `tools` and `tool_calls` and renders exactly the ids the target saw; each library trains the
target's own tokens, calls included, and never a tool result."""
from __future__ import annotations

import json
import shutil

import orjson
import pytest

pytest.importorskip("transformers")

from pipeline.export.jsonl import export_run
from pipeline.prompts.conversation import calls_json
from pipeline.prompts.tool_calls import canonical_json, message_row
from pipeline.store.quality import quality_flags
from tests.tool_records import make_tool_run
from tests.trainlib import require_trainlib, run_checks

HERMES = (  # one line: HF renders with trim_blocks, so every newline is written inside an expression
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n\\n<tools>' }}{% for tool in tools %}"
    "{{ '\\n' + (tool | tojson) }}{% endfor %}{{ '\\n</tools><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "{{ '<|im_start|>tool\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{% elif message.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{% for call in message.tool_calls or [] %}{% set args = call.function.arguments %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' "
    "+ (args if args is string else (args | tojson)) + '}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "call_x1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
RESULT = "18C and clear, light wind from the west"


@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory):
    """SmolLM2's tokenizer with a chat template that renders tools (its own renders none)."""
    require_trainlib()
    from tests.smollm2_hf import smollm2_hf_dir

    folder = tmp_path_factory.mktemp("smollm2-hermes")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_hf_dir() / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def conversation(hermes_dir):
    """Two generations: a pure call, then (after the spliced result) the answer; ids as the server gives them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hermes_dir)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    user = {"role": "user", "content": "What is the weather in Paris?"}
    histories = [[user], [user, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                          {"role": "tool", "content": RESULT, "tool_call_id": "call_x1", "name": "get_weather"}]]
    sent_tools = orjson.loads(canonical_json(TOOLS))  # the request carries the prompt's canonical tools JSON
    steps = [("", [CALL], "tool_calls"), ("It is 18C and clear in Paris.", None, "stop")]
    rows = []
    for k, (history, (content, calls, finish)) in enumerate(zip(histories, steps)):
        prompt = list(tok.apply_chat_template(history, tools=sent_tools, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))
        output = tok.encode(content or CALL_TEXT, add_special_tokens=False) + [end]
        rows.append({
            "prompt_id": "pt0", "turn_index": k, "n_turns": 2, "source": "agent",
            "messages": [message_row(m) for m in history], "tools": canonical_json(TOOLS), "content": content,
            "reasoning_content": None, "finish_reason": finish, "tool_calls": calls_json(calls),
            "flags": quality_flags(content, None, finish, tool_calls=calls), "prompt_tokens": len(prompt),
            "completion_tokens": len(output), "endpoint": "e0", "model": "SmolLM2-135M-Instruct",
            "config_fingerprint": "fp-tools", "prompt_token_ids": prompt, "output_token_ids": output})
    return tok, rows


def test_specforge_renders_the_tool_conversation_export_as_the_target_saw_it(tmp_path, hermes_dir, conversation):
    tok, rows = conversation
    run = make_tool_run(tmp_path / "run", [rows], model="SmolLM2-135M-Instruct")
    out = tmp_path / "sf.jsonl"
    assert export_run(run.path, "specforge", out).rows_written == 1
    (row,) = run_checks({"check": "specforge_rows", "path": str(out), "tokenizer": str(hermes_dir),
                         "template": "lfm", "train_only_last_turn": False})["rows"]
    first, last = rows
    call_ids = first["output_token_ids"]
    # the target's call is in its next prompt verbatim (on-policy), and SpecForge renders that exact sequence
    assert last["prompt_token_ids"][len(first["prompt_token_ids"]):][:len(call_ids)] == call_ids
    exact = last["prompt_token_ids"] + last["output_token_ids"]
    assert row["input_ids"][:len(exact)] == exact  # (then the template's newline after <|im_end|>)
    mask, ids = row["loss_mask"], row["input_ids"]
    start = len(first["prompt_token_ids"])
    assert all(mask[start:start + len(call_ids)]), "the call's tokens are trained"
    assert all(mask[len(last["prompt_token_ids"]):]), "the answer is trained"
    assert not any(mask[:start]), "the tools and the user turn are not"
    result_ids = tok.encode(RESULT, add_special_tokens=False)
    at = next(i for i in range(len(ids)) if ids[i:i + len(result_ids)] == result_ids)
    assert not any(mask[at:at + len(result_ids)]), "a tool result is never trained"


def test_speculators_prepare_data_trains_exactly_each_steps_own_tokens(tmp_path, hermes_dir, conversation):
    """(SpecForge reads `specforge-tokens` rows unchanged: tests/test_trainlib_exports.py; a tool step's row is
    built the same way, and tests/test_tool_runs.py checks its mask.)"""
    tok, rows = conversation
    run = make_tool_run(tmp_path / "run", [rows], model="SmolLM2-135M-Instruct")
    expected = {tuple(r["prompt_token_ids"] + r["output_token_ids"]):
                [0] * len(r["prompt_token_ids"]) + [1] * len(r["output_token_ids"]) for r in rows}
    export_run(run.path, "speculators", tmp_path / "spec.jsonl")
    got = run_checks({"check": "speculators_prepare", "path": str(tmp_path / "spec.jsonl"),
                      "tokenizer": str(hermes_dir), "out": str(tmp_path / "prepared")})["rows"]
    assert {tuple(r["input_ids"]): r["loss_mask"] for r in got} == expected
    call_row = next(r for r in got if tuple(r["input_ids"]) == tuple(rows[0]["prompt_token_ids"] +
                                                                      rows[0]["output_token_ids"]))
    trained = [i for i, m in zip(call_row["input_ids"], call_row["loss_mask"]) if m]
    assert tok.decode(trained) == CALL_TEXT + "<|im_end|>"  # the call is what the draft learns from this step
