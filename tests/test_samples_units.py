"""samples_per_prompt without a fleet: unit ids, seeds, the identity (raise with --add-samples, lower refused), and
the store keyed by sample (pending set, record builder, committer, ledger) on real Parquet files."""
from __future__ import annotations

import hashlib
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError
from pipeline.core.identity import check_identity, identity_fingerprint
from pipeline.core.work import DONE, Completion, Outcome, record_unit, split_unit, unit_id
from pipeline.prompts.conversation import sample_seed, seed_for
from pipeline.store import schema
from pipeline.store.committer import Committer
from pipeline.store.prompt_reader import PromptSetReader
from pipeline.store.records import RecordBuilder
from pipeline.store.rundir import RunDir
from pipeline.store.storage import Location

SAMPLE_SPEC = Path(__file__).resolve().parent.parent / "prompts_sources" / "sample_prompts.yaml"
BASE = f"""
run_name: r
model: m
sources: [{{spec: {SAMPLE_SPEC}}}]
endpoints: [{{url: "http://127.0.0.1:1/v1", concurrency: 2}}]
"""
IDS = [hashlib.sha256(str(i).encode()).hexdigest()[:32] for i in range(4)]  # as prompts/normalise.py makes them


def config(tmp_path, extra: str = ""):
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(BASE) + extra)
    return load_config(path)


def test_unit_ids_round_trip_and_sample_zero_is_the_prompt_itself():
    for pid in IDS:
        assert unit_id(pid, 0) is pid and unit_id(pid, None) is pid
        for j in range(5):
            assert split_unit(unit_id(pid, j)) == (pid, j)
    assert unit_id(IDS[0], 2) == f"{IDS[0]}#s2"
    assert record_unit({"prompt_id": IDS[0], "sample_index": 3}) == f"{IDS[0]}#s3"
    assert record_unit({"prompt_id": IDS[0], "sample_index": None}) == IDS[0]
    assert record_unit({"prompt_id": f"{IDS[0]}#s1"}) == f"{IDS[0]}#s1", "a failure row names its unit"


def test_sample_seeds_differ_from_each_other_and_from_every_turn_seed():
    for pid in IDS:
        assert sample_seed(pid, 0, 0.8) == seed_for(pid, 0.8), "sample 0 keeps today's seed"
        seeds = [sample_seed(pid, j, 0.8) for j in range(8)]
        assert len(set(seeds)) == 8 and all(0 <= s < 2 ** 31 for s in seeds)
        turn_seeds = {s + k for s in seeds for k in range(1, 16)}  # all_turns: generation k uses seed + k
        assert not set(seeds) & turn_seeds, "a sample's seed is never another sample's turn seed"
        assert sample_seed(pid, 1, 0.0) is None


def test_k_enters_the_identity_only_when_it_is_not_one(tmp_path):
    one, default = config(tmp_path, "samples_per_prompt: 1\n"), config(tmp_path)
    assert "samples_per_prompt" not in one.generation_identity()
    assert one.fingerprint() == default.fingerprint(), "existing runs keep their fingerprint"
    three = config(tmp_path, "samples_per_prompt: 3\nsampling: {temperature: 0.7}\n")
    assert three.generation_identity()["samples_per_prompt"] == 3
    assert identity_fingerprint(three.generation_identity()) != config(
        tmp_path, "sampling: {temperature: 0.7}\n").fingerprint()


@pytest.mark.parametrize("sampling, names", [("{temperature: 0}", "sampling.temperature"),
                                             ("{temperature: 0.7, top_k: 1}", "sampling.top_k")])
def test_greedy_sampling_with_several_samples_is_a_config_error(tmp_path, sampling, names):
    with pytest.raises(ConfigError) as err:
        config(tmp_path, f"samples_per_prompt: 2\nsampling: {sampling}\n")
    assert "samples_per_prompt" in str(err.value) and names in str(err.value)


def test_raising_k_needs_the_flag_and_lowering_is_refused_even_with_it(tmp_path):
    stored = {"identity_version": 2, **config(tmp_path, "sampling: {temperature: 0.7}\n").identity()}
    raised = config(tmp_path, "samples_per_prompt: 3\nsampling: {temperature: 0.7}\n").identity()
    refused = check_identity(stored, raised, refresh_prompts=False)
    assert not refused.resumable and "--add-samples" in refused.drift[0]
    allowed = check_identity(stored, raised, refresh_prompts=False, add_samples=True)
    assert allowed.resumable and allowed.raised_samples == (1, 3)
    stored3 = {"identity_version": 2, **raised}
    for target in ("samples_per_prompt: 2\n", ""):
        lowered = config(tmp_path, target + "sampling: {temperature: 0.7}\n").identity()
        check = check_identity(stored3, lowered, refresh_prompts=False, add_samples=True)
        assert not check.resumable and "lowering it is refused" in check.drift[0]


def prompt_set(folder: Path) -> PromptSetReader:
    rows = [{"prompt_id": pid, "source": "s", "origin": f"o:{i}", "source_ref": None,
             "messages": [{"role": "user", "content": f"question {i}"}], "reference": None} for i, pid in
            enumerate(IDS[:2])]
    table = pa.Table.from_pylist(rows, schema=pa.schema([f for f in schema.PROMPTS if f.name != "route_key"]))
    path = Location.at(folder / "prompts-000001.parquet")
    import pyarrow.parquet as pq
    pq.write_table(table, str(path))
    return PromptSetReader(path)


def test_each_sample_is_a_unit_of_its_own_in_the_pending_set_records_committer_and_ledger(tmp_path):
    cfg = config(tmp_path, "samples_per_prompt: 3\nsampling: {temperature: 0.7}\n")
    reader = prompt_set(tmp_path)
    pending = reader.pending(set(), set(), True, 0, samples=3)
    assert [p.prompt_id for p in pending.pending] == [unit_id(pid, j) for pid in IDS[:2] for j in range(3)]
    assert pending.total == 6, "totals count samples"
    builder = RecordBuilder(reader, cfg, fingerprint="f")
    items = builder.work_items(pending.pending)
    assert len({item.seed for item in items}) == 6
    run = RunDir(tmp_path / "run")
    run.create()
    committer = Committer(run, set(), flush_records=100, flush_interval_s=60)
    answer = Completion("an answer", None, "stop", 5, 2, None, None, "m", None, 0.1, "r", [1, 2], [3, 4])
    for item in items:
        assert committer.add_records(builder.records(Outcome(item.prompt_id, DONE, "e", 1, [answer]), 1))
    committer.flush()
    rows = run.read_table(run.data).to_pylist()
    assert [(r["prompt_id"], r["sample_index"]) for r in rows] == [(pid, j) for pid in IDS[:2] for j in range(3)]
    assert run.committed_ids() == {p.prompt_id for p in pending.pending}
    # a late copy of sample 1 is a duplicate; sample 1 was never one of sample 0
    builder.in_flight[items[1].prompt_id] = builder.reader.rows([pending.pending[1]])[0]
    late = builder.records(Outcome(items[1].prompt_id, DONE, "e", 1, [answer]), 1)
    assert not committer.add_records(late) and committer.dropped_duplicates == 1
    again = reader.pending(run.committed_ids(), set(), True, 0, samples=4)
    assert [p.prompt_id for p in again.pending] == [unit_id(pid, 3) for pid in IDS[:2]], "raising k adds only new"


def test_the_samples_a_change_of_k_adds_or_leaves_past_are_named_in_words():
    from pipeline.core.identity import new_samples

    assert new_samples(2, 3) == "sample 2"  # raising 2 -> 3 adds sample 2
    assert new_samples(1, 4) == "samples 1 to 3"
    assert new_samples(2, 4) == "samples 2 to 3"  # lowering 4 -> 2 leaves samples 2 and 3 past the new k
