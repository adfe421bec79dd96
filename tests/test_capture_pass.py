"""What a capture pass does beyond the happy path: `follow` beside a live generation (the last commit is never
missed, one actor lives across passes), a record the route cannot take fails alone and is named, a turn without
token ids is refused alone, the free-space check speaks in human units, status names failed prompts, and a model
too small for the default aux layers is told to set them."""
from __future__ import annotations

import os
import shutil

import orjson
import pytest

from pipeline.core.capture_config import load_capture_config
from pipeline.hidden.parts import hidden_parts
from pipeline.store.capture_ledger import capture_run_dir
from tests.capture_helpers import (  # noqa: F401 (fixtures by name)
    config_file, new_capture, tiny_llama, tok,
)
from tests.smollm2_run import make_smollm2_run, smollm2_records


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.torch


def hold_generation_lock(run, script: str):
    """A live generation in another process: holds RUN's lock while `script` runs (`run`, `recs`, `add_part`)."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from pipeline.store.rundir import RunDir, RunLock
        from pipeline.store.capture_ledger import capture_run_dir
        from tests.smollm2_run import add_part, smollm2_records
        from transformers import AutoTokenizer
        from tests.smollm2_hf import smollm2_hf_dir
        recs = smollm2_records(AutoTokenizer.from_pretrained(smollm2_hf_dir()))
        run = RunDir({str(run.path)!r})
        cap = capture_run_dir(run)
        with RunLock(run):
            print("locked", flush=True)
    """) + textwrap.indent(textwrap.dedent(script), "    ")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout.readline().strip() == "locked"
    return proc


def all_turns_records(tok, pid, turns, no_ids_turn=None):
    from pipeline.store.quality import quality_flags

    end = tok.convert_tokens_to_ids("<|im_end|>")
    rows, messages = [], []
    for k, (user, reply) in enumerate(turns):
        messages = messages + [{"role": "user", "content": user}]
        prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        output = tok.encode(reply, add_special_tokens=False) + [end]
        ids = k != no_ids_turn
        rows.append({"prompt_id": pid, "turn_index": k, "n_turns": len(turns), "source": "test", "messages": messages,
                     "content": reply, "reasoning_content": None, "finish_reason": "stop",
                     "flags": quality_flags(reply, None, "stop"), "prompt_tokens": len(prompt),
                     "completion_tokens": len(output), "endpoint": "e0", "model": "SmolLM2-135M-Instruct",
                     "config_fingerprint": "fp-smollm2", "prompt_token_ids": prompt if ids else None,
                     "output_token_ids": output if ids else None})
        messages = messages + [{"role": "assistant", "content": reply}]
    return rows


def test_follow_captures_the_last_commit_made_while_it_was_between_listing_and_the_lock_check(
        tmp_path, ray_cluster, tok):
    """The race forced: the pass that finds nothing new lets generation commit its last part and release its lock
    before the capture looks at the lock (a wrapper around the real pending_samples)."""
    import subprocess
    import sys
    import textwrap

    model = tiny_llama(tmp_path / "model")
    run = make_smollm2_run(tmp_path / "run", [smollm2_records(tok)[:1]])
    go, done = tmp_path / "go", tmp_path / "done"
    holder = hold_generation_lock(run, f"""
        while not Path({str(go)!r}).exists(): time.sleep(0.05)
        add_part(run, recs[1:])  # generation's last commit, then its lock is released
    """)
    config = config_file(tmp_path, model, follow=True, poll_interval_s=0.2)
    child = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        import pipeline.capture as pc
        real, calls = pc.pending_samples, [0]
        def wrapped(*a, **k):
            out = real(*a, **k)
            calls[0] += 1
            if calls[0] == 2 and not out.prompts:
                Path({str(go)!r}).touch()
                while Path({str(go)!r}).exists() and not Path({str(done)!r}).exists(): time.sleep(0.05)
            return out
        pc.pending_samples = wrapped
        sys.argv = ["regen", "capture", {str(run.path)!r}, "--config", {str(config)!r}]
        from pipeline.cli import main; sys.exit(main())
    """)
    import threading

    threading.Thread(target=lambda: (holder.wait(), done.touch()), daemon=True).start()
    try:
        proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    finally:
        holder.kill()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "capture complete" in proc.stderr
    assert sorted(capture_run_dir(run).committed_ids()) == ["p0", "p1", "p2", "p3"]


def test_follow_keeps_one_actor_across_passes(tmp_path, ray_cluster, tok):
    from pipeline.hidden.parts import HIDDEN_PART_RE
    from tests.helpers import run_regen

    model = tiny_llama(tmp_path / "model")
    run = make_smollm2_run(tmp_path / "run", [smollm2_records(tok)[:1]])
    holder = hold_generation_lock(run, """
        for k in (1, 2, 3):  # a commit each time the capture has caught up
            while not (cap.exists() and len(cap.committed_ids()) >= k): time.sleep(0.1)
            add_part(run, recs[k:k + 1])
        while len(cap.committed_ids()) < 4: time.sleep(0.1)
    """)
    try:
        proc = run_regen("capture", str(run.path), "--config",
                         str(config_file(tmp_path, model, follow=True, poll_interval_s=0.2)))
    finally:
        holder.kill()
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = [HIDDEN_PART_RE.match(p.name) for p in hidden_parts(capture_run_dir(run))]
    assert len(parts) == 4 and len({m.group(1) for m in parts}) == 1
    # one actor (its model loaded once) wrote the four passes' parts: its part counter ran on, 1 to 4
    assert sorted(int(m.group(4)) for m in parts) == [1, 2, 3, 4]


def test_a_record_the_route_cannot_take_fails_alone_and_is_named(tmp_path, ray_cluster, tok):
    from tests.helpers import run_regen

    model = tiny_llama(tmp_path / "model")
    records = smollm2_records(tok)
    records[2]["output_token_ids"] = records[2]["output_token_ids"][:-1] + [60000]  # past the 49152-token vocab
    run = make_smollm2_run(tmp_path / "run", [records])
    proc = run_regen("capture", str(run.path), "--config", str(config_file(tmp_path, model, prompts_per_call=4)))
    assert proc.returncode == 1
    assert sorted(capture_run_dir(run).committed_ids()) == ["p0", "p1", "p3"]  # its batch's good prompts captured
    failed = [line for line in proc.stderr.splitlines() if "capture of prompt" in line]
    assert len(failed) == 1 and "prompt p2" in failed[0] and "token id 60000" in failed[0], proc.stderr[-3000:]
    assert '"failed_prompts":1' in proc.stderr


def capture_then_export_ids(tmp_path, run) -> tuple[list[str], list[str]]:
    """`regen capture` on the run, then the sample ids its ledger holds and those `specforge-tokens` exports."""
    from pipeline.cli import main
    from tests.helpers import run_regen

    proc = run_regen("capture", str(run.path), "--config", str(config_file(tmp_path, tiny_llama(tmp_path / "m"))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cap = capture_run_dir(run)
    captured = sorted(cap.read_table(cap.data).column("sample_id").to_pylist())
    assert main(["export", str(run.path), "--format", "specforge-tokens", "--out", str(tmp_path / "t.jsonl")]) == 0
    exported = sorted(orjson.loads(line)["id"] for line in (tmp_path / "t.jsonl").read_text().splitlines())
    return captured, exported


def test_all_turns_a_turn_without_ids_is_refused_alone_and_the_capture_completes(tmp_path, ray_cluster, tok):
    from pipeline.store.capture_ledger import capture_counts

    records = (all_turns_records(tok, "a", [("Hi there.", "Hello!"), ("Name a colour.", "Blue.")])
               + all_turns_records(tok, "b", [("One?", "Two."), ("Three?", "Four.")], no_ids_turn=1))
    run = make_smollm2_run(tmp_path / "run", [records], mode="all_turns")
    captured, exported = capture_then_export_ids(tmp_path, run)
    assert captured == exported == ["a#turn0", "a#turn1", "b#turn0"]
    counts = capture_counts(run)
    assert (counts["state"], counts["captured"], counts["capturable"], counts["refused_no_token_ids"]) == \
        ("complete", 3, 3, 1)


def test_each_sample_of_a_prompt_is_captured_with_its_own_hidden_rows(tmp_path, ray_cluster, tok):
    from pipeline.hidden.parts import iter_hidden

    zero = all_turns_records(tok, "a", [("Name a colour.", "Blue.")])
    one = all_turns_records(tok, "a", [("Name a colour.", "Green, like grass.")])
    for j, rows in enumerate((zero, one)):
        for row in rows:
            row["sample_index"] = j
    run = make_smollm2_run(tmp_path / "run", [zero + one])
    captured, exported = capture_then_export_ids(tmp_path, run)
    assert captured == exported == ["a#s1#turn0", "a#turn0"]
    cap = capture_run_dir(run)
    hidden = {s.prompt_id: s.token_ids for s in iter_hidden(cap)}
    assert sorted(hidden) == ["a", "a#s1"], "two samples, two hidden samples"
    for unit, rows in (("a", zero), ("a#s1", one)):
        assert list(hidden[unit]) == rows[0]["prompt_token_ids"] + rows[0]["output_token_ids"]


def test_the_capture_space_check_gives_capture_advice_in_human_units(tmp_path, tok):
    from pipeline.capture import Pending, check_space
    from pipeline.hidden.errors import InsufficientStorage

    run = make_smollm2_run(tmp_path / "run", [smollm2_records(tok)[:1]])
    cap, _ = new_capture(run, load_capture_config(config_file(tmp_path, tiny_llama(tmp_path / "model"))))
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(InsufficientStorage) as err:
        check_space(cap, Pending(tokens=free // 300 + 1), 5 * 64, force=False)  # 644 bytes a token
    message = str(err.value)
    assert "output_dir" not in message and "max tokens" not in message and "capture" in message
    assert "--force" in message and " 0.00 " not in message


def test_status_text_shows_failed_prompts_and_count_mismatched_refusals(tmp_path, tok, capsys):
    from pipeline.store.status import print_status

    model = tiny_llama(tmp_path / "model")
    records = smollm2_records(tok)[:3]
    records[1]["completion_tokens"] = 999  # its ids disagree with its own count: refused
    run = make_smollm2_run(tmp_path / "run", [records])
    new_capture(run, load_capture_config(config_file(tmp_path, model)))
    capture_run_dir(run).write_status({"state": "finished", "failed_prompts": 1, "failed_prompt_ids": ["p2"]})
    assert print_status(run.path) == 0
    text = capsys.readouterr().out
    assert "capture (transformers" in text and "finished; 0 of 2 samples captured" in text
    assert "1 prompts failed" in text and "1 whose ids disagree with their counts" in text and "p2" in text


def test_a_model_too_small_for_the_default_aux_layers_is_told_to_set_them(tmp_path):
    from pipeline.core.errors import ConfigError
    from pipeline.hidden.routes import layout_for

    model = tiny_llama(tmp_path / "model", layers=3)
    with pytest.raises(ConfigError) as refused:
        layout_for(load_capture_config(config_file(tmp_path, model)))
    message = str(refused.value)
    assert "3 decoder layers" in message and "set aux_layer_ids" in message and "[2, 1, 0]" not in message
