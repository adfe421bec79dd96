"""`regen simulate` simulates what the run will send (issue 30): the sample keeps each prompt's tools, and its
first line counts prompts and samples apart when samples_per_prompt > 1."""
from __future__ import annotations

from pathlib import Path

import orjson
import yaml

from pipeline.tools.simulate import Prediction, write_sample

SAMPLE_TOOLS = Path(__file__).resolve().parent.parent / "prompts_sources" / "sample_tools.yaml"


def test_the_sample_keeps_the_tools_the_run_sends(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"run_name": "sim", "model": "m", "sources": [{"spec": str(SAMPLE_TOOLS)}],
                                      "endpoints": [{"url": "http://127.0.0.1:1"}]}))
    spec, total, _, sampled, with_tools = write_sample(str(config), 1000, tmp_path)
    rows = [orjson.loads(line) for line in (tmp_path / "sample.jsonl").read_bytes().splitlines()]
    assert len(rows) == total == sampled and with_tools > 0
    assert sum(1 for r in rows if r.get("tools")) == with_tools
    tool = next(r["tools"][0] for r in rows if r.get("tools"))
    assert tool["type"] == "function" and "name" in tool["function"]


def test_the_first_line_counts_prompts_and_samples_apart():
    line = Prediction(prompts=300, sample=400, sample_wall_s=1.0, wall_s=10.0, completion_tokens=5,
                      disk_bytes=1, samples_per_prompt=2, with_tools=150).table().splitlines()[0]
    assert line.startswith("sampled 200 of 300 prompts (400 samples, 2 per prompt), 150 of them sent with their "
                           "tools;")
    assert Prediction(300, 200, 1.0, 10.0, 5, 1).table().startswith("sampled 200 of 300 prompts;")


def test_the_last_line_names_the_tool_call_parser_among_what_the_preflight_checks(tmp_path):
    """Walk of issue 31: the line listed "(model, weights, context, reasoning parser)", without the tool-call parser
    the preflight checks for a prompt set with tools (and the image input for one with images)."""
    from pipeline.tools.simulate import emulated_only

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"run_name": "sim", "model": "m", "sources": [{"spec": str(SAMPLE_TOOLS)}],
                                      "endpoints": [{"url": "http://10.0.0.7:30000", "name": "node-a"}]}))
    line = emulated_only(str(config), 2)
    assert "none of the config's real endpoints (node-a) was contacted or checked" in line
    assert (f"`regen preflight {config}` checks them (model, weights, context, reasoning parser, the tool-call "
            "parser for prompts with tools, image input for prompts with images, the server's batch) without "
            "sending a prompt") in line


def test_simulate_leaves_an_unset_concurrency_unset_as_the_real_run_would(tmp_path, monkeypatch):
    """The emulated SGLang servers report their batch: an unset concurrency is auto there, never a fixed 8 (nor
    emulators of capacity 8)."""
    import subprocess

    import pytest

    import pipeline.emulator
    from pipeline.tools import simulate
    from tests.helpers import prompt_source

    spec = prompt_source(tmp_path, 5)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"run_name": "sim", "model": "m", "sources": [{"spec": str(spec)}],
                                      "endpoints": [{"url": "http://10.0.0.1:30000"}]}))
    started, written = [], []

    class Emulator:
        url = "http://127.0.0.1:9"

        def stop(self):
            pass

    def start_emulator(**options):
        started.append(options)
        return Emulator()

    class Stop(Exception):
        pass

    def run(args, **kwargs):
        written.append(yaml.safe_load(Path(args[args.index("--config") + 1]).read_text()))
        raise Stop

    monkeypatch.setattr(pipeline.emulator, "start_emulator", start_emulator)
    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(Stop):
        simulate.simulate(str(config), endpoints=1, tok_s=50.0, sample=5, batch=256)
    endpoint = written[0]["endpoints"][0]
    assert "concurrency" not in endpoint and started[0]["capacity"] == 256, (endpoint, started[0])
