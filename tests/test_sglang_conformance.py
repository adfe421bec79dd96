"""Conformance with SGLang's own code, versions 0.5.14, 0.5.17, 0.5.18 and 0.5.23 (issue 14).

The authority is each version's wheel, unpacked by `make sglang-wheels` into ~/.cache/regen/sglang/<version>
(REGEN_SGLANG_CACHE overrides); a missing one fails the tests unless REGEN_ALLOW_MISSING_WHEELS=1. Per version,
one emulator claims that version and regen's own code (the preflight, the chat client streamed and not, and
`regen bench-endpoints`' /generate request) talks to it with the emulator logging every body; then one subprocess, with that wheel first on its PYTHONPATH, checks those bodies and the emulator's
answers against the version's own models (tests/conformance/sglang_checks.py). The error texts are read out of
the wheels' sources here, so a message SGLang renames fails instead of being misclassified.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from pipeline.core.config import RunConfig
from pipeline.core.errors import ContractError, Retryable, TerminalForPrompt
from pipeline.emulator import expected_chat, make_config, start_emulator
from pipeline.endpoints.classify import classify
from pipeline.endpoints.client import ClientSettings, EndpointClient
from pipeline.endpoints.engines import SGLangAdapter
from pipeline.endpoints.probes import check_endpoint
from pipeline.tools.bench_endpoints import one_request
from tests.conformance.sglang_image_checks import drive_images
from tests.conformance.sglang_source import as_pattern, render, server_arg_fields, templates_with
from tests.conformance.sglang_tool_checks import CASES as TOOL_CASES, TEXTS as TOOL_TEXTS, drive_tools
from tests.helpers import post_json
from tests.image_helpers import data_url, image_chat, image_part, png
from tests.helpers import prompt_source, run_regen, write_config

VERSIONS = ("0.5.14", "0.5.17", "0.5.18", "0.5.23")
CACHE = Path(os.environ.get("REGEN_SGLANG_CACHE", Path.home() / ".cache/regen/sglang"))
WORKTREE = Path(__file__).resolve().parent.parent
MODEL = "moonshotai/Kimi-K2.5"
MESSAGES = [{"role": "user", "content": "Why is the sky blue? Answer briefly."}]
TM, UTILS = "sglang/srt/managers/tokenizer_manager.py", "sglang/srt/managers/utils.py"
CHAT = "sglang/srt/entrypoints/openai/serving_chat.py"
API_TYPES = "sglang/api/v1/api_types.py"  # 0.5.23: the /generate contract (serde's texts)


def wheel(version: str) -> Path:
    """A missing wheel fails (`make test` unpacks them first); REGEN_ALLOW_MISSING_WHEELS=1 skips instead."""
    root = CACHE / version
    if not (root / ".installed").exists():
        why = f"SGLang {version} is not unpacked in {CACHE}: run `make sglang-wheels`"
        if os.environ.get("REGEN_ALLOW_MISSING_WHEELS") == "1":
            pytest.skip(why)
        pytest.fail(why + " (or set REGEN_ALLOW_MISSING_WHEELS=1 to skip the conformance tests)")
    return root


def run_config(url: str, **overrides) -> RunConfig:
    values = {"run_name": "c", "model": MODEL, "thinking": True, "sources": [{"spec": "unused.yaml"}],
              "endpoints": [{"url": url, "name": "e"}], "sampling": {"max_tokens": 24}, **overrides}
    return RunConfig.model_validate(values)


def settings(cfg: RunConfig, report, stream: bool) -> ClientSettings:
    return ClientSettings(model=cfg.model, temperature=0.0, top_p=1.0, max_tokens=24,
                          chat_template_kwargs=cfg.template_kwargs(), stream=stream,
                          engines={"e": report.engine}, **cfg.sampling.explicit())


async def drive_regen(url: str) -> dict:
    """Every kind of request regen sends, through regen's own code; returns the preflight reports."""
    reports = {}
    for name, overrides in (("ids", {}), ("stream", {"stream": True})):
        cfg = run_config(url, **overrides)
        probe = EndpointClient(url, "e", settings(cfg, SimpleNamespace(engine=None), False))
        try:
            reports[name] = await check_endpoint(probe, cfg)
        finally:
            await probe.close()
    cfg = run_config(url)
    for stream in (False, True):
        chat = EndpointClient(url, "e", settings(cfg, reports["ids"], stream))
        try:
            await chat.chat(MESSAGES, seed=7)
        finally:
            await chat.close()
    native = EndpointClient(url, "e", settings(cfg, reports["ids"], False))
    try:
        await one_request(native, 0, native=True)  # bench-endpoints: the prompt's ids, then /generate
    finally:
        await native.close()
    return reports


@pytest.fixture(scope="module", params=VERSIONS)
def version(request, tmp_path_factory):
    root = wheel(request.param)
    tmp = tmp_path_factory.mktemp(f"sglang-{request.param}")
    log = tmp / "requests.jsonl"
    server = start_emulator(sglang_version=request.param, preset="kimi-eagle3", request_log=str(log),
                            request_log_bodies=True)
    try:
        reports = asyncio.run(drive_regen(server.url))
        asyncio.run(drive_tools(server.url, request.param, MODEL))
        drive_images(server.url, request.param)
        out = tmp / "results.json"
        done = subprocess.run(
            [sys.executable, "-m", "tests.conformance.sglang_checks", "--root", str(root), "--bodies", str(log),
             "--emulator", server.url, "--out", str(out)],
            cwd=WORKTREE, env={**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{WORKTREE}"},
            capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        yield SimpleNamespace(name=request.param, root=root, server=server, tmp=tmp, reports=reports,
                              results=json.loads(out.read_text()), log=log)
    finally:
        server.stop()


def _check(version, name: str, at_least: int) -> None:
    result = version.results[name]
    assert result["ok"], f"SGLang {version.name}, {name}:\n  " + "\n  ".join(result["detail"])
    assert result["checked"] >= at_least, result


# --- per version: regen's bodies, the emulator's answers -------------------------------------------------------
def test_every_request_body_is_declared_by_the_version(version):
    routes = {json.loads(line)["route"] for line in version.log.read_text().splitlines()}
    assert {"/v1/chat/completions", "/generate"} <= routes  # chat, stream, probes, prompt ids, bench's /generate
    _check(version, "requests", 7)


def test_every_emulator_answer_parses_with_the_version_models(version):
    _check(version, "responses", 8)


def test_server_info_names_only_the_version_arguments(version):
    _check(version, "server_info", 2)


def test_kimi_split_matches_sglang_reasoning_parser(version):
    _check(version, "kimi_split", 10)


def test_the_emulators_tool_calls_are_what_sglangs_detector_and_id_rule_make(version):
    """Kimi's markup read by the version's own serving code (its _process_tool_calls around KimiK2Detector, ids by
    its _process_tool_call_id: 0.5.14 numbers unstreamed calls with the model's own IDX, so the history counts
    twice), streamed and not: whole calls, a call cut at each of its tokens, arguments that are not an object
    (sglang_tool_checks.py)."""
    result = version.results["tool_calls"]
    assert result["ok"], f"SGLang {version.name}:\n  " + "\n  ".join(result["detail"])
    assert result["checked"] == len(TOOL_CASES), result


def test_the_emulators_parser_reads_odd_texts_as_the_versions_parser_does(version):
    """Text before and after the section, spaces around arguments, nested and braced-but-not-JSON arguments, a
    string argument, an id SGLang cannot read, a section cut short: the emulator's kimi_parser.py against the
    version's serving code, whole and streamed."""
    _check(version, "tool_texts", 2 * len(TOOL_TEXTS))


def test_the_preflight_can_read_the_tool_call_parser_of_every_version(version):
    """/server_info dumps the server arguments: tool_call_parser is one in every version."""
    assert "tool_call_parser" in server_arg_fields(version.root)


def test_preflight_knows_the_version(version):
    ids, stream = (version.reports[k] for k in ("ids", "stream"))
    assert ids.engine.version == version.name == ids.sglang_version
    if version.name == "0.5.14":
        [problem] = ids.problems
        assert "SGLang 0.5.14" in problem and "upgrade" in problem and "return_token_ids: false" in problem
    else:
        assert ids.ok, ids.problems
    if version.name == "0.5.23":  # stream ids come in the final sglext chunk
        assert stream.ok, stream.problems
    elif version.name == "0.5.14":  # no output ids at all
        assert "SGLang 0.5.14" in stream.problems[0]
    else:
        assert any("stream" in p for p in stream.problems), stream.problems


def test_short_run_stores_the_exact_ids_or_is_refused(version, tmp_path):
    cfg_path = write_config(tmp_path, [{"url": version.server.url, "concurrency": 2}], [prompt_source(tmp_path, 3)],
                            model=MODEL, thinking=True, sampling={"temperature": 0.0, "max_tokens": 24},
                            stream=version.name == "0.5.23")
    done = run_regen("generate", "--config", str(cfg_path), timeout=180)
    if version.name == "0.5.14":
        assert done.returncode == 1, done.stderr[-2000:]
        assert "SGLang 0.5.14 returns no output token ids" in done.stderr
        assert "upgrade the server" in done.stderr and "return_token_ids: false" in done.stderr
        return
    assert done.returncode == 0, done.stderr[-2000:]
    rows = pq.read_table(tmp_path / "out" / "t" / "data").to_pylist()
    assert len(rows) == 3
    for row in rows:
        want = expected_chat({"messages": row["messages"], "max_tokens": 24, "temperature": 0.0,
                              "chat_template_kwargs": {"thinking": True}}, make_config(preset="kimi-eagle3"))
        assert row["output_token_ids"] == want["output_ids"] and row["prompt_token_ids"] == want["prompt_ids"]
        assert row["deterministic"] is False  # the emulator runs without --enable-deterministic-inference
    manifest = json.loads((tmp_path / "out" / "t" / "run.json").read_text())
    assert manifest["deterministic"] is False
    assert manifest["generation"]["explicit_sampling"] == {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


# --- image prompts (tests/conformance/sglang_image_checks.py) ------------------------------------------------------
def test_image_requests_parse_with_the_version_models(version):
    """A run's image requests are declared by the version's ChatCompletionRequest and their answers parse (the
    requests and responses checks above include them); image_url variants (content_hash, detail, shapes) are
    accepted or refused by the emulator exactly as by the version's own models."""
    bodies = [json.loads(line).get("body") or {} for line in version.log.read_text().splitlines()]
    assert sum("image_url" in json.dumps(b.get("messages")) for b in bodies) >= 3
    _check(version, "image_parts", 12)


def test_kimi_placeholder_count_is_the_wheels(version):
    """Kimi-K2.5's placeholder count for an image size is the wheel's navit_resize_config, in the pure rule and in
    an image request's prompt_token_ids (its media_placeholder_token_id, expanded in one run)."""
    _check(version, "image_tokens", 16)


def test_image_loading_answers_as_the_wheel(version):
    """Every image URL form is read as the version's own loaders read it (the same size, or the same error) and a
    failure is answered with the status and text that version's wrapping makes of it."""
    _check(version, "image_loads", 15)


def test_model_info_fields_are_the_wheels(version):
    """/model_info has the version's keys; has_image_understanding is true for Kimi-K2.5 as its ModelConfig
    decides (a multimodal architecture with a vision_config); no audio."""
    _check(version, "model_info", 2)


# --- the error texts, read out of the wheels ---------------------------------------------------------------------
CONTEXT = "context overflow"
EVERY = "every request to this endpoint would be refused"
ERROR_TEXTS = [  # (phrase that finds the text in the wheel, files, class, classify's message prefix, from version)
    ("is longer than the model's context length", (TM,), TerminalForPrompt, CONTEXT, "0.5.14"),
    ("exceeds the model's maximum context length", (TM,), TerminalForPrompt, CONTEXT, "0.5.14"),
    ("exceeds the maximum allowed length", (UTILS,), TerminalForPrompt, CONTEXT, "0.5.14"),
    # every request to the endpoint would get these: it leaves the fleet, the prompt is not failed
    ("max_completion_tokens is too large", (CHAT,), ContractError, EVERY, "0.5.14"),
    ("return_prompt_token_ids is not supported with streaming", (CHAT,), ContractError, EVERY, "0.5.14"),
    ("return_token_ids is not supported with streaming", (CHAT,), ContractError, EVERY, "0.5.17"),
    ("unknown field `", (API_TYPES,), ContractError, EVERY, "0.5.23"),
    ("Duplicate request ID", (TM,), Retryable, "", "0.5.14"),
]


@pytest.mark.parametrize("name", VERSIONS)
def test_every_400_text_of_the_wheel_is_classified(name):
    root = wheel(name)
    for phrase, files, cls, prefix, since in ERROR_TEXTS:
        templates = [t for t in templates_with(root, files, phrase) if not t.startswith("\x00")]
        if VERSIONS.index(name) < VERSIONS.index(since):
            continue
        assert templates, f"SGLang {name} no longer says {phrase!r} in {files}: the classifier needs its new text"
        for template in templates:
            error = classify(400, render(template))
            assert type(error) is cls and error.message.startswith(prefix), (name, template, error)


def test_every_sglang_marker_of_the_classifier_is_in_a_wheel():
    """A marker no checked version sends is dead (or SGLang renamed the text): it must not hide there."""
    roots = [wheel(v) for v in VERSIONS]
    texts = SGLangAdapter().error_texts
    for marker in texts.context_overflow + texts.retry + texts.endpoint_fatal + texts.contract:
        assert any(templates_with(root, (TM, UTILS, CHAT, API_TYPES), marker) for root in roots), marker


def test_emulator_messages_are_the_wheel_texts(version):
    """The emulator's 400s are the version's own texts, and its total-token check is `>` (one more is 400). The
    emulator without a preset is a text-only model: an image part is refused with the version's text (0.5.17+),
    or ignored as 0.5.14, which has no such check, ignores it."""
    tight = start_emulator(sglang_version=version.name, context_length=64)
    try:
        def post(path: str, body: dict) -> tuple[int, dict]:
            return post_json(tight.url + path, body, timeout=10)

        prompt = expected_chat({"messages": MESSAGES, "max_tokens": 1}, make_config())["prompt_tokens"]
        status, _ = post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 64 - prompt})
        assert status == 200  # prompt + max_tokens == context: admitted (`>`, not `>=`)
        cases = [
            (("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 65 - prompt}), TM,
             "exceeds the model's maximum context length"),
            (("/v1/chat/completions", {"messages": MESSAGES * 20, "max_tokens": 1}), TM,
             "is longer than the model's context length"),
        ]
        if version.name != "0.5.14":
            cases.append((("/v1/chat/completions", image_chat(image_part(data_url(png(8, 8))), "Hi", max_tokens=4)),
                          CHAT, "Model only supports text input"))
        for (path, body), file, phrase in cases:
            status, answer = post(path, body)
            message = answer.get("message") or answer["error"]["message"]
            templates = templates_with(version.root, (file,), phrase)
            assert status == 400 and any(as_pattern(t).match(message) for t in templates), (message, templates)
        if version.name == "0.5.14":
            assert not templates_with(version.root, (CHAT,), "Model only supports text input")
            status, answer = post("/v1/chat/completions", image_chat(image_part("data:,"), "Hi", max_tokens=4))
            assert status == 200 and answer["usage"]["prompt_tokens"] == expected_chat(
                image_chat("Hi", max_tokens=4), make_config())["prompt_tokens"]  # the image is not read: dropped
    finally:
        tight.stop()


# --- no wheel needed -----------------------------------------------------------------------------------------------
def test_an_unknown_version_is_named_as_such():
    from pipeline.endpoints.engines import SGLangAdapter

    unknown = SGLangAdapter(version=None)
    problem, warning = unknown.stream_ids_problem(), unknown.version_warning()
    assert "None" not in problem and "reports no SGLang version" in problem and "stream: false" in problem
    assert "None" not in warning and "assume the newest" not in warning  # it asks for no stream ids: not the newest
    assert "SGLang 0.5.18 sends no token ids on a stream" in SGLangAdapter(version="0.5.18").stream_ids_problem()
    assert SGLangAdapter(version="0.5.23").stream_ids_problem() is None


@pytest.mark.parametrize("name", VERSIONS)
def test_a_stream_names_no_weight_version(name):
    """No version's stream chunk declares `metadata`: the accumulator reads no weight version from one."""
    import ast

    from pipeline.endpoints.client import StreamAccumulator
    from tests.conformance.sglang_source import _class_fields

    protocol = ast.parse((wheel(name) / "sglang/srt/entrypoints/openai/protocol.py").read_text())
    assert "metadata" not in _class_fields(protocol, "ChatCompletionStreamResponse")
    assert "metadata" in _class_fields(protocol, "ChatCompletionResponse")
    stream = StreamAccumulator()
    stream.add({"id": "r", "model": MODEL, "metadata": {"weight_version": "v9"},
                "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]})
    assert stream.completion(0.1).weight_version is None
