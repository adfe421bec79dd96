"""A refused command leaves the run as it was (issue 30, DESIGN invariant 6), through the real `regen` command on
the SGLang emulator: every way a start can be refused after it has written, a raised samples_per_prompt that a
kill stopped before its first new sample, and `--new-run --add-samples`.

One complete run of 4 prompts x 2 samples is made once for the module; each test works on a copy of it."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import orjson
import pytest
import yaml

from tests.helpers import data_parts, emulators, run_regen, write_config, write_prompts, write_source

MODEL = "SmolLM2-135M-Instruct"
REFUSED_AT_PREFLIGHT = 1  # an endpoint serving another model: the preflight refuses the fleet
# what a refused command may change (the rule): its log, the lock, status.json
MAY_CHANGE = ("logs", "run.lock", "lock.json", "status.json")


@pytest.fixture(scope="module")
def fleet():
    """The good endpoint, and one that serves another model (the preflight refuses it)."""
    with emulators(1, served_model_name=MODEL) as (good,), emulators(1, served_model_name="another-model") as (bad,):
        yield good, bad


@pytest.fixture(scope="module")
def made(tmp_path_factory, fleet, ray_cluster):
    """A complete run: 4 prompts, samples_per_prompt 2. Returns its folder."""
    tmp = tmp_path_factory.mktemp("made")
    write_prompts(tmp / "p.jsonl", 4)
    write_source(tmp, tmp / "p.jsonl")  # tmp/test.yaml: every test's config names it (the prompt identity)
    config = configured(tmp, fleet[0], k=2)
    done = run_regen("generate", "--config", str(config))
    assert done.returncode == 0, done.stderr
    return tmp


def configured(tmp: Path, server, k: int, max_tokens: int = 8) -> Path:
    """tmp/k<k>-<max_tokens>-<port>.yaml: a run `t` in tmp/out, of the module's source (made/test.yaml)."""
    spec = next(tmp.parent.glob("made*/test.yaml"))
    path = write_config(tmp, [{"url": server.url, "name": "emu"}], [spec], model=MODEL,
                        sampling={"temperature": 0.8, "max_tokens": max_tokens}, samples_per_prompt=k)
    return path.rename(tmp / f"k{k}-{max_tokens}-{server.port}.yaml")


def copy_of(made: Path, tmp: Path) -> Path:
    """The module's run, copied into tmp/out (its source stays the module's)."""
    shutil.copytree(made / "out", tmp / "out")
    return tmp / "out" / "t"


def snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder under `folder` (a file with its content's hash), but what a refusal may change."""
    seen = {}
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if relative.parts[0] in MAY_CHANGE or relative.parts[-1] in MAY_CHANGE or "logs" in relative.parts:
            continue
        seen[str(relative)] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return seen


def k_of(run: Path) -> int:
    return orjson.loads((run / "run.json").read_bytes())["generation"].get("samples_per_prompt", 1)


def test_each_refusal_leaves_the_run_as_it_was(made, tmp_path, fleet):
    """The issue's rule, path by path: each command is refused after it has written (run.json, a prompt set, a
    new run's directory, a capture's folder), and the run directory (and out/) is as it was."""
    run = copy_of(made, tmp_path)
    data_parts(run)[-1].unlink()  # work pending: every command goes on to the preflight
    out = tmp_path / "out"
    bad = fleet[1]
    k2, raised, changed = (str(configured(tmp_path, bad, k=2)), str(configured(tmp_path, bad, k=3)),
                           str(configured(tmp_path, bad, k=2, max_tokens=9)))
    before, listing = snapshot(run), sorted(p.name for p in out.iterdir())

    def refused(*args: str) -> None:
        result = run_regen(*args)
        assert result.returncode == REFUSED_AT_PREFLIGHT and "another-model" in result.stderr, (args, result.stderr)
        assert snapshot(run) == before, f"{args}: the run changed"
        assert sorted(p.name for p in out.iterdir()) == listing, f"{args}: a directory was left in out/"
        assert k_of(run) == 2

    refused("generate", "--config", raised, "--add-samples")
    refused("generate", "--config", raised, "--add-samples", "--run-dir", str(run))
    refused("generate", "--config", changed, "--new-run")
    refused("generate", "--config", k2, "--retry-failures")
    refused("generate", "--config", k2, "--start-with-passing")
    # the source gains two prompts: --refresh-prompts commits a new prompt set (and run.json) before the preflight
    source = made / "p.jsonl"
    original = source.read_bytes()
    try:
        write_prompts(source, 6)
        refused("generate", "--config", k2, "--refresh-prompts")
    finally:
        source.write_bytes(original)
    # a capture refused after it made RUN/capture (a model folder whose config.json transformers does not know)
    # leaves no RUN/capture
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    capture = tmp_path / "capture.yaml"
    capture.write_text(yaml.safe_dump({"route": "transformers", "model": str(tmp_path / "model"), "actors": 1}))
    result = run_regen("capture", str(run), "--config", str(capture))
    assert result.returncode == 2 and "cannot read its config.json" in result.stderr, result.stderr
    assert snapshot(run) == before and not (run / "capture").exists(), "the refused capture left RUN/capture"


def test_a_raise_killed_before_its_first_new_sample_binds_nothing(made, tmp_path, fleet):
    """k raised to 3 with --add-samples and SIGKILLed before any sample 2 was committed; k set back to 2: the run
    resumes (the ledger holds no sample 2: what is stored decides, not run.json), and run.json says 2 again."""
    run = copy_of(made, tmp_path)
    raised = configured(tmp_path, fleet[0], k=3)
    killed = run_regen("generate", "--config", str(raised), "--add-samples",
                       env={"REGEN_FAULT": "kill@1:link,rename,copy:/data/part-"})
    assert killed.returncode == -9, killed.stderr
    assert k_of(run) == 3, "the kill came after run.json took the raise"
    back = run_regen("generate", "--config", str(configured(tmp_path, fleet[0], k=2)))
    assert back.returncode == 0, back.stderr
    assert "records of sample 2" not in back.stderr
    assert "no record of a sample past 1" in back.stderr, back.stderr
    assert k_of(run) == 2
    status = run_regen("status", str(run)).stdout
    assert "complete" in status and "done 8, failed 0, pending 0" in status, status
    # and a lowering below what is stored is refused, naming what is stored
    lowered = run_regen("generate", "--config", str(configured(tmp_path, fleet[0], k=1)))
    assert lowered.returncode == 3 and "this run has records of sample 1" in lowered.stderr, lowered.stderr


def test_new_run_with_add_samples_starts_a_successor(made, tmp_path, fleet):
    run = copy_of(made, tmp_path)
    before = snapshot(run)
    result = run_regen("generate", "--config", str(configured(tmp_path, fleet[0], k=3)), "--new-run", "--add-samples")
    assert result.returncode == 0, result.stderr
    assert snapshot(run) == before, "the old run is left as it was"
    assert k_of(tmp_path / "out" / "t-r2") == 3
    status = run_regen("status", str(tmp_path / "out" / "t-r2")).stdout
    assert "done 12, failed 0, pending 0" in status, status
