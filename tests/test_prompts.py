"""Normalisation, reject reasons, content-addressed prompt_id, limit selection, dedup and the sample set."""
from __future__ import annotations

import random
import re
from pathlib import Path

import orjson
import pytest

from pipeline.core.errors import ConfigError
from pipeline.prompts.prompt_set import (
    InvalidRecord, Prompt, RejectCode, build_prompt_set, normalise, prompt_id,
)
from pipeline.prompts.sources import SourceSpec, load_source_spec

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
SAMPLE_SPECS = [REPO / "prompts_sources" / f"sample_{n}.yaml" for n in ("sharegpt", "messages", "alpaca", "prompts")]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def jsonl_source(name: str, path: Path, fmt: str = "openai", **kw) -> SourceSpec:
    return SourceSpec(name=name, kind="jsonl", path=str(path), format=fmt, **kw)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def asst(text: str) -> dict:
    return {"role": "assistant", "content": text}


# --- normalisation -------------------------------------------------------------------------------
def test_normalise_maps_roles_strips_and_applies_nfc():
    raw = [{"role": " System", "content": "Be brief. "}, {"role": "Human", "content": "\n Cafe\u0301? "},
           {"role": "gpt", "content": "Yes."}, {"role": "user", "content": "More?"}]
    msgs, ref = normalise(raw)
    assert msgs == ({"role": "system", "content": "Be brief."}, user("Caf\u00e9?"), asst("Yes."), user("More?"))
    assert ref is None


def test_last_turn_moves_final_assistant_turn_to_reference_and_keeps_history():
    raw = [user("Q1"), asst("A1"), user("Q2"), {"role": "chatgpt", "content": "A2"}]
    msgs, ref = normalise(raw, "last_turn")
    assert msgs == (user("Q1"), asst("A1"), user("Q2")) and ref == "A2"


def test_all_turns_sends_the_whole_conversation_and_ids_only_system_and_user_turns():
    conv = [{"role": "system", "content": "S"}, user("Q1"), asst("A1"), user("Q2"), asst("A2")]
    msgs, ref = normalise(conv, "all_turns")
    assert msgs == tuple(conv) and ref is None
    other_answers = [{"role": "system", "content": "S"}, user("Q1"), asst("other"), user("Q2")]
    assert prompt_id(msgs, "all_turns") == prompt_id(other_answers, "all_turns")
    assert prompt_id(msgs, "all_turns") != prompt_id(normalise(conv)[0], "last_turn")


@pytest.mark.parametrize("raw, code", [
    ([], RejectCode.EMPTY),
    ([asst("Hi")], RejectCode.NO_USER_TURN),
    ([{"role": "system", "content": "S"}], RejectCode.NOTHING_TO_SEND),
    ([{"role": "user", "content": ["parts"]}], RejectCode.NON_STRING_CONTENT),
    ([user("  ")], RejectCode.BLANK_CONTENT),
    ([{"role": "tool", "content": "x"}], RejectCode.TOOL_RESULT_WITHOUT_CALL),  # issue 22: a role, not unknown
    ([{"role": "narrator", "content": "x"}], RejectCode.UNKNOWN_ROLE),
    ([{"role": None, "content": "x"}], RejectCode.UNKNOWN_ROLE),
    ([user("a"), user("b")], RejectCode.NOT_ALTERNATING),
    ([user("a"), asst("b"), asst("c")], RejectCode.NOT_ALTERNATING),
    ([user("a"), {"role": "system", "content": "late"}], RejectCode.SYSTEM_NOT_FIRST),
])
def test_normalise_rejects_defects(raw, code):
    with pytest.raises(InvalidRecord) as exc:
        normalise(raw)
    assert exc.value.code is code and len(exc.value.reason) > 10


def test_unknown_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="mode"):
        normalise([user("x")], "every_other_turn")


# --- the malformed fixture -----------------------------------------------------------------------
def test_malformed_file_gives_one_reject_per_defect_naming_the_line():
    s = jsonl_source("bad", DATA / "malformed.jsonl", "sharegpt", id_field="id")
    ps = build_prompt_set([(s, None)])
    by_line = {int(r.origin.rsplit(":", 1)[1]): r for r in ps.rejects}
    assert {line: r.code for line, r in by_line.items()} == {
        2: RejectCode.BAD_JSON, 3: RejectCode.NOT_OBJECT, 4: RejectCode.MISSING_FIELD, 5: RejectCode.EMPTY,
        6: RejectCode.NO_USER_TURN, 7: RejectCode.NON_STRING_CONTENT, 8: RejectCode.BLANK_CONTENT,
        9: RejectCode.UNKNOWN_ROLE, 10: RejectCode.NOT_ALTERNATING, 11: RejectCode.SYSTEM_NOT_FIRST,
        12: RejectCode.NOTHING_TO_SEND,
    }
    assert len(ps.rejects) == 11
    for line, r in by_line.items():
        assert r.source == "bad" and r.origin.endswith(f"malformed.jsonl:{line}")
        assert r.reason[0].isalpha() and len(r.reason.split()) >= 4, r.reason
    assert "'narrator'" in by_line[9].reason and "'conversations'" in by_line[4].reason
    assert '"no-field"' in by_line[4].raw and "this line is cut off" in by_line[2].raw

    refs = {p.source_ref: p for p in ps.prompts}
    assert set(refs) == {"ok-1", "ok-2", "ok-3"}
    assert refs["ok-2"].messages == ({"role": "system", "content": "You are brief."}, user("Name a primary colour."),
                                     asst("Red."), user("Another one?"))
    assert refs["ok-3"].reference == "Ciao!" and refs["ok-1"].origin.endswith("malformed.jsonl:1")
    (rep,) = ps.reports
    assert (rep.read, rep.valid, rep.rejected, rep.selected, rep.duplicates) == (14, 3, 11, 3, 0)


def test_reject_raw_is_truncated(tmp_path):
    f = write_jsonl(tmp_path / "big.jsonl", [{"messages": [asst("x" * 5000)]}, {"messages": [user("ok?")]}])
    (r,) = build_prompt_set([(jsonl_source("big", f), None)]).rejects
    assert len(r.raw) == 2000 and r.code == RejectCode.NO_USER_TURN


# --- identity ------------------------------------------------------------------------------------
def test_prompt_id_is_pinned():
    # Resume depends on this value never changing for the same content.
    assert prompt_id([user("Hello")]) == "91f211dd935540984a523a5ee3b89b50"
    assert prompt_id([user("Hello")], "all_turns") == "fc7442a85a0910747f8a24323e0ccfa5"
    assert re.fullmatch(r"[0-9a-f]{32}", prompt_id([user("x"), asst("y"), user("z")]))


def test_prompt_id_ignores_source_name_position_reference_and_id_field(tmp_path):
    target = [user("What is a comet?")]
    a = write_jsonl(tmp_path / "a.jsonl", [{"messages": [user("filler")], "id": 1},
                                           {"messages": target + [asst("An icy body.")], "id": "first"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"messages": [user("  What is a comet? ")], "uid": "zzz"}])
    pa = build_prompt_set([(jsonl_source("alpha", a, id_field="id"), None)])
    pb = build_prompt_set([(jsonl_source("beta", b, id_field="uid"), None)])
    comet_a = next(p for p in pa.prompts if p.messages == tuple(target))
    (comet_b,) = pb.prompts
    assert comet_a.prompt_id == comet_b.prompt_id == prompt_id(target)
    assert (comet_a.reference, comet_a.source_ref, comet_b.reference, comet_b.source_ref) == (
        "An icy body.", "first", None, "zzz")
    assert prompt_id(target) != prompt_id([user("What is a comet?!")])
    assert prompt_id(target) != prompt_id([{"role": "system", "content": "Be brief."}] + target)


# --- dedup ---------------------------------------------------------------------------------------
def test_dedup_across_sources_keeps_the_first_source_in_config_order(tmp_path):
    shared = {"messages": [user("Shared question?")]}
    a = write_jsonl(tmp_path / "a.jsonl", [{"messages": [user("Only in A?")]}, shared])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "Shared question?"}, {"prompt": "Only in B?"}])
    sa, sb = jsonl_source("A", a), jsonl_source("B", b, "prompt")

    ps = build_prompt_set([(sa, None), (sb, None)])
    assert len(ps.prompts) == 3 and ps.duplicates == 1
    assert next(p for p in ps.prompts if p.messages == (user("Shared question?"),)).source == "A"
    assert [(r.name, r.selected, r.duplicates) for r in ps.reports] == [("A", 2, 0), ("B", 1, 1)]

    flipped = build_prompt_set([(sb, None), (sa, None)])
    assert next(p for p in flipped.prompts if p.messages == (user("Shared question?"),)).source == "B"
    assert [(r.name, r.duplicates) for r in flipped.reports] == [("B", 0), ("A", 1)]


def test_in_source_duplicates_collapse_to_the_first_occurrence(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"messages": [user("Same?")]}, {"messages": [user("Other?")]},
                                           {"messages": [user("Same?"), asst("a reply")]}])
    ps = build_prompt_set([(jsonl_source("d", f), None)])
    same = next(p for p in ps.prompts if p.messages == (user("Same?"),))
    assert same.origin.endswith("d.jsonl:1") and same.reference is None
    assert (ps.reports[0].valid, ps.reports[0].selected, ps.duplicates) == (3, 2, 1)


def test_duplicate_source_names_are_refused(tmp_path):
    f = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "Hi"}])
    with pytest.raises(ConfigError, match="'?twin'?"):
        build_prompt_set([(jsonl_source("twin", f, "prompt"), None), (jsonl_source("twin", f, "prompt"), None)])


# --- limit ---------------------------------------------------------------------------------------
def _questions(n: int) -> list[dict]:
    return [{"prompt": f"What is {i} plus {i + 1}?"} for i in range(n)]


def test_limit_selects_the_same_prompts_in_the_same_order_when_the_file_is_shuffled(tmp_path):
    rows = _questions(60)
    shuffled = rows[:]
    random.Random(7).shuffle(shuffled)
    a = jsonl_source("q", write_jsonl(tmp_path / "a.jsonl", rows), "prompt", limit=15)
    b = jsonl_source("q", write_jsonl(tmp_path / "b.jsonl", shuffled), "prompt", limit=15)
    ids_a = [p.prompt_id for p in build_prompt_set([(a, None)], seed=3).prompts]
    ids_b = [p.prompt_id for p in build_prompt_set([(b, None)], seed=3).prompts]
    assert len(ids_a) == 15 and ids_a == ids_b
    assert build_prompt_set([(a, None)], seed=3).reports[0].selected == 15
    other_seed = [p.prompt_id for p in build_prompt_set([(a, None)], seed=4).prompts]
    assert set(other_seed) != set(ids_a)


def test_run_limit_overrides_the_spec_limit(tmp_path):
    s = jsonl_source("q", write_jsonl(tmp_path / "q.jsonl", _questions(30)), "prompt", limit=20)
    assert len(build_prompt_set([(s, None)]).prompts) == 20
    assert len(build_prompt_set([(s, 5)]).prompts) == 5
    no_limit = SourceSpec("q", "jsonl", str(tmp_path / "q.jsonl"), "prompt")
    assert len(build_prompt_set([(no_limit, None)]).prompts) == 30


def test_limit_counts_only_what_a_source_adds_after_cross_source_dedup(tmp_path):
    # Regression: the limit picked 4 of B's prompts before dedup, so B's duplicates of A left fewer than 4.
    rows = _questions(20)
    a = jsonl_source("A", write_jsonl(tmp_path / "a.jsonl", rows[:10]), "prompt")
    b = jsonl_source("B", write_jsonl(tmp_path / "b.jsonl", rows), "prompt", limit=4)
    ps = build_prompt_set([(a, None), (b, None)])
    assert len(ps.prompts) == 14 and [p.source for p in ps.prompts].count("B") == 4
    assert (ps.reports[1].selected, ps.reports[1].duplicates, ps.duplicates) == (4, 10, 10)
    only_new = {p.prompt_id for p in build_prompt_set([(jsonl_source("B", write_jsonl(
        tmp_path / "new.jsonl", rows[10:]), "prompt", limit=4), None)]).prompts}
    assert {p.prompt_id for p in ps.prompts if p.source == "B"} == only_new  # the same rank order among new ones


# --- the project-written sample set --------------------------------------------------------------
@pytest.fixture(scope="module")
def sample():
    return build_prompt_set([(load_source_spec(f), None) for f in SAMPLE_SPECS])


def test_sample_set_builds_clean_with_at_least_100_prompts(sample):
    assert sample.rejects == [] and len(sample.prompts) >= 100
    assert [r.name for r in sample.reports] == ["sample_sharegpt", "sample_messages", "sample_alpaca",
                                                "sample_prompts"]
    assert all(r.read == r.valid and r.selected > 0 for r in sample.reports)
    assert len({p.prompt_id for p in sample.prompts}) == len(sample.prompts)


def test_sample_set_mixes_shapes(sample):
    multi = [p for p in sample.prompts if sum(m["role"] == "user" for m in p.messages) >= 2]
    with_ref = [p for p in sample.prompts if p.reference]
    with_system = [p for p in sample.prompts if p.messages[0]["role"] == "system"]
    assert len(multi) >= 20 and len(with_ref) >= 30 and len(with_system) >= 10
    assert all(p.messages[-1]["role"] == "user" for p in sample.prompts)
    assert {p.source for p in multi} >= {"sample_sharegpt", "sample_messages"}


def test_sample_conversations_are_short_enough_for_a_small_context(sample):
    for p in sample.prompts:
        words = sum(len(m["content"].split()) for m in p.messages) + len((p.reference or "").split())
        assert words <= 120, p.origin


def test_sample_duplicates_across_files_are_collapsed_into_the_first_source(sample):
    assert sample.duplicates == 3
    assert sum(r.duplicates for r in sample.reports) == 3
    black_hole = [p for p in sample.prompts if p.messages == (user("Explain what a black hole is in simple terms."),)]
    assert len(black_hole) == 1 and black_hole[0].source == "sample_sharegpt"
    assert black_hole[0].reference and black_hole[0].origin.startswith("sample/sharegpt.jsonl:")


def test_sample_output_order_is_deterministic(sample):
    again = build_prompt_set([(load_source_spec(f), None) for f in SAMPLE_SPECS])
    assert [p.prompt_id for p in again.prompts] == [p.prompt_id for p in sample.prompts]
    assert isinstance(sample.prompts[0], Prompt)
