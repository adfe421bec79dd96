"""What the commands say (issue 23, smaller points): a typo in a run-config key lists the keys its section allows,
as a typo in a spec file does; every passthrough command shows its usage as `regen NAME`; `regen preflight` says
each fleet note once."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline import cli
from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError
from tests.helpers import emulators, run_regen

REPO = Path(__file__).resolve().parent.parent  # the config is written elsewhere: its spec path is absolute


@pytest.mark.parametrize("section, typo, fix", [
    ({}, "run_nmae", "run_name"),
    ({"sampling": {}}, "max_token", "max_tokens"),
    ({"endpoints": [{"url": "http://127.0.0.1:9"}]}, "concurency", "concurrency"),
    ({"local_fleet": {}}, "slot", "slots"),
    ({"sources": [{"spec": "s.yaml"}]}, "limt", "limit"),
])
def test_a_typo_in_a_run_config_key_lists_the_allowed_keys_of_its_section(tmp_path, section, typo, fix):
    raw = {"run_name": "t", "model": "m", "sources": [{"spec": "s.yaml"}], "endpoints": [{"url": "http://127.0.0.1:9"}]}
    raw.update(section)
    name = next(iter(section), None)
    target = raw if name is None else (raw[name][0] if isinstance(raw[name], list) else raw[name])
    target[typo] = 1
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as error:
        load_config(path)
    (line,) = str(error.value).splitlines()
    key = typo if name is None else (f"{name}.0.{typo}" if isinstance(raw[name], list) else f"{name}.{typo}")
    assert line.startswith(f"{path}: unknown key '{key}' (allowed: ") and line.endswith(f"; did you mean {fix!r}?)")
    from pipeline.core import config as models

    section_model = {None: models.RunConfig, "sampling": models.Sampling, "endpoints": models.Endpoint,
                     "local_fleet": models.LocalFleet, "sources": models.SourceRef}[name]
    listed = line.split("(allowed: ", 1)[1].split(";", 1)[0].split(", ")
    assert listed == [k for k, info in section_model.model_fields.items() if not info.exclude]
    assert "hidden_states" not in listed  # retired: never suggested


@pytest.mark.parametrize("name", sorted(cli.PASSTHROUGH))
def test_each_passthrough_command_shows_its_usage_as_regen_name(name, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([name, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: regen {name} ")


def test_preflight_prints_each_fleet_note_once(tmp_path):
    with emulators(1, preset="kimi") as (server,):
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump({"run_name": "pf", "model": "moonshotai/Kimi-K2.5", "thinking": True,
                                          "sources": [{"spec": str(REPO / "prompts_sources/sample_prompts.yaml")}],
                                          "endpoints": [{"url": server.url}]}))
        out = run_regen("preflight", str(config), timeout=60)
    assert out.returncode == 0, out.stderr
    said = out.stdout + out.stderr
    assert "every request sends temperature=0.0" in said
    assert said.count("every request sends temperature=0.0") == 1, said
