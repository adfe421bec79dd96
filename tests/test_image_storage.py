"""Image prompts in storage (issue 28, the store's part): records schema 6 and the prompt set hold content parts and
the source's id; each image is copied once, by its content, into RUN/images/ when the prompt set is committed (local
disk and S3), never before; a local image that changed is refused by name; a SIGKILL in the middle of the copy
resumes whole; an older run refuses image prompts; the default images settings keep every run's identity."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import orjson
import pyarrow.parquet as pq
import pytest

from pipeline.core.config import RunConfig
from pipeline.core.errors import ConfigError, ImageChanged
from pipeline.core.images import stored_image_path
from pipeline.core.work import Completion, DONE, Outcome
from pipeline.prompts.tool_calls import message_from_row, message_row
from pipeline.store import schema
from pipeline.store.committer import Committer
from pipeline.store.faults import FAULT_ENV, Faults
from pipeline.store.promptset import check_schema_takes_parts
from pipeline.store.records import RecordBuilder
from pipeline.store.run_images import image_location, read_image
from pipeline.store.rundir import RunDir
from pipeline.store.status import ledger_counts
from pipeline.store.storage import Location
from tests.image_store_helpers import (image_prompt, local_images, new_run, part_of, picture, sha, stage,
                                       stored_images, text_prompt)

REPO = Path(__file__).resolve().parent.parent
DEAD_ENDPOINT = [{"url": "http://127.0.0.1:9", "concurrency": 1}]  # never contacted: nothing here dispatches


def config(**overrides) -> RunConfig:
    return RunConfig.model_validate({"run_name": "t", "model": "m", "sources": [{"spec": "unused.yaml"}],
                                     "endpoints": DEAD_ENDPOINT, **overrides})


def completion(text: str) -> Completion:
    return Completion(content=text, reasoning_content=None, finish_reason="stop", prompt_tokens=40,
                      completion_tokens=3, cached_tokens=None, reasoning_tokens=None, model="m", weight_version=None,
                      latency_s=0.1, request_id="r")


def test_parts_round_trip_through_the_prompt_set_and_records_schema_6_and_load_as_one_table(tmp_path):
    files = local_images(tmp_path / "src", range(2))
    (a, b), fetched = list(files), picture(7)
    prompts = [image_prompt("What is in the picture?", [part_of(picture(0))], ref="llava-1"),
               image_prompt("Compare them.", [part_of(picture(1)), part_of(fetched)], ref="llava-2"),
               text_prompt("Why is the sky blue?", ref="sharegpt-9"), text_prompt("No id here.")]
    staged = stage(prompts, files, [fetched])
    assert (staged.with_images, staged.with_parts) == (2, 2)
    run = new_run(tmp_path / "run")
    staged.commit(run)
    assert set(stored_images(run)) == {a, b, sha(fetched)}
    table = run.load_prompt_set()
    assert table.schema.field("messages").type.value_type == schema.MESSAGE6
    assert table.column("images").to_pylist() == [1, 2, 0, 0]
    reader = run.prompt_set_reader(1)
    builder = RecordBuilder(reader, config())
    items = {i.prompt_id: i for i in builder.work_items(reader.pending(set(), set(), True, 0).pending)}
    for p in prompts:
        assert orjson.loads(items[p.prompt_id].messages_json) == list(p.messages), "sent as normalised"
    text = orjson.loads(items[prompts[2].prompt_id].messages_json)
    assert text == [{"role": "user", "content": "Why is the sky blue?"}], "a text message reads back as before"

    committer = Committer(run, set(), flush_records=100, flush_interval_s=60, records_schema=schema.records_schema(6))
    for i, p in enumerate(prompts):
        committer.add_records(builder.records(Outcome(p.prompt_id, DONE, "e", 1, [completion(f"answer {i}")]), 1))
        if i == 1:
            committer.flush()  # two parts: loaded as one table below
    committer.flush()
    parts = run.parts(run.data)
    assert len(parts) == 2 and all(pq.read_schema(p.path) == schema.RECORDS for p in parts)
    rows = {r["prompt_id"]: r for r in run.read_table(run.data).to_pylist()}
    for p in prompts:
        assert [message_from_row(m) for m in rows[p.prompt_id]["messages"]] == list(p.messages)
        assert rows[p.prompt_id]["source_ref"] == p.source_ref
    image_row = rows[prompts[1].prompt_id]["messages"][1]
    assert image_row["content"] is None and image_row["parts"][0]["sha256"] == b
    assert image_row["parts"][0]["path"] is None and image_row["parts"][2]["text"] == "Compare them."
    loaded = datasets.load_dataset("parquet", data_files=[p.path for p in parts], split="train",
                                   cache_dir=str(tmp_path / "hf-cache"))
    assert loaded.num_rows == 4 and "source_ref" in loaded.column_names
    by_id = {r["prompt_id"]: r for r in loaded}
    assert by_id[prompts[1].prompt_id]["messages"][1]["parts"][0]["sha256"] == b
    assert by_id[prompts[2].prompt_id]["messages"][0]["content"] == "Why is the sky blue?"


def test_a_text_message_is_the_same_row_in_every_schema_and_parts_keep_only_their_keys():
    text = {"role": "user", "content": "hi"}
    assert message_from_row(message_row(text)) == text
    for old in ({"role": "user", "content": "hi"},  # schemas 1-4
                {"role": "user", "content": "hi", "tool_calls": None, "tool_call_id": None, "name": None}):  # 5
        assert message_from_row(old) == text
    parts = {"role": "user", "content": [{"type": "text", "text": "x"},
                                         part_of(b"\x89PNG", path="/data/coco/1.jpg", media_type="image/jpeg")]}
    row = message_row(parts)
    assert row["content"] is None and len(row["parts"][0]) == 8 and row["parts"][0]["sha256"] is None
    assert message_from_row(row) == parts
    assert message_from_row(message_row({"role": "tool", "content": [{"type": "text", "text": "31"}],
                                         "tool_call_id": "c1"})) == {"role": "tool", "tool_call_id": "c1",
                                                                     "content": [{"type": "text", "text": "31"}]}


@pytest.mark.parametrize("where", ["local", "s3"])
def test_each_image_is_copied_once_by_its_content_and_read_back_from_the_run(tmp_path, where, request):
    base = tmp_path / "out" if where == "local" else request.getfixturevalue("object_store")("images-once")
    run = new_run(Location.at(base) / "run")
    files = local_images(tmp_path / "src", range(4))
    fetched = [picture(10), picture(11)]
    first = stage([image_prompt(f"q{i}", [part_of(picture(i)), part_of(fetched[i])]) for i in range(2)],
                  dict(list(files.items())[:2]), fetched)
    first.commit(run)
    assert first.images.copied == 4 and first.images.present == 0
    # a refresh that reads two of the same images and two new ones copies only the new ones
    second = stage([image_prompt(f"q{i}", [part_of(picture(i))]) for i in range(4)]
                   + [image_prompt("again", [part_of(fetched[0])])], files, fetched[:1])
    second.commit(run)
    assert (second.images.copied, second.images.present) == (2, 3)
    stored = stored_images(run)
    assert len(stored) == 6 and all(sha(data) == name for name, data in stored.items())
    assert [v.name for v in run.prompt_set_versions()] == ["prompts-000001.parquet", "prompts-000002.parquet"]
    part = part_of(picture(0))
    assert read_image(run.path.uri, part) == picture(0)
    assert image_location(run.path.uri, part) == run.path / stored_image_path(part["sha256"])
    referenced = part_of(picture(3), path=str(files[sha(picture(3))]))
    assert read_image(run.path.uri, referenced) == picture(3), "images.store: reference reads from `path`"
    with pytest.raises(FileNotFoundError):
        read_image(run.path.uri, part_of(picture(99)))


def test_only_the_images_the_committed_prompts_name_are_copied(tmp_path):
    """The sources hand over each image as they read it, before they know whether its record is kept."""
    files = local_images(tmp_path / "src", range(3))
    staged = stage([image_prompt("kept", [part_of(picture(1)), part_of(picture(21))])], files,
                   [picture(20), picture(21)])
    run = new_run(tmp_path / "run")
    staged.commit(run)
    assert set(stored_images(run)) == {sha(picture(1)), sha(picture(21))} and staged.images.skipped == 3


def test_under_store_reference_local_images_are_not_copied_and_bytes_are(tmp_path):
    files = local_images(tmp_path / "src", range(3))
    prompts = [image_prompt("q", [part_of(data_path.read_bytes(), path=str(data_path)) for data_path in files.values()]
                            + [part_of(picture(20))])]
    staged = stage(prompts, files, [picture(20)], store="reference")
    run = new_run(tmp_path / "run")
    staged.commit(run)
    assert set(stored_images(run)) == {sha(picture(20))}, "only bytes with nowhere else to live are copied"
    row = run.prompt_set_reader(1).rows(run.prompt_set_reader(1).pending(set(), set(), True, 0).pending)[0]
    assert [p["path"] for p in row.messages[1]["content"][:3]] == [str(p) for p in files.values()]


def test_a_local_image_that_changed_before_the_commit_is_refused_by_name_and_the_set_not_committed(tmp_path):
    files = local_images(tmp_path / "src", range(6))
    staged = stage([image_prompt("q", [part_of(picture(i)) for i in range(6)])], files)
    changed = files[sha(picture(3))]
    changed.write_bytes(picture(33))
    run = new_run(tmp_path / "run")
    with pytest.raises(ImageChanged) as err:
        staged.commit(run)
    assert str(changed) in str(err.value) and sha(picture(3)) in str(err.value) and "rerun" in str(err.value)
    assert not run.prompt_set_versions() and not list(run.rejects.iterdir()), "the set was not committed"
    assert sha(picture(3)) not in stored_images(run), "no temporary file, and not the changed bytes"
    staged.discard()
    gone = stage([image_prompt("q", [part_of(picture(40))])], {sha(picture(40)): tmp_path / "never-there.png"})
    with pytest.raises(ImageChanged, match="never-there.png.*is gone"):
        gone.commit(run)


def test_a_refused_or_failed_build_writes_nothing_into_the_run_directory(tmp_path):
    run = new_run(tmp_path / "run")
    before = sorted(p.name for p in Path(run.path).rglob("*"))
    staged = stage([image_prompt("q", [part_of(picture(0))]), text_prompt("t")], local_images(tmp_path / "s", range(2)),
                   [picture(5)])
    folder = Path(staged._tmp.name)
    assert (folder / "images" / sha(picture(5))).exists(), "bytes wait in the staging folder"
    with pytest.raises(ConfigError) as err:
        check_schema_takes_parts(staged, 5)
    message = str(err.value)
    assert "1 prompts of the sources have images" in message and "records schema 5" in message
    assert "--new-run" in message and "nothing was written" in message
    assert sorted(p.name for p in Path(run.path).rglob("*")) == before and not folder.exists()
    check_schema_takes_parts(stage([text_prompt("t")]), 5)  # a set without parts goes into any run


def test_a_run_of_schema_5_refuses_an_image_prompt_set_on_refresh_and_says_new_run(tmp_path):
    from tests.test_tool_storage import run_with

    cfg, run_dir = run_with(tmp_path, "sample_messages", 5)
    from pipeline.run import materialise

    materialise(cfg, run_dir, refresh=False)
    versions = [v.name for v in run_dir.prompt_set_versions()]
    staged = stage([image_prompt("q", [part_of(picture(0))])], held=[picture(0)])
    with pytest.raises(ConfigError, match=r"records schema 5.*--new-run"):
        materialise(cfg, run_dir, refresh=True, staged=staged)
    assert [v.name for v in run_dir.prompt_set_versions()] == versions and not run_dir.images.exists()


def test_default_images_settings_keep_an_old_runs_identity_and_those_that_shape_the_set_change_it(tmp_path):
    from pipeline.core.config import load_config
    from pipeline.core.errors import DriftError
    from pipeline.run import GenerateOptions
    from tests.helpers import open_run_as_generate as open_run
    from tests.test_run_resolution import copy_of_todays_run

    path, run, _ = copy_of_todays_run(tmp_path)  # a run.json written by regen at 89263c8, with a failure committed
    raw = path.read_text()
    for images in ("", "images: {send_as: file_url, fetch_timeout_s: 5, tokens_per_image: 100, max_pixels: 40000000}"):
        path.write_text(f"{raw}\n{images}\n")
        opened = open_run(load_config(path), GenerateOptions(str(path)), RunDir(run))
        assert "images" not in opened.manifest["prompts"] and opened.manifest["fingerprint"] == "1a1c86c32cf65b40"
    path.write_text(f"{raw}\nimages: {{store: reference}}\n")
    with pytest.raises(DriftError) as err:
        open_run(load_config(path), GenerateOptions(str(path)), RunDir(run))
    assert err.value.diff[0] == "prompts.images.store: '<absent>' -> 'reference'" and "--refresh-prompts" in str(err.value)
    opened = open_run(load_config(path), GenerateOptions(str(path), refresh_prompts=True), RunDir(run))
    assert opened.manifest["fingerprint"] == "1a1c86c32cf65b40", "the generation identity is untouched"
    spec = str(REPO / "prompts_sources" / "sample_messages.yaml")
    limited = config(sources=[{"spec": spec}], max_prompt_tokens=4096, images={"tokens_per_image": 1024})
    assert limited.identity()["prompts"]["images"] == {"tokens_per_image": 1024}, \
        "with max_prompt_tokens, what an image counts selects the set"
    assert "images" not in config(sources=[{"spec": spec}], images={"tokens_per_image": 1024}).identity()["prompts"]


KILLED_COPY = textwrap.dedent("""
    import sys
    from pathlib import Path
    from tests.image_store_helpers import image_prompt, local_images, part_of, picture, stage
    from pipeline.store.rundir import RunDir
    files = local_images(Path(sys.argv[2]), range(8))
    every = [picture(s) for s in range(8)] + [picture(s) for s in range(20, 26)]
    staged = stage([image_prompt("q", [part_of(data) for data in every])], files, every[8:])
    staged.commit(RunDir(sys.argv[1]))
    print("not killed")
""")


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_sigkill_in_the_middle_of_the_image_copy_resumes_with_every_image_whole_and_once(tmp_path, where,
                                                                                           request):
    base = tmp_path / "out" if where == "local" else request.getfixturevalue("object_store")("images-kill")
    run = new_run(Location.at(base) / "run")
    # the 6th image published: killed after its bytes are under a temporary name, before the rename or copy
    plan = Faults(6, "kill", ops=frozenset({"link", "rename", "copy"}), where="/images/")
    env = {**os.environ, FAULT_ENV: plan.env_value(), "PYTHONPATH": str(REPO)}
    killed = subprocess.run([sys.executable, "-c", KILLED_COPY, run.path.uri, str(tmp_path / "src")], env=env,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    assert not run.prompt_set_versions(), "the prompt set comes after its images"
    temps = [e.name for e in run.images.iterdir() if e.name.startswith(".tmp-")]
    assert temps, "the killed copy left its temporary file at the top of images/"
    assert [t.name for t in run.cleanup_temp() if "/images/" in t.path] == temps
    before = stored_images(run)
    # the 6th publish kills the process; another of the 8 copying threads may publish one more in that instant
    assert len(before) in (5, 6) and all(sha(data) == name for name, data in before.items())

    files = local_images(tmp_path / "src", range(8))  # the same images, read again by the rerun
    every = [picture(s) for s in range(8)] + [picture(s) for s in range(20, 26)]
    again = stage([image_prompt("q", [part_of(data) for data in every])], files, every[8:])
    again.commit(run)
    assert (again.images.copied, again.images.present) == (14 - len(before), len(before))
    after = stored_images(run)
    assert len(after) == 14 and all(sha(data) == name for name, data in after.items())
    assert [v.name for v in run.prompt_set_versions()] == ["prompts-000001.parquet"]


def test_status_counts_image_prompts_from_the_prompt_set_without_reading_an_image(tmp_path):
    prompts = [image_prompt(f"q{i}", [part_of(picture(i))]) for i in range(3)] + [text_prompt("t")]
    run = new_run(tmp_path / "run")
    stage(prompts, held=[picture(i) for i in range(3)]).commit(run)
    run.write_manifest({"schema_version": 6})
    reader = run.prompt_set_reader(1)
    builder = RecordBuilder(reader, config())
    builder.work_items(reader.pending(set(), set(), True, 0).pending)
    committer = Committer(run, set(), 100, 60, schema.records_schema(6))
    for p in (prompts[0], prompts[3]):
        committer.add_records(builder.records(Outcome(p.prompt_id, DONE, "e", 1, [completion("a")]), 1))
    committer.flush()
    for name in stored_images(run):  # status never reads an image
        (run.images / name[:2] / name).unlink()
    counts = ledger_counts(run)
    assert (counts["total"], counts["done"], counts["pending"]) == (4, 2, 2)
    assert counts["image_prompts"] == {"total": 3, "done": 1, "pending": 2, "failed": 0}
