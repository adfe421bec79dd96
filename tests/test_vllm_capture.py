"""Route vllm of `regen capture` against one real vLLM capture server (its CPU build, SmolLM2-135M float32),
started by `local_fleet`'s own code with `hidden_states_dir` (extract_hidden_states and regen's CPU connector).

Every stored state is checked against the layer loop of tests/test_capture.py (the model's modules run one at a
time, never vLLM's code nor the model's forward), and `--speculators-data` goes through speculators' own
`prepare-data` and `check_hidden_states`; a driver SIGKILL then a resume captures each sample once and leaves
none of the server's files. One server, started when this module's first test needs it and stopped
when the module ends: never beside test_vllm_engine's two (pytest finishes one module's fixtures before the next
module starts)."""
from __future__ import annotations

import collections
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipeline.export.jsonl import export_run
from pipeline.hidden.parts import hidden_parts
from pipeline.store.capture_ledger import capture_run_dir
from pipeline.store.faults import kill_at_data_part
from tests.helpers import free_port, require_installed, run_regen, start_regen
from tests.smollm2_run import SAMPLES, make_smollm2_run, smollm2_records
from tests.test_capture import AUX, LayerLoop, bf16_close, stored_samples
from tests.trainlib import run_checks

pytestmark = [pytest.mark.vllm, pytest.mark.torch]


@pytest.fixture(scope="module")
def capture_server(tmp_path_factory):
    from pipeline.core.config import LocalFleet
    from pipeline.endpoints.localfleet import LocalFleetProcesses, vllm_model_dir, vllm_python

    if not vllm_python().exists() or not (vllm_model_dir() / "config.json").exists():
        require_installed(f"vLLM's venv ({vllm_python()}) or model ({vllm_model_dir()})")
    files = tmp_path_factory.mktemp("vllm-hidden-states")
    fleet = LocalFleet(engine="vllm", servers=1, base_port=free_port(), slots=4, ctx_per_slot=1024, threads=1,
                       hidden_states_dir=str(files))
    started = time.monotonic()
    processes = LocalFleetProcesses(fleet, tmp_path_factory.mktemp("vllm-capture-logs")).start()
    print(f"\nvLLM capture server ready in {time.monotonic() - started:.1f}s")
    yield SimpleNamespace(url=fleet.endpoints()[0].url, files=files, model_dir=vllm_model_dir())
    processes.stop()


@pytest.fixture(scope="module")
def ref(capture_server):
    return LayerLoop(capture_server.model_dir)


def write_capture_config(tmp, capture_server, **extra):
    path = tmp / "capture.yaml"
    path.write_text(yaml.safe_dump({
        "route": "vllm", "model": str(capture_server.model_dir), "actors": 1, "actor_num_cpus": 0.5,
        "prompts_per_call": 2, "flush_records": 2, "flush_interval_s": 0.5,
        "vllm": {"url": capture_server.url, "timeout_s": 120, "lock_timeout_s": 60}, **extra}))
    return path


def server_files(capture_server) -> list[str]:
    return sorted(p.name for p in capture_server.files.rglob("*") if p.is_file())


def relative_error(stored, expected) -> float:
    exp = expected.double().numpy()
    big = np.abs(exp) > 0.05
    return float((np.abs(stored.astype(np.float64) - exp)[big] / np.abs(exp)[big]).max())


@pytest.fixture(scope="module")
def captured(tmp_path_factory, ray_cluster, capture_server, ref):
    """SmolLM2's four samples (one cut at max_tokens) captured through the server by `regen capture`."""
    tmp = tmp_path_factory.mktemp("vllm-capture")
    records = smollm2_records(ref.tok)
    run = make_smollm2_run(tmp / "run", [records])
    config = write_capture_config(tmp, capture_server)
    started = time.monotonic()
    result = run_regen("capture", str(run.path), "--config", str(config), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    print(f"\nregen capture (route vllm, 4 samples) in {time.monotonic() - started:.1f}s")
    return SimpleNamespace(run=run, records=records, tmp=tmp)


def test_route_vllm_stores_every_layer_as_the_layer_loop_and_removes_the_server_files(captured, capture_server, ref):
    cap = capture_run_dir(captured.run)
    ledger = cap.read_table(cap.data).to_pylist()
    counts = collections.Counter(r["sample_id"] for r in ledger)
    assert sorted(counts) == [f"{pid}#turn0" for pid, *_ in SAMPLES] and set(counts.values()) == {1}
    layout, samples = stored_samples(captured.run)
    assert layout["aux_layer_ids"] == AUX
    worst: dict[str, float] = collections.defaultdict(float)
    for rec in captured.records:
        ids = rec["prompt_token_ids"] + rec["output_token_ids"]
        sample, stored = samples[rec["prompt_id"]]
        assert sample.token_ids.tolist() == ids and stored.shape == (len(ids), 5, 576)  # T rows for T tokens
        inputs, post = ref.states(ids)
        expected = {f"aux{layer}": inputs[:, layer] for layer in AUX}
        # the final post-norm state: the route's RMSNorm (the model's weight) on the server's pre-norm state;
        # layer id L: the last layer's output before the final norm
        expected.update(post_norm=post, pre_norm=inputs[:, 30])
        for k, (name, want) in enumerate(expected.items()):
            bf16_close(stored[:, k], want)
            worst[name] = max(worst[name], relative_error(stored[:, k], want))
    print("\nroute vllm against the layer loop, max |diff| / |ref| (values above 0.05): "
          + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    assert server_files(capture_server) == [], "the server's files are removed once read"
    tokens, route_s = sum(r["n_tokens"] for r in ledger), sum(r["capture_s"] for r in ledger)
    print(f"route vllm: {tokens} tokens at {tokens / route_s:.0f} tok/s per request (request, file, norm)")
    # what the route checked each file against (it refuses any other): the server's own account, in its metadata
    server = server_metadata(capture_server, captured.records[0]["prompt_token_ids"])
    assert server["layer_ids"] == AUX + [30] and server["num_hidden_layers"] == 30 and server["hidden_size"] == 576
    assert server["model"] == str(capture_server.model_dir) and server["dtype"] == "float32"
    assert server["served_model_name"] == ["SmolLM2-135M-Instruct"]


def server_metadata(capture_server, ids: list[int]) -> dict:
    """One request of our own to the capture server: the regen metadata of the file it writes."""
    import fcntl
    import json
    import urllib.request

    from safetensors import safe_open

    with urllib.request.urlopen(capture_server.url + "/v1/models", timeout=30) as answer:
        served = json.loads(answer.read())["data"][0]["id"]
    request = urllib.request.Request(capture_server.url + "/v1/completions", headers={
        "Content-Type": "application/json", "X-Request-Id": "metadata-check"},
        data=json.dumps({"model": served, "prompt": ids, "max_tokens": 1}).encode())
    with urllib.request.urlopen(request, timeout=120) as answer:
        path = json.loads(answer.read())["kv_transfer_params"]["hidden_states_path"]
    try:
        with open(path + ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
        with safe_open(path, framework="numpy") as f:
            return json.loads((f.metadata() or {})["regen_server"])
    finally:
        for leftover in (path, path + ".lock"):
            Path(leftover).unlink(missing_ok=True)


def test_speculators_data_gets_hs_files_in_prepare_data_row_order(captured, capture_server):
    """`--speculators-data DIR`: hs_{i} go into a `speculators prepare-data` folder, following ITS shuffled rows."""
    jsonl = captured.tmp / "spec.jsonl"
    export_run(captured.run.path, "speculators", jsonl)
    prepared = captured.tmp / "prepared"
    got = run_checks({"check": "speculators_prepare", "path": str(jsonl), "tokenizer": str(capture_server.model_dir),
                      "out": str(prepared)})
    rows = [r["input_ids"] for r in got["rows"]]
    records = [r["prompt_token_ids"] + r["output_token_ids"] for r in captured.records]
    assert sorted(rows) == sorted(records)
    assert rows != records, "prepare-data shuffles: the test needs an order other than the run's"
    result = run_regen("export", str(captured.run.path), "--format", "speculators-hidden", "--out",
                       str(captured.tmp / "unused"), "--speculators-data", str(prepared))
    assert result.returncode == 0, result.stderr[-3000:]
    for idx, ids in enumerate(rows):
        hs = load_file(str(prepared / "hidden_states" / f"hs_{idx}.safetensors"))
        assert hs["token_ids"].tolist() == ids, idx
        assert hs["hidden_states"].shape == (len(ids), 4, 576)
    checked = run_checks({"check": "speculators_hidden", "path": str(prepared), "save": str(captured.tmp / "s.pt")})
    assert checked["checked"] == 4 and checked["not_loaded"] == [], checked
    saved = torch.load(captured.tmp / "s.pt", weights_only=False)
    masks = {tuple(r["input_ids"]): r["loss_mask"] for r in got["rows"]}
    for item in saved["items"]:  # its dataset pairs each row with the states of the same ids
        ids = tuple(item["input_ids"].tolist())
        assert item["loss_mask"].tolist() == masks[ids]
        assert item["hidden_states"].shape[0] == len(ids)


def test_driver_sigkill_then_resume_captures_each_sample_exactly_once(tmp_path, ray_cluster, capture_server, ref):
    samples = [(f"k{i}", f"Tell me fact number {i} about owls.", f"Owls fact {i}: they can turn their heads.",
                "stop") for i in range(8)]
    records = smollm2_records(ref.tok, samples)
    run = make_smollm2_run(tmp_path / "run", [records])
    config = write_capture_config(tmp_path, capture_server, prompts_per_call=1, flush_records=1)
    # files in the server's folder that are not this capture's: another client's, another capture's
    others = [capture_server.files / "cmpl-someone-else-0-1a2b.safetensors",
              capture_server.files / "cmpl-regen-0123456789ab-99t1-0-0-1a2b.safetensors"]
    for other in others:
        other.write_bytes(b"not ours")
    cap = capture_run_dir(run)
    # SIGKILLed at its third commit (flush_records 1): a kill from outside after a first commit could land after
    # the last one on a loaded machine
    proc = start_regen("capture", str(run.path), "--config", str(config), env=kill_at_data_part(3),
                       log=tmp_path / "first.log")
    assert proc.wait(timeout=300) == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-3000:]
    before = cap.committed_ids()
    assert 1 <= len(before) < 8, "the kill must land mid-capture"
    resumed = run_regen("capture", str(run.path), "--config", str(config), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ledger = cap.read_table(cap.data).to_pylist()
    assert sorted(r["sample_id"] for r in ledger) == sorted(f"k{i}#turn0" for i in range(8))  # none twice
    assert {p.name for p in hidden_parts(cap)} == {r["hidden_part"] for r in ledger}
    _, stored = stored_samples(run)
    for rec in records:
        ids = rec["prompt_token_ids"] + rec["output_token_ids"]
        sample, states = stored[rec["prompt_id"]]
        assert sample.token_ids.tolist() == ids
        bf16_close(states[:, 4], ref.states(ids)[0][:, 30])
    # a killed actor's request still reaches the server, which writes its file after answering: nobody reads it;
    # the next session removes it (and never another client's or capture's files)
    assert server_files(capture_server) == sorted(o.name for o in others)
    for other in others:
        other.unlink()
