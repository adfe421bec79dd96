"""The prompt set read by position, a row group at a time (issue 25): the driver holds per pending prompt only its
id, row and routing key; a resume hands out each prompt its own messages; reads of the store are retried."""
from __future__ import annotations

import random
import re
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from pipeline.core.config import load_config
from pipeline.core.errors import StorageError
from pipeline.core.work import affinity_key
from pipeline.dispatch.routing import Router
from pipeline.endpoints.probes import PROBE_RID_PREFIX
from pipeline.prompts.prompt_set import normalise, prompt_id
from pipeline.prompts.tool_calls import message_from_row
from pipeline.store import prompt_reader, schema
from pipeline.store.faults import Faults
from pipeline.store.prompt_reader import ROUTE_KEY, PendingPrompt, PromptSetReader
from pipeline.store.records import RecordBuilder
from pipeline.store.rundir import RunDir
from pipeline.store.seam import arm
from pipeline.store.storage import Location
from tests.helpers import run_regen, write_config, write_source
from tests.s3_fault_proxy import FaultProxy

MODEL = "moonshotai/Kimi-K2.5"


def conversations(n: int, seed: int = 0) -> list[dict]:
    """Multi-turn ShareGPT rows of uneven length; each conversation names its number in every turn."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        turns = []
        for t in range(rng.randint(1, 3)):
            turns += [{"from": "human", "value": f"conversation {i} turn {t}: " + "why " * rng.randint(1, 40)},
                      {"from": "gpt", "value": f"answer {i}.{t} " + "because " * rng.randint(1, 40)}]
        rows.append({"conversations": turns})
    return rows


def expected_messages(rows: list[dict], mode: str = "last_turn") -> dict[str, list[dict]]:
    """Each source conversation's messages as sent, by prompt id, computed from the source itself."""
    out = {}
    for row in rows:
        raw = [{"role": m["from"], "content": m["value"]} for m in row["conversations"]]
        messages, _ = normalise(raw, mode)
        out[prompt_id(messages, mode)] = [dict(m) for m in messages]
    return out


def prompt_table(expected: dict[str, list[dict]], affinity_chars: int) -> pa.Table:
    return pa.Table.from_pylist(
        [{"prompt_id": pid, "source": "s", "origin": f"f.jsonl:{i}", "messages": messages,
          "route_key": affinity_key(messages, affinity_chars)} for i, (pid, messages) in enumerate(expected.items())],
        schema=prompt_reader.route_schema(schema.PROMPTS, affinity_chars))


def test_handing_out_work_reads_a_few_row_groups_at_a_time_and_each_prompt_gets_its_own_messages(tmp_path):
    expected = expected_messages(conversations(600))
    path = tmp_path / "prompts-000001.parquet"
    pq.write_table(prompt_table(expected, 256), path, row_group_size=10)  # 60 row groups
    reader = PromptSetReader(Location.at(path), cached_groups=4)
    done = set(list(expected)[::3])  # a resume: every third prompt is committed
    scan = reader.pending(done, set(), True, 256)
    assert (scan.total, scan.done, len(scan.pending)) == (600, 200, 400)
    assert all(isinstance(p, PendingPrompt) for p in scan.pending), "the driver holds no messages while queued"

    builder = RecordBuilder(reader, _config(tmp_path))
    router = Router(affinity=True)
    router.set_endpoints(["e0", "e1", "e2", "e3"])
    router.add(scan.pending)
    handed = {}
    rng = random.Random(1)
    while len(router):
        label = rng.choice(["e0", "e1", "e2", "e3"])
        for item in builder.work_items(router.take(label, rng.randint(1, 12), lambda _: True, True)):
            assert item.prompt_id not in handed, "a prompt handed out twice"
            handed[item.prompt_id] = orjson.loads(item.messages_json)
            assert item.affinity == affinity_key(handed[item.prompt_id], 256)
    assert handed == {pid: m for pid, m in expected.items() if pid not in done}
    assert reader.max_rows_held <= 4 * 10, f"the reader held {reader.max_rows_held} rows of 600"
    assert len(builder.in_flight) == 400, "rows stay with their in-flight prompt until the record is built"


def _config(tmp_path: Path):
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nkind: jsonl\npath: unused.jsonl\nformat: sharegpt\n")
    return load_config(write_config(tmp_path, [{"url": "http://127.0.0.1:9", "name": "e0"}], [spec]))


def test_a_failed_read_of_the_prompt_set_is_retried_and_an_outage_stops_with_a_storage_error(tmp_path, monkeypatch):
    monkeypatch.setattr(prompt_reader, "READ_RETRY_S", 0.01)
    expected = expected_messages(conversations(30))
    path = tmp_path / "prompts-000001.parquet"
    pq.write_table(prompt_table(expected, 0), path, row_group_size=8)
    reader = PromptSetReader(Location.at(path))
    pending = reader.pending(set(), set(), True, 0).pending
    glitch = Faults(1, "EIO", ops=frozenset({"read"}), where="prompts-000001")
    previous = arm(glitch)
    try:
        rows = reader.rows(pending[:5])
    finally:
        arm(previous)
    assert len(glitch.fired) == 1 and [r.messages for r in rows] == list(expected.values())[:5]

    reader = PromptSetReader(Location.at(path))
    outage = Faults(1, "EIO", persistent=True, ops=frozenset({"read"}), where="prompts-000001")
    previous = arm(outage)
    try:
        with pytest.raises(StorageError, match="prompts-000001.parquet"):
            reader.rows(pending[5:6])
    finally:
        arm(previous)
    assert len(outage.fired) >= prompt_reader.READ_ATTEMPTS, "each attempt read the store again"


@pytest.fixture(scope="module")
def s3_proxy(object_store):
    moto_port = int(re.search(r"endpoint_override=127\.0\.0\.1:(\d+)", object_store("x")).group(1))
    proxy = FaultProxy(moto_port).start()
    yield proxy
    proxy.stop()


def test_a_prompt_set_on_s3_is_read_by_position_and_a_refused_request_is_retried(tmp_path, s3_proxy, monkeypatch):
    monkeypatch.setattr(prompt_reader, "READ_RETRY_S", 0.01)
    no_retry = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{s3_proxy.port}", scheme="http",
                                 allow_delayed_open=True,
                                 retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
    run = RunDir(Location("regen-test/reader/run", "s3", f"endpoint_override=127.0.0.1:{s3_proxy.port}&scheme=http",
                          no_retry))
    expected = expected_messages(conversations(50))
    run.write_prompt_set(prompt_table(expected, 64), schema.REJECTS.empty_table())
    reader = run.prompt_set_reader()
    pending = reader.pending(set(), set(), True, 64).pending
    s3_proxy.arm(1, "503")  # SlowDown on the next request, which the SDK is told not to retry
    try:
        rows = reader.rows(pending[40:45] + pending[:2])
    finally:
        plan = s3_proxy.disarm()
    assert plan.fired, "the fault reached the reader"
    assert [r.messages for r in rows] == [expected[p.prompt_id] for p in pending[40:45] + pending[:2]]
    reader = run.prompt_set_reader()  # its footer read: the outage hits the row group
    s3_proxy.arm(1, "403", persistent=True)
    try:
        with pytest.raises(StorageError, match="prompts-000001.parquet"):
            reader.rows(pending[:1])
    finally:
        s3_proxy.disarm()


def test_a_resume_sends_each_pending_prompt_its_own_messages_from_an_older_prompt_set(
        tmp_path, ray_cluster, emulator_fleet):
    """The stored set is rewritten as an older regen left it (no route_key column, one row group of many) split
    into row groups of 7, and a third of the records are removed: the resume sends exactly those prompts, each
    with the messages its source conversation has (prompt ids are hashes of them, so a wrong row cannot pass)."""
    rows = conversations(60, seed=3)
    expected = expected_messages(rows)
    data = tmp_path / "chats.jsonl"
    data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    endpoints = [{"url": s.url, "concurrency": 4, "name": f"emu-{i}"} for i, s in enumerate(emulator_fleet)]
    config = write_config(tmp_path, endpoints, [write_source(tmp_path, data, fmt="sharegpt")], model=MODEL,
                          flush_records=10)
    assert run_regen("generate", "--config", str(config)).returncode == 0
    run = tmp_path / "out" / "t"
    stored = run / "prompts" / "prompts-000001.parquet"
    assert ROUTE_KEY in pq.read_schema(stored).names, "a new prompt set stores its routing keys"
    older = pq.read_table(stored).drop_columns([ROUTE_KEY]).replace_schema_metadata(None)
    pq.write_table(older, stored, row_group_size=7)
    parts = sorted((run / "data").glob("part-*.parquet"))
    removed = {pid for part in parts[::3] for pid in pq.read_table(part, columns=["prompt_id"]).column(0).to_pylist()}
    for part in parts[::3]:
        part.unlink()
    before = [_log_lines(s) for s in emulator_fleet]

    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    sent = [line for s, skip in zip(emulator_fleet, before) for line in _log_lines(s)[len(skip):]
            if not line["rid"].startswith(PROBE_RID_PREFIX)]
    sent_ids = [prompt_id(line["messages"]) for line in sent]
    assert set(sent_ids) == removed, "the resume sends exactly the prompts without a record"
    for pid, line in zip(sent_ids, sent):
        assert line["messages"] == expected[pid]
    records = [r for p in sorted((run / "data").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert sorted(r["prompt_id"] for r in records) == sorted(expected), "nothing lost, nothing doubled"
    assert all([message_from_row(m) for m in r["messages"]] == expected[r["prompt_id"]] for r in records)


def _log_lines(server) -> list[dict]:
    path = Path(server.options["request_log"])
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()] if path.exists() else []


def test_a_run_reads_the_prompt_set_version_its_run_json_records_not_a_newer_one(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    for n in (3, 5):  # a refresh adds a newer version
        run.write_prompt_set(prompt_table(expected_messages(conversations(n)), 0), schema.REJECTS.empty_table())
    assert run.prompt_set_reader(1).num_rows == 3 and run.prompt_set_reader(1).name == "prompts-000001.parquet"
    assert run.prompt_set_reader(2).num_rows == 5 and run.prompt_set_reader().num_rows == 5
    assert run.prompt_set_reader(7).num_rows == 5, "a record past the versions there: the newest (resume restages)"
