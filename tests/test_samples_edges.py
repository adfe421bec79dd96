"""samples_per_prompt at its edges, on real Parquet runs built by the record builder and the committer (and one
end to end on the SGLang emulator): a prompt with only some of its samples committed, a sample that failed and its
retry, greedy-equivalent sampling, the card's counts and its Samples section (empty completions, a large k)."""
from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import ConfigError
from pipeline.core.work import DONE, TERMINAL, Completion, Outcome, record_unit
from pipeline.export.card import write_card
from pipeline.export.diversity import sample_diversity
from pipeline.store.committer import Committer
from pipeline.store.records import RecordBuilder
from pipeline.store.rundir import RunDir
from tests.helpers import data_parts, emulators, run_regen, write_config, write_prompts, write_source
from tests.test_samples_units import IDS, config, prompt_set

ANSWER = Completion("an answer", None, "stop", 5, 2, None, None, "m", None, 0.1, "r", [1, 2], [3, 4])


def run_of(tmp_path, k: int, outcomes: dict[tuple[str, int], Completion | None]) -> RunDir:
    """A run of the two prompts of `prompt_set` with k samples each: (prompt, j) -> its completion, or None for a
    terminal failure; a unit not named stays pending."""
    cfg = config(tmp_path, f"samples_per_prompt: {k}\nsampling: {{temperature: 0.7}}\n")
    reader = prompt_set(tmp_path)
    run = RunDir(tmp_path / "run")
    run.create()
    run.write_manifest({"generation": cfg.generation_identity(), "schema_version": 5})
    builder = RecordBuilder(reader, cfg, fingerprint="f")
    committer = Committer(run, set(), flush_records=100, flush_interval_s=60)
    pending = {p.prompt_id: p for p in reader.pending(set(), set(), True, 0, samples=k).pending}
    for (pid, j), answer in outcomes.items():
        unit = pid if j == 0 else f"{pid}#s{j}"
        item = builder.work_items([pending[unit]])[0]
        if answer is None:
            committer.add_failure(builder.failure(Outcome(item.prompt_id, TERMINAL, "e", 3, message="x"), 3))
        else:
            committer.add_records(builder.records(Outcome(item.prompt_id, DONE, "e", 1, [answer]), 1))
    committer.flush()
    return run


def test_the_card_counts_a_failed_sample_zero_whose_sample_one_was_committed(tmp_path):
    # prompt 0: sample 0 failed for good, sample 1 committed; prompt 1: both committed
    run = run_of(tmp_path, 2, {(IDS[0], 0): None, (IDS[0], 1): ANSWER, (IDS[1], 0): ANSWER, (IDS[1], 1): ANSWER})
    assert run.failed_ids() - run.committed_ids() == {IDS[0]}, "the ledger: one sample failed"
    write_card(run.path)
    card = (run.path / "README.md").read_bytes().decode()
    assert "- terminal failures (samples without a record): 1 — terminal 1" in card, card


def test_min_p_of_one_is_greedy_decoding_and_refused_with_several_samples(tmp_path):
    # min_p keeps the tokens whose probability is at least min_p x the top one's: at 1 only the top token remains
    with pytest.raises(ConfigError) as err:
        config(tmp_path, "samples_per_prompt: 2\nsampling: {temperature: 0.8, min_p: 1.0}\n")
    assert "samples_per_prompt" in str(err.value) and "sampling.min_p" in str(err.value)
    assert config(tmp_path, "samples_per_prompt: 2\nsampling: {temperature: 0.8, min_p: 0.9}\n").samples_per_prompt == 2


def card_of(run: RunDir) -> str:
    write_card(run.path)
    return (run.path / "README.md").read_bytes().decode()


def test_an_empty_completion_is_compared_by_its_token_ids_not_counted_as_a_record_without_them(tmp_path):
    empty = Completion("", None, "stop", 5, 0, None, None, "m", None, 0.1, "r", [1, 2], [])
    other = Completion("two words", None, "stop", 5, 5, None, None, "m", None, 0.1, "r", [1, 2], [7, 8, 9, 10, 11])
    run = run_of(tmp_path, 2, {(IDS[0], 0): empty, (IDS[0], 1): other, (IDS[1], 0): ANSWER, (IDS[1], 1): other})
    card = card_of(run)
    assert "| distinct completions per prompt (min) | 2 |" in card
    assert "had no token ids" not in card, "every record has its token ids (one of them is empty)"


def test_a_large_k_bounds_the_samples_the_card_holds_and_the_pairs_it_compares(tmp_path):
    k = 40  # 780 pairs of each prompt's samples: the card compares the pairs of its first 16 (120)
    answers = {(pid, j): Completion("x", None, "stop", 5, 6, None, None, "m", None, 0.1, "r", [1, 2],
                                    list(range(j, j + 6))) for pid in IDS[:2] for j in range(k)}
    run = run_of(tmp_path, k, answers)
    card = card_of(run)
    assert "| distinct completions per prompt (min) | 40 |" in card
    assert "the Jaccard overlap over the pairs of each prompt's first 16 samples" in card
    # the samples' tokens held at once are bounded: past max_samples / k prompts, a smaller subset
    held = sample_diversity(run, k, 2, max_samples=k)
    assert (held.subset, held.prompts_measured, held.distinct_min) == (1, 1, 40)
    # 16 samples shifted by one token: consecutive ones share 2 of their 3 4-grams (Jaccard 0.5), the others fewer
    assert 0 < held.jaccard_mean < 0.5


def test_a_failed_sample_is_failed_alone_counted_per_sample_and_retried_into_exactly_once(tmp_path, ray_cluster):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 2)
    prompts.write_bytes(prompts.read_bytes() + b'{"prompt": "Name a POISONOUS plant."}\n')
    # the first request carrying the text is refused with 400 (a terminal failure): one sample of that prompt
    with emulators(1, preset="kimi", poison_text="POISONOUS", poison_fault="400", poison_times=1) as (server,):
        config = write_config(tmp_path, [{"url": server.url, "concurrency": 1, "name": "emu"}],
                              [write_source(tmp_path, prompts)], model="moonshotai/Kimi-K2.5",
                              sampling={"temperature": 0.8, "max_tokens": 8}, samples_per_prompt=2)
        assert run_regen("generate", "--config", str(config)).returncode == 0
        run = tmp_path / "out" / "t"
        rows = [r for part in data_parts(run) for r in pq.read_table(part).to_pylist()]
        failures = [r for p in sorted((run / "failures").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
        poisoned = next(r["prompt_id"] for r in rows if "POISONOUS" in r["messages"][-1]["content"])
        assert len(rows) == 5 and len(failures) == 1
        failed_unit = failures[0]["prompt_id"]
        assert failed_unit in (poisoned, f"{poisoned}#s1"), "a failure names the sample that failed"
        assert {record_unit(r) for r in rows} | {failed_unit} == {
            unit for r in rows for unit in (r["prompt_id"], f"{r['prompt_id']}#s1")}, "the other sample committed"
        status = run_regen("status", str(run)).stdout
        assert "samples (2 per prompt, 3 prompts) 6: done 5, failed 1, pending 0" in status, status
        assert "- terminal failures (samples without a record): 1" in card_of(RunDir(run))

        assert run_regen("generate", "--config", str(config), "--retry-failures").returncode == 0
        units = [record_unit(r) for part in data_parts(run) for r in pq.read_table(part).to_pylist()]
        assert len(units) == len(set(units)) == 6 and failed_unit in units, "retried: each sample exactly once"
        assert "6: done 6, failed 0, pending 0" in run_regen("status", str(run)).stdout
        assert "- terminal failures (samples without a record): 0" in card_of(RunDir(run))


def test_the_metrics_say_that_the_run_counts_samples_and_how_many_a_prompt():
    from prometheus_client import generate_latest

    from pipeline.dispatch.metrics import RunMetrics

    metrics = RunMetrics("r", "m", "f")
    metrics.status({"total": 18, "done": 6, "failed": 0, "pending": 12, "samples_per_prompt": 3})
    scrape = generate_latest(metrics.registry).decode()
    assert 'regen_prompts{run="r",state="total"} 18.0' in scrape, "regen_prompts counts samples (6 prompts x 3)"
    assert 'regen_samples_per_prompt{run="r"} 3.0' in scrape
