"""`regen validate` exits as `regen generate` would (issue 23, dead end 3): a JSON source cut short and an unset
api_key_env are exit 2 for both, with generate's own words; `--no-secrets` skips the secrets check; a hub that
does not answer a short connect (or HF_HUB_OFFLINE) is looked for in the local cache only, at once, instead of after
a minute of the hub client's retries; --offline contacts nothing and skips hub datasets with a note; the production
config's "check it without contacting anything" line is true; an unset concurrency is shown as what the run makes
of it, never as a fixed 8."""
from __future__ import annotations

import json
import re
import shlex
import socket
import threading
from pathlib import Path

import orjson
import pytest
import yaml

from tests.helpers import run_regen

REPO = Path(__file__).resolve().parent.parent
DEAD_ENDPOINT = [{"url": "http://127.0.0.1:9"}]  # never contacted: validate contacts no endpoint


def records(n: int) -> list[dict]:
    return [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"Tell me fact number {i}."},
                                              {"from": "gpt", "value": f"Fact {i}."}]} for i in range(n)]


def one_source_config(tmp: Path, spec_doc: dict, endpoints: list[dict] = DEAD_ENDPOINT) -> Path:
    spec = tmp / "source.yaml"
    spec.write_text(yaml.safe_dump({"name": "src", "format": "sharegpt", **spec_doc}))
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump({"run_name": "t", "output_dir": str(tmp / "out"), "model": "m",
                                      "sources": [{"spec": str(spec)}], "endpoints": endpoints}))
    return config


def cut_source(tmp: Path, kind: str) -> Path:
    """A config of one source of 30 records, cut inside the last one: past the 20 records validate looks at."""
    whole = (json.dumps(records(30), indent=1).encode() if kind == "json"
             else b"".join(orjson.dumps(r) + b"\n" for r in records(30)))
    data = tmp / f"data.{kind}"
    data.write_bytes(whole[:-25])
    return one_source_config(tmp, {"kind": kind, "path": str(data)})


def salvage_keeps_it_valid(tmp: Path, config: Path) -> None:
    spec = yaml.safe_load((tmp / "source.yaml").read_text())
    (tmp / "source.yaml").write_text(yaml.safe_dump({**spec, "salvage": True}))
    validate = run_regen("validate", str(config))
    assert validate.returncode == 0 and "is valid" in validate.stdout, validate.stdout + validate.stderr
    assert "looks cut short: `salvage: true` keeps its complete records" in validate.stdout


def test_a_json_source_cut_short_is_refused_by_validate_with_the_words_and_exit_code_of_generate(tmp_path):
    config = cut_source(tmp_path, "json")
    generate, validate = run_regen("generate", "--config", str(config)), run_regen("validate", str(config))
    assert generate.returncode == 2 and not (tmp_path / "out" / "t").exists(), generate.stderr
    refusal = generate.stderr.strip().splitlines()[-1].removeprefix("regen: error: source 'src': ")
    assert "ends in the middle of a record" in refusal and "add `salvage: true`" in refusal
    assert validate.returncode == 2 and "is valid" not in validate.stdout, validate.stdout
    assert f"  cannot read it: {refusal}" in validate.stdout.splitlines()
    salvage_keeps_it_valid(tmp_path, config)


def test_a_json_lines_source_cut_short_is_refused_by_validate_as_its_reader_refuses_it(tmp_path):
    from pipeline.prompts.errors import TruncatedSource
    from pipeline.prompts.sources import load_source_spec, read_records

    config = cut_source(tmp_path, "jsonl")
    with pytest.raises(TruncatedSource) as cut:  # what generate's staging raises (exit 2, ConfigError)
        list(read_records(load_source_spec(tmp_path / "source.yaml")))
    validate = run_regen("validate", str(config))
    assert validate.returncode == 2 and "is valid" not in validate.stdout, validate.stdout
    assert f"  cannot read it: {cut.value.cause}; {cut.value.hint}" in validate.stdout.splitlines()
    salvage_keeps_it_valid(tmp_path, config)


def test_an_unset_api_key_env_is_exit_2_unless_no_secrets(tmp_path, monkeypatch):
    data = tmp_path / "data.jsonl"
    data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records(3)))
    endpoints = [{"url": "http://127.0.0.1:9", "api_key_env": "REGEN_TEST_UNSET_KEY"},
                 {"url": "http://127.0.0.1:10", "api_key_env": "REGEN_TEST_UNSET_KEY"}]
    config = one_source_config(tmp_path, {"kind": "jsonl", "path": str(data)}, endpoints)
    monkeypatch.delenv("REGEN_TEST_UNSET_KEY", raising=False)

    from pipeline.core import exits
    from pipeline.core.errors import SecretMissing

    # generate raises SecretMissing before anything else (tests/test_generate_emulated.py runs it): this exit code
    validate = run_regen("validate", str(config))
    assert validate.returncode == exits.for_error(SecretMissing("")) == 2 and "is valid" not in validate.stdout
    assert ("regen: error: " + str(config) + ": REGEN_TEST_UNSET_KEY is not set (the api_key_env of endpoints "
            "above; --no-secrets skips this check)") in validate.stderr
    laptop = run_regen("validate", "--no-secrets", str(config))
    assert laptop.returncode == 0 and "is valid" in laptop.stdout, laptop.stderr
    assert "key from $REGEN_TEST_UNSET_KEY (not set; not checked: --no-secrets)" in laptop.stdout
    assert run_regen("validate", str(config), env={"REGEN_TEST_UNSET_KEY": "k"}).returncode == 0


def test_validate_says_an_unset_concurrency_is_auto_else_8_and_a_set_8_is_8(capsys):
    from pipeline.core.config_sections import Endpoint
    from pipeline.prompts.validate import _missing_secrets

    class Config:
        def all_endpoints(self):
            return [Endpoint(url="http://10.0.0.1:30000", name="unset"),
                    Endpoint(url="http://10.0.0.2:30000", name="set", concurrency=8)]

    _missing_secrets(Config(), check=False)
    unset, fixed = capsys.readouterr().out.splitlines()
    assert unset == ("endpoint unset: http://10.0.0.1:30000, concurrency not set: auto where the server reports its "
                     "batch, else 8"), unset
    assert fixed == "endpoint set: http://10.0.0.2:30000, concurrency 8", fixed


class CountingListener:
    """A TCP port on 127.0.0.1 that counts the connections made to it (and answers none of them)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def hub_source_config(tmp: Path) -> Path:
    return one_source_config(tmp, {"kind": "hf", "path": "regen-test/no-such-dataset", "split": "train"})


NOT_CACHED = ("cannot load regen-test/no-such-dataset[train] from the Hugging Face hub: offline mode is on "
              "(HF_HUB_OFFLINE) and the dataset is not in the local cache")


def test_offline_contacts_nothing_and_skips_hub_datasets_with_a_note(tmp_path):
    listener = CountingListener()
    try:
        out = run_regen("validate", "--offline", str(hub_source_config(tmp_path)), timeout=60,
                        env={"HF_ENDPOINT": f"http://127.0.0.1:{listener.port}", "HF_HUB_OFFLINE": "0"})
    finally:
        listener.close()
    assert out.returncode == 0 and "is valid" in out.stdout, out.stdout + out.stderr
    assert ("  not probed: --offline contacts no hub (regen generate needs the hub, or the dataset in the local "
            "cache)") in out.stdout
    assert listener.connections == 0


def test_with_hf_hub_offline_a_hub_dataset_is_looked_for_in_the_cache_only_and_contacts_nothing(tmp_path):
    listener = CountingListener()
    try:
        out = run_regen("validate", str(hub_source_config(tmp_path)), timeout=60,
                        env={"HF_ENDPOINT": f"http://127.0.0.1:{listener.port}", "HF_HUB_OFFLINE": "1",
                             "HF_DATASETS_CACHE": str(tmp_path / "cache")})
    finally:
        listener.close()
    assert out.returncode == 2, out.stdout  # as generate: the dataset is in no cache here
    assert ("  the hub is not contacted (HF_HUB_OFFLINE is set): looked for in the local cache only (--offline skips "
            "hub datasets)") in out.stdout
    assert f"  cannot read it: {NOT_CACHED}" in out.stdout
    assert listener.connections == 0


def test_a_hub_that_does_not_answer_a_short_connect_is_looked_for_in_the_cache_only(tmp_path):
    # On the old code: a minute of the hub client's retries, then "the hub is unreachable".
    with socket.socket() as closed:  # a port nothing listens on: the connect is refused at once
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    out = run_regen("validate", str(hub_source_config(tmp_path)), timeout=60,
                    env={"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_OFFLINE": "0",
                         "HF_DATASETS_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"  the hub is not contacted (127.0.0.1:{port} did not answer within 3 s: " in out.stdout
    assert f"  cannot read it: {NOT_CACHED}" in out.stdout


def test_the_production_configs_check_without_contacting_anything_is_true(monkeypatch):
    config = REPO / "configs" / "kimi_k25_88k.yaml"
    text = config.read_text()
    assert "Check it without contacting anything" in text
    command = re.search(r"^#\s+(regen validate .*)$", text, re.MULTILINE).group(1)  # the command the comment gives
    listener = CountingListener()
    try:
        out = run_regen(*shlex.split(command)[1:], env={"HF_ENDPOINT": f"http://127.0.0.1:{listener.port}",
                                                         "SGLANG_API_KEY": ""}, timeout=60)
    finally:
        listener.close()
    assert out.returncode == 0 and "configs/kimi_k25_88k.yaml is valid" in out.stdout, out.stdout + out.stderr
    assert listener.connections == 0
