"""The capture pool acts on the class of what went wrong (review 16b, items 2-4): a route that can never work stops
the pass at once, a server that is down is waited for up to a deadline, a record that kills the actor is isolated
and fails alone, a full disk stops the pass, a route that fails every prompt stops it. Each test runs the real CLI
driver on local Ray with a capture actor whose route (or part commit) is made to fail the way a real one would."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipeline.store.capture_ledger import capture_run_dir
from tests.smollm2_run import make_smollm2_run, smollm2_records
from tests.capture_helpers import config_file, tiny_llama, tok  # noqa: F401 (fixture)

pytestmark = pytest.mark.torch

DRIVER = '''
import os, sys
import pipeline.dispatch.capture_pool as pool_mod
from pipeline.dispatch.capture_worker import CaptureWorker
CALLS = {calls!r}


class Faulty(CaptureWorker):
    def capture(self, prompts):
        with open(CALLS, "a") as f:
            f.write(",".join(p[0].prompt_id for p in prompts) + "\\n")
        n_calls = len(open(CALLS).read().split())
        self.ready()
{fault}
        return super().capture(prompts)


pool_mod.CaptureWorker = Faulty
from pipeline.cli import main
sys.exit(main(["capture", {run!r}, "--config", {config!r}]))
'''


def capture_with_fault(tmp_path, tok, fault: str, records=None, **cfg):
    """`regen capture` with `fault` (Python run in the actor before each call) injected; (process, calls)."""
    model = tiny_llama(tmp_path / "model")
    run = make_smollm2_run(tmp_path / "run", [records or smollm2_records(tok)])
    calls = tmp_path / "calls.txt"
    script = tmp_path / "driver.py"
    config = str(config_file(tmp_path, model, **cfg))
    script.write_text(DRIVER.format(calls=str(calls), run=str(run.path), config=config,
                                    fault=textwrap.indent(textwrap.dedent(fault), " " * 8)))
    # a safety net below pytest's 600 s, not a budget: each actor the fault kills is replaced, and a Ray actor
    # takes 13-38 s to start on a loaded 2-core machine (240 s ran out here beside two busy loops)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=540)
    return proc, run, calls.read_text().split() if calls.exists() else []


def test_a_route_that_refuses_the_contract_stops_the_pass_at_once_and_fails_no_prompt(tmp_path, ray_cluster, tok):
    proc, run, calls = capture_with_fault(tmp_path, tok, """
        from pipeline.core.errors import ContractError
        def refuse(ids):
            raise ContractError("the server captures layers [1, 2, 3, 6], this capture needs [2, 3, 3]")
        self.route.capture = refuse
    """, prompts_per_call=2)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "cannot do this capture" in proc.stderr and "layers [1, 2, 3, 6]" in proc.stderr
    assert "capture of prompt" not in proc.stderr  # no prompt is failed for the server's fault
    assert calls == ["p0,p1"]  # stopped at the first answer: no prompt was tried alone
    assert capture_run_dir(run).committed_ids() == set()


def test_a_server_down_for_a_while_is_waited_for_and_everything_is_captured(tmp_path, ray_cluster, tok):
    proc, run, calls = capture_with_fault(tmp_path, tok, """
        from pipeline.core.errors import EndpointDown
        if n_calls <= 3:
            def down(ids):
                raise EndpointDown("connection refused", endpoint="http://127.0.0.1:9")
            self.route.capture = down
        else:
            self.route.capture = type(self.route).capture.__get__(self.route)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(capture_run_dir(run).committed_ids()) == ["p0", "p1", "p2", "p3"]
    assert calls[:4] == ["p0"] * 4  # the same prompt retried until the server answered, failed by nobody
    assert "did not answer" in proc.stderr


def test_a_server_down_past_the_deadline_stops_the_pass_resumably(tmp_path, ray_cluster, tok):
    proc, run, calls = capture_with_fault(tmp_path, tok, """
        from pipeline.core.errors import EndpointDown
        def down(ids):
            raise EndpointDown("connection refused", endpoint="http://127.0.0.1:9")
        self.route.capture = down
    """, down_deadline_s=1.5)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "has not answered for" in proc.stderr and "resumable" in proc.stderr
    assert "capture of prompt" not in proc.stderr
    assert set(calls) == {"p0"} and 2 <= len(calls) <= 6  # backoff: a few tries in 1.5 s, not a busy loop


def test_a_route_failing_every_prompt_stops_after_the_configured_run_of_failures(tmp_path, ray_cluster, tok):
    records = smollm2_records(tok) + [dict(r, prompt_id=r["prompt_id"] + "b") for r in smollm2_records(tok)]
    proc, run, calls = capture_with_fault(tmp_path, tok, """
        def broken(ids):
            raise ValueError("the file holds [T, 1, H]")
        self.route.capture = broken
    """, records=records, max_consecutive_failures=3)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "3 prompts failed in a row" in proc.stderr and "[T, 1, H]" in proc.stderr
    assert len(calls) == 3  # not all eight prompts


def test_a_record_that_kills_the_actor_fails_alone_and_the_others_are_captured(tmp_path, ray_cluster, tok):
    records = smollm2_records(tok) + [dict(r, prompt_id=r["prompt_id"] + "b") for r in smollm2_records(tok)]
    proc, run, calls = capture_with_fault(tmp_path, tok, """
        if any(p[0].prompt_id == "p2" for p in prompts):
            os._exit(1)  # as an OOM kill or a segfault would
    """, records=records, prompts_per_call=2)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert sorted(capture_run_dir(run).committed_ids()) == sorted(r["prompt_id"] for r in records if r["prompt_id"]
                                                                   != "p2")
    failed = [line for line in proc.stderr.splitlines() if "capture of prompt" in line]
    assert len(failed) == 1 and "p2" in failed[0] and "died 2 times" in failed[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert calls.count("p2") == 2 and calls.count("p2,p3") == 1  # its batch once, then alone twice


def test_a_full_disk_at_the_part_commit_stops_the_pass_and_fails_no_prompt(tmp_path, ray_cluster, tok):
    proc, run, calls = capture_with_fault(tmp_path, tok, """
        import errno
        import pipeline.dispatch.capture_worker as worker
        from pipeline.store.storage import storage_error
        def full(writer):
            raise storage_error(OSError(errno.ENOSPC, "No space left on device"), writer.run_dir.path / "hidden")
        worker.HiddenPartWriter.commit = full
    """, prompts_per_call=2)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "no space left" in proc.stderr.lower() and "capture of prompt" not in proc.stderr
    assert calls == ["p0,p1"]  # no forward pass repeated for a disk that is full


def test_a_prompt_that_always_gets_a_retryable_fails_alone_and_the_others_are_captured(tmp_path, ray_cluster, tok):
    records = smollm2_records(tok)
    records = records + [dict(r, prompt_id=r["prompt_id"] + "b") for r in records]  # 8 prompts
    proc, run, calls = capture_with_fault(tmp_path, tok, """
        from pipeline.core.errors import Unexpected
        if any(p[0].prompt_id == "p2" for p in prompts):  # its states file is corrupt: the server answers
            raise Unexpected("SafetensorError: invalid header for prompt p2's file", endpoint="http://127.0.0.1:9")
    """, records=records, actors=1, prompts_per_call=2, down_deadline_s=5)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert sorted(capture_run_dir(run).committed_ids()) == sorted(r["prompt_id"] for r in records if r["prompt_id"]
                                                                  != "p2")
    assert "capture of prompt p2 failed: Unexpected 3 times running alone" in proc.stderr
    assert "SafetensorError" in proc.stderr and "not answered" not in proc.stderr
    assert calls.count("p2") == 3 and calls[:4] == ["p0,p1", "p2,p3", "p0b,p1b", "p2b,p3b"]  # split: behind the rest


def test_a_pass_stopped_after_failing_a_prompt_names_it_and_leaves_no_capture_directory(tmp_path, ray_cluster, tok):
    proc, run, calls = capture_with_fault(tmp_path, tok, """
        from pipeline.core.errors import EndpointDown
        from pipeline.hidden.errors import CaptureSampleError
        if prompts[0][0].prompt_id == "p0":
            raise CaptureSampleError("token id 60000 at position 3 is outside the model's vocabulary")
        raise EndpointDown("connection refused", endpoint="http://127.0.0.1:9")
    """, down_deadline_s=1.5)
    assert proc.returncode == 1 and "has not answered for" in proc.stderr, proc.stderr[-3000:]
    # the pass committed nothing: its new capture directory is not left behind (a command that fails before its
    # first commit leaves the run as it was); the failed prompt is named on the console, and the next pass tries it
    assert "capture of prompt p0 failed: token id 60000" in proc.stderr, proc.stderr[-3000:]
    assert capture_run_dir(run).read_status() is None
    assert capture_run_dir(run).committed_ids() == set()
