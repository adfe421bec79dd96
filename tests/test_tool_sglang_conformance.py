"""The emulator's tool calls against SGLang's own code, versions 0.5.14, 0.5.17, 0.5.18 and 0.5.23 (issue 22).

Per version, one emulator claims that version with Kimi's parsers (--tool-call-parser kimi_k2), regen's own client
sends it tool requests (a call, parallel calls after a call and its result, tool_choice required and none,
streamed and not), and a subprocess with that version's wheel first on its PYTHONPATH checks the bodies against its
ChatCompletionRequest, the answers against its response models, and the calls against its own KimiK2Detector /
FunctionCallParser and call-id rule (tests/conformance/sglang_tool_checks.py). Its detectors import xgrammar
(`make sglang-wheels` installs it without its dependencies)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.emulator import start_emulator
from pipeline.endpoints.client import ClientSettings, EndpointClient
from pipeline.endpoints.engines import SGLangAdapter
from tests.conformance.sglang_source import server_arg_fields
from tests.test_sglang_conformance import MODEL, VERSIONS, WORKTREE, wheel

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Use get_weather: is it raining in Paris?"}]
CALLED = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                                          "function": {"name": "get_weather",
                                                                       "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "Rain."}]
CASES = [  # (messages, tool_choice, thinking)
    (ASK, "auto", True),
    (CALLED + [{"role": "user", "content": "Now get_time, then get_weather for Berlin."}], "auto", True),
    (CALLED, "required", False),
    (CALLED, "auto", True),  # after a result: an answer in text
    (ASK, "none", False),
]


async def drive(url: str, version: str) -> None:
    for messages, tool_choice, thinking in CASES:
        for stream in (False, True):
            settings = ClientSettings(model=MODEL, temperature=0.0, top_p=1.0, max_tokens=96, stream=stream,
                                      chat_template_kwargs={"thinking": thinking}, tool_choice=tool_choice,
                                      engines={"e": SGLangAdapter(version=version)})
            client = EndpointClient(url, "e", settings)
            try:
                await client.chat(messages, None, [WEATHER, TIME])
            finally:
                await client.close()


@pytest.fixture(scope="module", params=VERSIONS)
def version(request, tmp_path_factory):
    root = wheel(request.param)
    tmp = tmp_path_factory.mktemp(f"sglang-tools-{request.param}")
    log = tmp / "requests.jsonl"
    server = start_emulator(sglang_version=request.param, preset="kimi", request_log=str(log),
                            request_log_bodies=True)
    try:
        asyncio.run(drive(server.url, request.param))
        out = tmp / "results.json"
        done = subprocess.run(
            [sys.executable, "-m", "tests.conformance.sglang_tool_checks", "--root", str(root), "--bodies", str(log),
             "--emulator", server.url, "--out", str(out)],
            cwd=WORKTREE, env={**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{WORKTREE}"},
            capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        yield SimpleNamespace(name=request.param, root=root, results=json.loads(out.read_text()))
    finally:
        server.stop()


def _check(version, name: str, checked: int) -> None:
    result = version.results[name]
    assert result["ok"], f"SGLang {version.name}, {name}:\n  " + "\n  ".join(result["detail"])
    assert result["checked"] == checked, result


def test_every_tool_request_regen_sends_is_declared_by_the_version(version):
    _check(version, "requests", len(CASES))


def test_the_emulators_calls_are_what_sglangs_detector_and_id_rule_make(version):
    _check(version, "answers", len(CASES))


def test_every_version_reports_its_tool_call_parser_in_server_info(version):
    """The preflight reads `tool_call_parser` from /server_info, which dumps the server arguments."""
    assert "tool_call_parser" in server_arg_fields(version.root)
