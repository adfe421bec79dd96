"""`regen preflight` judges what the run will send (issue 30): the prompt set's tools, images and longest prompts,
read from the stored set when the run exists, else from the sources, with the cost stated; its table shows the
tool-call parser beside the reasoning parser."""
from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest
import yaml

from pipeline.cli import main as regen_main
from pipeline.core.config import load_config
from pipeline.emulator import start_emulator
from pipeline.run import manifest_for
from pipeline.store.promptset import stage_prompt_set
from pipeline.store.rundir import RunDir

MODEL = "moonshotai/Kimi-K2.5"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def servers():
    started = {}
    try:
        started["kimi"] = start_emulator(preset="kimi")
        started["no_tools"] = start_emulator(preset="kimi", tool_call_parser="none")
        started["short"] = start_emulator(preset="kimi", context_length=2600)
        yield started
    finally:
        for server in started.values():
            server.stop()


def tool_source(tmp_path: Path, tools: bool = True) -> Path:
    data = tmp_path / "tools.jsonl"
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                                                                                     "properties": {}}}}
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"Weather in city {i}?"}],
             **({"tools": [weather]} if tools else {})} for i in range(5)]
    data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    spec = tmp_path / "tools.yaml"
    spec.write_text(yaml.safe_dump({"name": "t", "kind": "jsonl", "path": str(data), "format": "openai",
                                    "id_field": "id"}))
    return spec


def config(tmp_path: Path, urls: list[str], spec: Path, **overrides) -> str:
    raw = {"run_name": "needs", "model": MODEL, "output_dir": str(tmp_path / "out"), "sources": [{"spec": str(spec)}],
           "endpoints": [{"url": u} for u in urls], "dead_fleet_deadline_s": 5, "thinking": True, **overrides}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_preflight_refuses_a_server_without_a_tool_parser_for_a_prompt_set_with_tools(servers, tmp_path, capsys):
    path = config(tmp_path, [servers["kimi"].url, servers["no_tools"].url], tool_source(tmp_path))
    assert regen_main(["preflight", path]) == 1
    out, err = capsys.readouterr()
    assert "prompt set: 5 prompts, tools yes, images no" in out and "read from the sources" in out
    header, good, bad = out.splitlines()[1:4]
    assert "reasoning" in header and "tool calls" in header
    assert good.split()[5:7] == ["kimi_k2", "kimi_k2"] and bad.split()[5:7] == ["kimi_k2", "none"]
    assert "tool_call_parser: null" in err and servers["no_tools"].url.split("//")[1] in err


def test_preflight_reads_the_stored_prompt_set_of_an_existing_run(servers, tmp_path, capsys):
    spec = tool_source(tmp_path)
    path = config(tmp_path, [servers["no_tools"].url], spec)
    cfg = load_config(path)
    run = RunDir(tmp_path / "out" / "needs")
    run.create()
    run.write_manifest({**manifest_for(cfg, path), "prompts": cfg.prompt_identity(), "prompt_set_version": 1})
    stage_prompt_set(cfg).commit(run)
    tool_source(tmp_path, tools=False)  # the sources lost their tools since: the run sends the stored set's
    assert regen_main(["preflight", path]) == 1
    out, err = capsys.readouterr()
    assert f"tools yes, images no" in out and f"read from the stored prompt set of {run.path}" in out
    assert "tool_call_parser: null" in err
    shutil.rmtree(run.path)  # no run: the sources, now tool-free, pass
    assert regen_main(["preflight", path]) == 0
    assert "tools no" in capsys.readouterr().out


def test_preflight_warns_of_a_context_that_cannot_hold_the_longest_prompt(servers, tmp_path, capsys):
    from pipeline.endpoints.localfleet import vllm_model_dir

    if not (vllm_model_dir() / "tokenizer.json").exists():
        pytest.skip("SmolLM2's HF folder is not converted (make vllm)")
    data = tmp_path / "long.jsonl"
    rows = [{"id": "short", "prompt": "Hi."}, {"id": "long", "prompt": "the cat sat on the mat " * 300}]
    data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    spec = tmp_path / "long.yaml"
    spec.write_text(yaml.safe_dump({"name": "l", "kind": "jsonl", "path": str(data), "format": "prompt",
                                    "id_field": "id"}))
    path = config(tmp_path, [servers["short"].url, servers["kimi"].url], spec, tokenizer=str(vllm_model_dir()),
                  sampling={"max_tokens": 1024}, min_prompt_tokens=256)
    assert regen_main(["preflight", path]) == 0
    out = capsys.readouterr().out
    assert "longest prompt 18" in out and "tokens" in out.splitlines()[0]
    short, kimi = (servers[name].url.split("//")[1] for name in ("short", "kimi"))
    warned = [line for line in out.splitlines() if "shorter than the longest prompt" in line]
    assert len(warned) == 1 and short in warned[0] and "sampling.max_tokens (1024)" in warned[0]
