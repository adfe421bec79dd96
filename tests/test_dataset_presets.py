"""Dataset presets (issue 25): the datasets SpecForge's and speculators' recipes train drafts on ship as source specs
(prompts_sources/), each mapping taken from the libraries' own registries; each reads a project-written sample in
its dataset's real shape into the prompts the libraries would build; `regen validate` names the preset a file looks
like when the spec's format or field do not match it."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.prompts.adapters import to_messages
from pipeline.prompts.normalise import ROLE_MAP
from pipeline.prompts.presets import PRESETS, recognise
from pipeline.prompts.probe import probe_source
from pipeline.prompts.prompt_set import build_prompt_set
from pipeline.prompts.records import InvalidRecord, RejectCode
from pipeline.prompts.sources import SourceSpec, load_source_spec
from tests.trainlib import trainlib_dir

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "prompts_sources"
DATA = Path(__file__).parent / "data" / "presets"
SAMPLE = {"sharegpt": "sharegpt_vicuna.json", "ultrachat": "ultrachat_200k.jsonl",
          "magpie_llama31_pro_300k": "magpie_llama31_pro_300k.jsonl",
          "magpie_qwen25_pro_1m": "magpie_qwen25_pro_1m.jsonl", "open_perfectblend": "open_perfectblend.jsonl",
          "nemotron_chat": "nemotron_chat.jsonl", "gsm8k": "gsm8k.jsonl",
          "hermes_function_calling": "hermes_function_calling.json"}
# the image presets: their samples (tests/data/presets/images/ holds their pictures) are read by
# tests/test_image_datasets.py; the mixed run below sends them to the emulator (its kimi preset takes images)
IMAGE_PRESETS = {"llava_instruct_150k": "llava_instruct_150k.json", "sharegpt4v": "sharegpt4v.json",
                 "allava_4v": "allava_4v.json"}
IMAGE_ROOTS = {"llava_instruct_150k": DATA / "images" / "coco" / "train2017", "sharegpt4v": DATA / "images",
               "allava_4v": DATA / "images"}  # their folder layouts (tests/test_image_datasets.py)
# the presets whose hub files are Parquet (the others are JSON or JSON Lines), and where the split's files are
PARQUET_ON_HUB = {"ultrachat": "data/train_sft-*.parquet", "magpie_llama31_pro_300k": "data/train-*.parquet",
                  "magpie_qwen25_pro_1m": "data/train-*.parquet", "open_perfectblend": "data/train-*.parquet",
                  "gsm8k": "main/train-*.parquet"}
# speculators' DATASET_CONFIGS key of each preset (speculators/data_generation/configs.py)
SPECULATORS = {"sharegpt": "sharegpt", "ultrachat": "ultrachat", "magpie_llama31_pro_300k": "magpie",
               "open_perfectblend": "open-perfectblend", "nemotron_chat": "nemotron", "gsm8k": "gsm8k",
               "hermes_function_calling": "hermes-fc"}
# SpecForge's scripts/prepare_data.py (sgl-project/SpecForge at 9f1b1d6, load_dataset_preset): preset -> (its name
# there, hub path, subset, split). The script is not in SpecForge's wheel, so its registry is written down here.
SPECFORGE = {"sharegpt": ("sharegpt", "Aeala/ShareGPT_Vicuna_unfiltered", None, "train"),
             "ultrachat": ("ultrachat", "HuggingFaceH4/ultrachat_200k", None, "train_sft"),
             "magpie_qwen25_pro_1m": ("magpie-qwen2.5-pro-1m-v0.1", "Magpie-Align/Magpie-Qwen2.5-Pro-1M-v0.1", None,
                                      "train"),
             "open_perfectblend": ("perfectblend", "mlabonne/open-perfectblend", None, "train"),
             "gsm8k": ("gsm8k", "openai/gsm8k", "main", "train")}


def preset(name: str, path: Path | None = None) -> SourceSpec:
    """The shipped preset, its `path` pointed at a local file (the project's sample by default)."""
    return dataclasses.replace(load_source_spec(SOURCES / f"{name}.yaml"), path=str(path or DATA / SAMPLE[name]))


def sample_records(name: str) -> list[dict]:
    text = (DATA / SAMPLE[name]).read_text(encoding="utf-8")
    return json.loads(text) if SAMPLE[name].endswith(".json") else [json.loads(line) for line in text.splitlines()]


def read(spec: SourceSpec, mode: str = "last_turn"):
    ps = build_prompt_set([(spec, None)], mode=mode)
    return ps, ps.reports[0]


def shape(prompt) -> tuple[str, str, str | None]:
    """(roles sent, the last message sent, the reference) of a prompt."""
    last = prompt.messages[-1]
    return (" ".join(m["role"] for m in prompt.messages), last["content"] if last["role"] != "assistant" else "",
            prompt.reference)


MAGPIE_NOT_CARRIED = {"model", "gen_input_configs", "instruction", "response", "task_category", "other_task_category",
                      "task_category_generator", "difficulty", "intent", "knowledge", "difficulty_generator",
                      "input_quality", "quality_explanation", "quality_generator", "llama_guard_2", "reward_model",
                      "instruct_reward", "min_neighbor_distance", "repeat_count", "instruction_length",
                      "response_length", "language"}  # min_similar_uuid is null in the sample: nothing to count
EXPECTED = {
    "sharegpt": ([("user assistant user", "Now make it about the ships instead.",
                   "Hulls lean toward the shore,\none steady eye on the rocks:\nthey pass, and they live."),
                  ("user", "Yes, four lines in rhyme.",
                   "The keeper climbs when day is done,\nhe lights the lamp for everyone..."),
                  ("user", "What does `git rebase -i HEAD~3` do?",
                   "It opens an editor listing your last three commits, so you can reorder, squash, edit or drop them.")],
                 {"empty_conversation": 1}, set()),
    "ultrachat": ([("user assistant user", "Why twice and not once?",
                    "Because there are two bulges: one pulled toward the Moon, and one on the far side where the ocean "
                    "is pulled less than Earth itself."),
                   ("user", "Suggest a name for a bakery that only sells sourdough.",
                    "\"The Patient Loaf\": sourdough takes its time, and so does a good name.")], {}, {"prompt"}),
    "magpie_llama31_pro_300k": ([("user", "What is the difference between weather and climate?",
                                  "Weather is the state of the atmosphere over hours or days; climate is the average "
                                  "of that weather over decades."),
                                 ("user", "Give me three tips for learning to juggle.",
                                  "1. Start with one ball and throw it in an arc at eye height.\n2. Add the second ball "
                                  "only when the first arc is steady.\n3. Practise over a bed so dropped balls do not "
                                  "roll away.")], {}, MAGPIE_NOT_CARRIED),
    "magpie_qwen25_pro_1m": ([("user", "Write a Python function that checks whether a string is a palindrome.",
                               "def is_palindrome(s: str) -> bool:\n    cleaned = [c.lower() for c in s if c.isalnum()]"
                               "\n    return cleaned == cleaned[::-1]"),
                              ("user", "Explain what a hash map is to a ten-year-old.",
                               "Imagine a wall of lockers, each with a number. A hash map turns a name into a locker "
                               "number, so you can find its things at once.")], {}, MAGPIE_NOT_CARRIED),
    "open_perfectblend": ([("user", "A train travels 180 km in 2.5 hours. What is its average speed?",
                            "Average speed is distance over time: 180 / 2.5 = 72 km/h."),
                           ("user assistant user", "Only customers with more than five orders.",
                            "SELECT customer_id, COUNT(*) AS orders FROM orders GROUP BY customer_id HAVING COUNT(*) > 5;")],
                          {}, {"source"}),
    "nemotron_chat": ([("user", "Can you recommend a board game for two players?",
                        "Try Patchwork: a quick two-player game of fitting quilt pieces together, easy to learn and "
                        "different every time."),
                       ("user assistant user", "And in the second week?",
                        "<think>\nThe user is a beginner; increase gently, about ten percent.\n</think>\n\nKeep three "
                        "sessions, and make each a few minutes longer, running a little more than you walk.")],
                      {}, {"category", "license", "reasoning", "generator", "used_in_training", "version",
                           "system_prompt"}),
    "gsm8k": ([("user", "Ravi buys 3 notebooks at $4 each and a pen for $2. How much does he spend?",
                "The notebooks cost 3 * 4 = <<3*4=12>>12 dollars.\nWith the pen he spends 12 + 2 = <<12+2=14>>14 "
                "dollars.\n#### 14"),
               ("user", "A garden has 5 rows of 8 tulips. Half of them are red. How many tulips are not red?",
                "There are 5 * 8 = <<5*8=40>>40 tulips.\nHalf are red, so 40 / 2 = <<40/2=20>>20 are not red.\n#### 20")],
              {}, set()),
    "hermes_function_calling": ([("system user assistant tool tool tool assistant user assistant tool",
                                  '{"name": "set_camera_recording", "content": {"camera_id": "garage", "recording": '
                                  'false}}', "Done: the garage camera has stopped recording."),
                                 ("system user assistant tool", '{"name": "get_stock_quote", "content": {"symbol": '
                                  '"CTSO", "price": 41.18}}', "Contoso (CTSO) last traded at $41.18.")],
                                {}, {"category", "subcategory", "task"}),
}


def test_every_shipped_dataset_spec_is_a_preset_with_a_sample():
    shipped = {p.stem for p in SOURCES.glob("*.yaml") if not p.stem.startswith("sample")}
    assert shipped == set(SAMPLE) | set(IMAGE_PRESETS) == set(EXPECTED) | set(IMAGE_PRESETS) == \
        {p.name for p in PRESETS}
    for p in PRESETS:  # what validate recognises is what the spec file says
        spec = load_source_spec(SOURCES / f"{p.name}.yaml")
        assert (spec.format, spec.conversation_field) == (p.format, p.field), p.name
        assert f"{p.name}.yaml" in p.spec_file


@pytest.mark.parametrize("name", sorted(SAMPLE))
def test_each_preset_reads_its_real_shaped_sample_into_the_prompts_the_libraries_build(name):
    prompts, rejected, not_carried = EXPECTED[name]
    ps, report = read(preset(name))
    assert [shape(p) for p in ps.prompts] == prompts
    assert report.rejected_by_reason == rejected
    n = len(ps.prompts)
    assert report.uncarried == {f"record.{key}": n for key in not_carried}, "every field left out is counted"
    records = sample_records(name)
    if load_source_spec(SOURCES / f"{name}.yaml").id_field:  # the dataset's own id is kept for tracing
        assert [p.source_ref for p in ps.prompts] == [r[preset(name).id_field] for r in records if r.get(
            preset(name).conversation_field)]


def test_the_hermes_preset_keeps_every_call_result_and_tool_schema():
    ps, report = read(preset("hermes_function_calling"), mode="all_turns")
    camera, stock = ps.prompts
    assert [t["function"]["name"] for t in camera.tools] == ["get_camera_feed", "set_camera_recording"]
    assert [t["function"]["name"] for t in stock.tools] == ["get_stock_quote"]
    calls = [c["function"]["arguments"] for m in camera.messages for c in m.get("tool_calls") or ()]
    assert calls == ['{"camera_id":"porch"}', '{"camera_id":"garage"}', '{"camera_id":"garage","recording":true}',
                     '{"camera_id":"garage","recording":false}']
    assert report.tool_counts["tool_calls"] == report.tool_counts["tool_results"] == 5
    assert report.tool_counts["hermes_tools_blocks_moved"] == 2
    assert "<tools>\n[" not in camera.messages[0]["content"], "the schema left the system text for `tools`"


@pytest.mark.parametrize("name", sorted(PARQUET_ON_HUB))
def test_a_downloaded_parquet_repository_reads_into_the_same_prompts_as_the_sample(tmp_path, name):
    """The hub stores these as Parquet files of a repository: `data_files` picks the split's files (as
    docs/dataset-presets.md says), Arrow unifies the rows' structs, and the prompts do not change."""
    pattern = PARQUET_ON_HUB[name]
    for split, records in ((pattern, sample_records(name)), (pattern.replace("train", "test"), [])):
        file = tmp_path / split.replace("*", "00000-of-00001")
        file.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(records or sample_records(name)[:1]), file)  # a test split beside it
    spec = dataclasses.replace(preset(name, tmp_path), data_files=(pattern,))
    from_parquet, report = read(spec)
    assert report.read == len(sample_records(name)), "the test split's file is not read"
    from_sample, _ = read(preset(name))
    assert [(p.prompt_id, p.reference) for p in from_parquet.prompts] == \
        [(p.prompt_id, p.reference) for p in from_sample.prompts]
    assert set(report.uncarried) == {f"record.{key}" for key in EXPECTED[name][2]}


# --- the authority: the libraries' own registries -------------------------------------------------
def speculators_configs():
    """speculators' data_generation/configs.py, loaded alone (it imports only the standard library)."""
    path = trainlib_dir() / "speculators" / "data_generation" / "configs.py"
    if not path.exists():
        pytest.skip(f"speculators is not unpacked at {path.parent}: make trainlib-wheels")
    spec = importlib.util.spec_from_file_location("speculators_data_configs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DATASET_CONFIGS


@pytest.mark.parametrize("name", sorted(SPECULATORS))
def test_the_presets_read_what_speculators_registry_reads(name):
    config = speculators_configs()[SPECULATORS[name]]
    shipped = load_source_spec(SOURCES / f"{name}.yaml")
    assert (shipped.path, shipped.subset, shipped.split) == (config.hf_path, config.subset, config.split)
    spec = preset(name)
    for record in sample_records(name):
        row = {**record, **config.normalize_fn(record)} if config.normalize_fn else record
        theirs = [(ROLE_MAP[m.get("role", m.get("from"))], m.get("content", m.get("value")))
                  for m in row.get("conversations") or []]
        try:
            ours = [(ROLE_MAP[m["role"]], m["content"]) for m in to_messages(spec, record)]
        except InvalidRecord as exc:  # a record regen rejects must be one speculators has nothing in
            assert theirs == [], exc
            continue
        if name == "hermes_function_calling":  # regen reads the calls out of the text: the user turns agree
            ours, theirs = ([turn for turn in t if turn[0] == "user"] for t in (ours, theirs))
        assert ours == theirs, record


@pytest.mark.parametrize("name", sorted(SPECFORGE))
def test_the_presets_load_what_specforges_prepare_data_loads(name):
    _, path, subset, split = SPECFORGE[name]
    shipped = load_source_spec(SOURCES / f"{name}.yaml")
    assert (shipped.path, shipped.subset, shipped.split) == (path, subset, split)
    assert SPECFORGE[name][0] in (SOURCES / f"{name}.yaml").read_text(), "the spec cites SpecForge's preset"


def test_the_two_magpies_are_the_two_libraries_choices():
    assert speculators_configs()["magpie"].hf_path == load_source_spec(SOURCES / "magpie_llama31_pro_300k.yaml").path
    assert SPECFORGE["magpie_qwen25_pro_1m"][1] == load_source_spec(SOURCES / "magpie_qwen25_pro_1m.yaml").path


# --- the new shapes --------------------------------------------------------------------------------
def records_file(tmp_path: Path, records: list[dict]) -> Path:
    file = tmp_path / "records.jsonl"
    file.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return file


def test_question_answer_and_input_output_reject_a_reply_that_is_not_text_and_send_a_prompt_without_one(tmp_path):
    qa = [{"question": "What is 2 + 3?", "answer": 5}, {"question": "What is 2 + 2?"},
          {"question": ["a", "list"], "answer": "no"}]
    ps, report = read(preset("gsm8k", records_file(tmp_path, qa)))
    assert [(p.messages[-1]["content"], p.reference) for p in ps.prompts] == [("What is 2 + 2?", None)]
    assert report.rejected_by_reason == {RejectCode.NON_STRING_CONTENT.value: 2}
    io = [{"input": [{"role": "user", "content": "Hi"}], "output": {"text": "Hello"}},
          {"input": [{"role": "user", "content": "Name a colour."}], "output": ""},
          {"input": "not a list", "output": "x"}]
    ps, report = read(preset("nemotron_chat", records_file(tmp_path, io)))
    assert [(p.messages[-1]["content"], p.reference) for p in ps.prompts] == [("Name a colour.", None)]
    assert report.rejected_by_reason == {RejectCode.NON_STRING_CONTENT.value: 1, "bad_conversation": 1}


# --- regen validate names the preset ---------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SAMPLE))
def test_every_sample_record_is_recognised_as_its_own_preset(name):
    assert {recognise(r).name for r in sample_records(name) if r.get("conversations") != []} == {name}


@pytest.mark.parametrize("name, wrong", [("gsm8k", {"format": "sharegpt"}), ("nemotron_chat", {"format": "openai"}),
                                         ("ultrachat", {"format": "sharegpt", "field": "conversations"}),
                                         ("magpie_qwen25_pro_1m", {"format": "alpaca", "field": None}),
                                         ("hermes_function_calling", {"format": "openai", "field": "messages"})])
def test_validate_names_the_preset_when_format_or_field_do_not_match(name, wrong):
    spec = dataclasses.replace(preset(name), **wrong)
    probe = probe_source(spec)
    p = next(p for p in PRESETS if p.name == name)
    warning = (f"the spec says format {spec.format} with field {spec.conversation_field!r}; these records look "
               f"like {name} (prompts_sources/{name}.yaml): format {p.format}, field {p.field!r}")
    assert warning in probe.warnings, probe.warnings
    assert not any("look like" in w and "prompts_sources" in w for w in probe_source(preset(name)).warnings), \
        "its own preset is not named"


def test_regen_validate_says_a_gsm8k_file_under_a_sharegpt_spec_looks_like_gsm8k(tmp_path, capsys):
    from pipeline.cli import main

    (tmp_path / "mine.yaml").write_text(yaml.safe_dump({"name": "mine", "kind": "jsonl", "format": "sharegpt",
                                                        "path": str(DATA / SAMPLE["gsm8k"])}))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"run_name": "t", "output_dir": str(tmp_path / "out"), "model": "m",
                                      "sources": [{"spec": str(tmp_path / "mine.yaml")}],
                                      "endpoints": [{"url": "http://127.0.0.1:9", "concurrency": 1}]}))
    assert main(["validate", str(config)]) == 2  # no record is a ShareGPT conversation
    out = capsys.readouterr().out
    assert "they look like question_answer (field 'question')" in out
    assert ("  warning: the spec says format sharegpt with field 'conversations'; these records look like gsm8k "
            "(prompts_sources/gsm8k.yaml): format question_answer, field 'question'") in out
    assert "under 'question'" not in out, "one warning says it"


# --- end to end ------------------------------------------------------------------------------------
def test_a_run_mixing_every_preset_generates_and_exports_each_prompt_once(tmp_path, ray_cluster, emulator_fleet):
    """All the presets in one run on the SGLang emulator: each prompt is answered once, under its source's name;
    status names what each source leaves out; both libraries' exports hold every record."""
    from tests.helpers import run_regen, write_config

    specs = []
    for name in sorted({**SAMPLE, **IMAGE_PRESETS}):  # the image presets too: the emulator's kimi preset takes images
        doc = yaml.safe_load((SOURCES / f"{name}.yaml").read_text())
        local = {"path": str(DATA / {**SAMPLE, **IMAGE_PRESETS}[name])}
        if name in IMAGE_PRESETS:
            local["image_root"] = str(IMAGE_ROOTS[name])
        specs.append(tmp_path / f"{name}.yaml")
        specs[-1].write_text(yaml.safe_dump({**doc, **local}))
    endpoints = [{"url": s.url, "concurrency": 4, "name": f"emu-{i}"} for i, s in enumerate(emulator_fleet)]
    config = write_config(tmp_path, endpoints, specs, model="moonshotai/Kimi-K2.5",
                          sampling={"temperature": 0.0, "max_tokens": 16})
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    run = tmp_path / "out" / "t"
    rows = [r for p in sorted((run / "data").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
    # the image presets' samples (tests/test_image_datasets.py): 3, 2 and 2 prompts, one picture of each of llava and
    # sharegpt4v missing; sharegpt4v's COCO question is llava's (same text, same picture): one prompt, llava's
    per_source = {name: len(expected) for name, (expected, _, _) in EXPECTED.items()}
    per_source.update(llava_instruct_150k=3, sharegpt4v=1, allava_4v=2)
    assert {name: sum(r["source"] == name for r in rows) for name in per_source} == per_source
    assert len({r["prompt_id"] for r in rows}) == len(rows) == sum(per_source.values())
    hermes = [r for r in rows if r["source"] == "hermes_function_calling"]
    assert all(json.loads(r["tools"]) for r in hermes), "the Hermes prompts were sent with their tools"
    status = json.loads(run_regen("status", str(run), "--json").stdout)
    reports = {s["name"]: s for s in status["sources"]}
    assert reports["nemotron_chat"]["uncarried"]["record.system_prompt"] == 2
    assert status["done"] == len(rows) and reports["sharegpt"]["rejected_by_reason"] == {"empty_conversation": 1}
    assert (reports["sharegpt4v"]["rejected_by_reason"], reports["sharegpt4v"]["duplicates"]) == ({"image_missing": 1}, 1)
    assert status["image_prompts"] == {"total": 6, "done": 6, "pending": 0, "failed": 0}
    speculators = tmp_path / "speculators.jsonl"
    assert run_regen("export", str(run), "--format", "speculators", "--out", str(speculators)).returncode == 0
    # text records are pre-tokenized rows; image records go to a file of their own (<out>.images.jsonl)
    text_rows = [r for r in rows if not any(m.get("parts") for m in r["messages"])]
    assert len(speculators.read_text().splitlines()) == len(text_rows) == len(rows) - 6
    # SpecForge's conversations cannot hold tool turns, and a thinking target cut at 16 tokens has no content yet:
    # the export names each record it leaves out
    specforge = run_regen("export", str(run), "--format", "specforge", "--keep-truncated", "--out",
                          str(tmp_path / "specforge.jsonl"))
    counts = {k.strip(): int(v) for k, v in re.findall(r"^  (records exported|dropped: \w+)\s+(\d+)$", specforge.stderr,
                                                         re.M)}
    assert counts["records exported"] > 0 and sum(counts.values()) == len(rows), specforge.stderr
