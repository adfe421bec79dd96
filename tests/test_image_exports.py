"""The exports, the capture and the source ids of runs with image records (tests/image_records.py: real Parquet
records of schema 6, real PNG files), each format loaded by its library's own loader where one can run here
(tests/trainlib.py).

TorchSpec (lightseekorg/TorchSpec, the trainer of the public Kimi-K2.5 drafts) cannot be a test dependency: it is not
on PyPI (its name there is an empty placeholder) and its package imports its models, wandb and numba. Its rows are
checked by `torchspec_problems` below, which follows its code at commit 6f21829: `torchspec/data/utils.py`
(`load_local_json`: one JSON object a line; `extract_media_urls`: `image_url.url` or `image` of a part;
`flatten_multimodal_content`: a content is a string or a list of part objects), `torchspec/data/dataset.py`
(`load_conversation_dataset`: `id`, and the `conversations` list) and `torchspec/data/parse.py`
(`KimiK25Parser.format`: roles system/user/assistant/tool, an assistant's content a string with its reasoning inline
as a leading `<think>...</think>`, `tool_calls` each with an `id` and `function.arguments` as a JSON string, a tool
message's `tool_call_id`). The export was also run once through TorchSpec's own `load_conversation_dataset` from
that checkout (docs/exports-and-training.md says how)."""
from __future__ import annotations

import hashlib
from collections import namedtuple
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import orjson
import pyarrow as pa
import pytest

from pipeline.capture import pending_samples
from pipeline.core.errors import ConfigError
from pipeline.export.jsonl import export_run, images_path, manifest_path
from pipeline.store import schema
from pipeline.store.capture_ledger import capture_counts
from tests.image_records import all_turns_run, last_turn_run
from tests.test_export import make_run, record

FORMATS = ("specforge", "specforge-tokens", "speculators", "torchspec")
Sample = namedtuple("Sample", "prompt_id turn_index sample_id token_ids n_prompt finish_reason")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def file_of(url: str) -> Path:
    assert url.startswith("file:///"), url
    return Path(unquote(urlparse(url).path))


def torchspec_problems(row: Any) -> list[str]:
    """What TorchSpec's loader and KimiK25Parser would not take in a row (the module docstring names the code)."""
    if not isinstance(row, dict) or not isinstance(row.get("id"), str):
        return ["a row is an object with a string id"]
    conversation = row.get("conversations")
    if not isinstance(conversation, list) or not conversation:
        return ["conversations must be a non-empty list"]
    problems = []
    for k, message in enumerate(conversation):
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "user", "assistant", "tool"):
            problems.append(f"{k}: role {role!r}")
        if isinstance(content, list):
            for part in content:
                kind = part.get("type")
                if kind == "text" and isinstance(part.get("text"), str):
                    continue
                if kind == "image_url" and isinstance((part.get("image_url") or {}).get("url"), str):
                    if not file_of(part["image_url"]["url"]).is_file():
                        problems.append(f"{k}: {part['image_url']['url']} is no file")
                    continue
                problems.append(f"{k}: part {part} is not one TorchSpec reads")
            if role == "assistant":
                problems.append(f"{k}: an assistant's content must be a string (its reasoning goes inline)")
        elif not isinstance(content, str):
            problems.append(f"{k}: content must be a string or a list of parts")
        if role == "assistant" and "reasoning_content" in message:
            problems.append(f"{k}: reasoning_content is not read by KimiK25Parser; it goes inline in <think>")
        if role == "assistant" and isinstance(content, str) and "<think>" in content and \
                not (content.startswith("<think>") and "</think>" in content):
            problems.append(f"{k}: reasoning must lead the content as <think>...</think>")
        for call in message.get("tool_calls") or ():
            if not isinstance(call.get("id"), str) or not isinstance((call.get("function") or {}).get("arguments"),
                                                                     str):
                problems.append(f"{k}: a tool call needs its id and its arguments as a JSON string")
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            problems.append(f"{k}: a tool result names its call (tool_call_id)")
    if conversation[-1].get("role") != "assistant":
        problems.append("the row must end with the assistant message it trains")
    return problems


@pytest.fixture
def last_turn(tmp_path):
    return last_turn_run(tmp_path / "run", tmp_path / "photos")


@pytest.fixture
def all_turns(tmp_path):
    return all_turns_run(tmp_path / "run-at")


def test_each_format_exports_or_counts_every_image_record_with_its_reason(tmp_path, last_turn):
    run, _ = last_turn
    expected = {"specforge": ({"image_prompt": 3, "truncated": 1}, 2),
                "specforge-tokens": ({"image_prompt": 4}, 2),
                "speculators": ({"history_not_target_written": 1, "truncated": 1}, 4),
                "torchspec": ({"truncated": 1}, 5)}
    refs = {"t-text": "chat-1", "t-tool": "agent-7", "t-img": "coco-123", "t-img2": None, "t-img-hist": "coco-124"}
    for fmt, (dropped, rows) in expected.items():
        out = tmp_path / f"{fmt}.jsonl"
        summary = export_run(run.path, fmt, out)
        assert (summary.dropped, summary.rows_written, summary.records_read) == (dropped, rows, 6), fmt
        manifest = orjson.loads(manifest_path(out).read_bytes())
        assert manifest["counts"]["dropped"] == dropped
        written = read_jsonl(out) + (read_jsonl(images_path(out)) if fmt == "speculators" else [])
        for row in written:  # the source's own id in every row
            assert row["source_ref"] == refs[row.get("primary_id") or row.get("source_id") or row["id"].split("#")[0]]
        text = out.read_text() + (images_path(out).read_text() if images_path(out).exists() else "")
        assert "base64" not in text and "data:" not in text
        if fmt in ("specforge", "specforge-tokens"):
            assert '"image' not in text and any("image_prompt" in note for note in manifest["notes"])
    torchspec_rows = read_jsonl(tmp_path / "torchspec.jsonl")
    assert [torchspec_problems(row) for row in torchspec_rows] == [[]] * 5
    assert orjson.loads(manifest_path(tmp_path / "torchspec.jsonl").read_bytes())["torchspec_settings"] == \
        {"dataset": {"chat_template": "kimi-k25-vlm", "prompt_key": "conversations", "last_turn_loss_only": True}}


def test_torchspec_rows_carry_reasoning_inline_tool_calls_and_every_image(tmp_path, last_turn, all_turns):
    run, images = last_turn
    export_run(run.path, "torchspec", tmp_path / "lt.jsonl")
    rows = {row["id"]: row for row in read_jsonl(tmp_path / "lt.jsonl")}
    image = rows["t-img#turn0"]["conversations"]
    assert image[-1] == {"role": "assistant", "content": "<think>It looks like a gradient.</think>A gradient of "
                                                         "colours."}
    urls = [p["image_url"]["url"] for p in rows["t-img2#turn0"]["conversations"][1]["content"]
            if p["type"] == "image_url"]
    assert [hashlib.sha256(file_of(u).read_bytes()).hexdigest() for u in urls] == \
        [images["ref"]["sha256"], images["dog"]["sha256"]]  # the referenced file in place, the copy in RUN/images
    assert file_of(urls[0]) == Path(images["ref"]["path"])
    tool = rows["t-tool#turn0"]["conversations"]
    assert tool[1]["tool_calls"][0]["id"] == "functions.lookup:0" and tool[2]["tool_call_id"] == "functions.lookup:0"
    at, _ = all_turns
    export_run(at.path, "torchspec", tmp_path / "at.jsonl")
    rows = {row["id"]: row for row in read_jsonl(tmp_path / "at.jsonl")}
    assert sorted(rows) == ["a-img#turn0", "a-img#turn1", "a-text#turn0", "a-tool#turn0", "a-tool#turn1"]
    step = rows["a-tool#turn1"]["conversations"][1]  # the call the run sent back with its reasoning (current_turn)
    assert step["content"] == "<think>I should look it up.</think>" and step["tool_calls"][0]["function"]["name"] == \
        "lookup"
    assert all(torchspec_problems(row) == [] for row in rows.values())


def test_speculators_image_rows_go_through_speculators_own_preprocessing(tmp_path, last_turn, all_turns):
    from tests.trainlib import run_checks

    cases, exports = ((last_turn, {"t-img": 1, "t-img2": 1}), (all_turns, {"a-img": 2})), []
    for (run, _), turns in cases:
        out = tmp_path / f"{run.path.name}.jsonl"
        assert export_run(run.path, "speculators", out).image_rows == len(turns)
        exports.append({"rows": str(out), "images": str(images_path(out))})
    answers = run_checks({"check": "speculators_image_rows", "exports": exports})["exports"]
    for ((run, images), turns), got in zip(cases, answers):
        records = {(r["prompt_id"], r["turn_index"]): r for part in run.parts(run.data)
                   for r in part.read_parquet().to_pylist()}
        # text records: today's pre-tokenized rows, passed through unchanged
        text = [r for r in records.values() if not any(m["parts"] for m in r["messages"])]
        assert sorted((r["input_ids"], r["loss_mask"]) for r in got["rows"]["rows"]) == sorted(
            (r["prompt_token_ids"] + r["output_token_ids"],
             [0] * len(r["prompt_token_ids"]) + [1] * len(r["output_token_ids"])) for r in text)
        # image conversations: one training row per target-written assistant turn, each training that reply only
        replies = sorted(records[(pid, k)]["content"] + "<|end|>" for pid, n in turns.items() for k in range(n))
        assert sorted(r["trained"] for r in got["images"]["rows"]) == replies
        assert got["images"]["n_in"] == len(turns)
        parts = {p["sha256"] for p in images.values()}
        assert got["image_urls"] and {u["sha256"] for u in got["image_urls"]} <= parts  # every file read is its image
        kept = [p for conv in got["images"]["messages"] for m in conv if isinstance(m["content"], list)
                for p in m["content"] if p["type"] == "image_url"]
        assert kept and all(p["image_url"]["url"].startswith("file:///") for p in kept)  # kept for hidden states


def test_specforge_loads_both_exports_of_an_image_run_which_hold_no_image_record(tmp_path, last_turn):
    from tests.smollm2_hf import smollm2_hf_dir
    from tests.trainlib import require_trainlib, run_checks

    require_trainlib()
    run, _ = last_turn
    tasks = []
    for fmt, dropped in (("specforge-tokens", {"image_prompt": 4}), ("specforge", {"image_prompt": 3, "truncated": 1})):
        out = tmp_path / f"{fmt}.jsonl"
        assert export_run(run.path, fmt, out).dropped == dropped
        tasks.append({"path": str(out)} if fmt == "specforge-tokens" else
                     {"path": str(out), "tokenizer": str(smollm2_hf_dir()), "template": "lfm",
                      "train_only_last_turn": True})
    tokens, conversations = run_checks({"check": "specforge_rows_many", "tasks": tasks})["results"]
    assert len(tokens["rows"]) == len(conversations["rows"]) == 2  # the text and the tool record
    assert all(sum(r["loss_mask"]) for r in tokens["rows"] + conversations["rows"])


def test_an_all_turns_conversation_whose_image_comes_in_a_later_turn_is_one_image_row(tmp_path):
    from tests.image_records import copied_image, image_record, user, write_run

    cat = copied_image(tmp_path / "run", 8, 8, 4)
    first, later = user("Hello"), user(cat, "And this?")
    records = [image_record("c", 0, [first], "Hi.", n_turns=2),
               image_record("c", 1, [first, {"role": "assistant", "content": "Hi."}, later], "A square.", n_turns=2)]
    run = write_run(tmp_path / "run", "all_turns", [records])
    out = tmp_path / "spec.jsonl"
    summary = export_run(run.path, "speculators", out)
    assert (summary.rows_written, summary.image_rows, summary.records_exported) == (1, 1, 2) and not out.read_text()
    (row,) = read_jsonl(images_path(out))
    assert [m["role"] for m in row["conversations"]] == ["user", "assistant", "user", "assistant"]


def test_image_prefix_rewrites_the_paths_a_trainer_opens_and_an_unmapped_object_store_path_is_refused(
        tmp_path, last_turn):
    run, images = last_turn
    mount = tmp_path / "mnt" / "run"
    mount.parent.mkdir()
    mount.symlink_to(run.path)
    out = tmp_path / "spec.jsonl"
    export_run(run.path, "speculators", out, image_prefixes=[f"{run.path}={mount}"])
    paths = [p["path"] for row in read_jsonl(images_path(out)) for m in row["conversations"]
             for p in m["content"] if p["type"] == "image"]
    copied = [p for p in paths if p.startswith(str(mount) + "/images/")]
    assert copied and all(Path(p).is_file() for p in copied) and images["ref"]["path"] in paths
    assert orjson.loads(manifest_path(out).read_bytes())["image_paths_rewritten"] == len(copied)
    with pytest.raises(ConfigError, match="OLD=NEW"):
        export_run(run.path, "torchspec", out, image_prefixes=[f"{run.path}=s3://bucket/run"])
    with pytest.raises(ConfigError, match="--image-prefix"):
        export_run(run.path, "torchspec", out, image_prefixes=["no-equals-sign"])
    # an export of another format into the same --out leaves no image rows of the earlier one
    export_run(run.path, "specforge-tokens", out)
    assert not images_path(out).exists()


def test_an_older_run_gets_its_source_ids_from_the_prompt_set(tmp_path):
    """A run created at records schema 5 (no `source_ref` column); its prompt set had the source's ids."""
    from pipeline.store.rundir import RunDir

    user = [{"role": "user", "content": "q"}]
    run = make_run(tmp_path / "run", "last_turn", [])
    manifest = RunDir(run).read_manifest()
    RunDir(run).write_manifest({**manifest, "schema_version": 5})
    RunDir(run).write_part(RunDir(run).data, pa.Table.from_pylist(
        [record("p1", 0, user, "a b"), record("p2", 0, user, "c d")], schema=schema.records_schema(5)))
    prompts = pa.Table.from_pylist([{"prompt_id": "p1", "source": "chat", "origin": "f.jsonl:1",
                                     "source_ref": "conv-41", "messages": user}], schema=schema.PROMPTS)
    RunDir(run).write_prompt_set(prompts, pa.Table.from_pylist([], schema=schema.REJECTS))
    for fmt in FORMATS:
        export_run(run, fmt, tmp_path / f"{fmt}.jsonl")
        refs = {row.get("primary_id") or row.get("source_id") or row["id"].split("#")[0]: row["source_ref"]
                for row in read_jsonl(tmp_path / f"{fmt}.jsonl")}
        assert refs == {"p1": "conv-41", "p2": None}, fmt


@pytest.mark.parametrize("route", ["transformers", "vllm"])
def test_capture_refuses_each_image_record_with_its_reason_and_counts_it(last_turn, route, caplog):
    run, _ = last_turn
    refused: set = set()
    pending = pending_samples(run, set(), refused, Sample, route=route)
    assert pending.images == 4 and pending.no_token_ids == 0
    assert sorted(turns[0][0] for turns in pending.prompts) == ["t-text", "t-tool"]  # never from the text alone
    assert sorted(pid for pid, _ in refused) == ["t-img", "t-img-cut", "t-img-hist", "t-img2"]
    logged = [r.getMessage() for r in caplog.records if "an image prompt" in r.getMessage()]
    assert len(logged) == 4 and all(route in line for line in logged)
    again = pending_samples(run, set(), refused, Sample, route=route)
    assert again.images == 0  # a follow capture's next listing counts each record once
    from pipeline.store.capture_ledger import capture_run_dir

    capture_run_dir(run).path.mkdir()
    capture_run_dir(run).write_manifest({"route": route, "fingerprint": "f", "layout": {"states": []}})
    assert capture_counts(run)["refused_images"] == 4


def test_image_prefix_rewrites_a_whole_folder_never_a_sibling_whose_name_it_begins():
    from pipeline.export.messages import ImagePaths
    from pipeline.store.storage import Location

    paths = ImagePaths(Location.at("/runs/a"), [("/data/run", "/mnt/run")])
    assert paths.path_of({"sha256": "ab" * 32, "path": "/data/run/x.png"}) == "/mnt/run/x.png"
    assert paths.path_of({"sha256": "ab" * 32, "path": "/data/run2/x.png"}) == "/data/run2/x.png"
    assert paths.rewritten == 1
