"""One SGLang version's checks, run in a subprocess whose PYTHONPATH starts with that version's unpacked wheel:

    python -m tests.conformance.sglang_checks --root DIR --bodies LOG --emulator URL --out RESULT.json

- every request body regen sent (the emulator's request log, bodies included) against this version's own
  request models: ChatCompletionRequest, TokenizeRequest, GenerateReqInput (ast) and SamplingParams, and on
  0.5.23 the /generate contract gate itself. A key the version does not declare is a failure: the real server
  would ignore it without a word.
- every emulator answer to those bodies, and its information endpoints, against this version's response models
  (a key they do not declare is a failure too: the emulator invented it).
- the emulator's Kimi reasoning split against this version's own ReasoningParser("kimi_k2");
- the emulator's tool calls against this version's own KimiK2Detector and call-id rule (sglang_tool_checks.py);
- its image prompts against this version's own Kimi-K2.5 processor rule, image loaders and /model_info
  (sglang_image_checks.py).
Writes {check: {"ok": bool, "detail": [...]}}.
"""
from __future__ import annotations

import argparse
import warnings
import inspect
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.conformance.sglang_source import (function_dict_keys, generate_request_fields, install_namespace,
                                             server_arg_fields)


def undeclared(instance: Any, data: Any, path: str = "") -> list[str]:
    """Keys of `data` that the pydantic model it parsed into does not declare, recursively."""
    from pydantic import BaseModel

    if not isinstance(instance, BaseModel) or not isinstance(data, dict):
        return []
    fields = type(instance).model_fields
    by_key = {name: name for name in fields}
    for name, info in fields.items():
        for alias in (info.alias, info.validation_alias):
            if isinstance(alias, str):
                by_key[alias] = name
    out = []
    for key, value in data.items():
        if key not in by_key:
            out.append(path + key)
            continue
        attr = getattr(instance, by_key[key], None)
        if isinstance(attr, BaseModel):
            out += undeclared(attr, value, f"{path}{key}.")
        elif isinstance(attr, list) and isinstance(value, list):
            for i, (a, v) in enumerate(zip(attr, value)):
                out += undeclared(a, v, f"{path}{key}[{i}].")
    return out


class Checker:
    def __init__(self, root: Path, emulator: str):
        install_namespace(root)
        from sglang.srt.entrypoints.openai import protocol
        from sglang.srt.sampling.sampling_params import SamplingParams

        self.root, self.emulator, self.p = root, emulator.rstrip("/"), protocol
        self.generate_fields = generate_request_fields(root)
        # 0.5.23: a msgspec Struct; before: a class taking its fields as __init__ arguments
        self.sampling_fields = set(getattr(SamplingParams, "__struct_fields__", ())) or \
            set(inspect.signature(SamplingParams.__init__).parameters) - {"self"}
        try:
            from sglang.srt.entrypoints.api_contract import generate_contract_error
        except ImportError:  # before 0.5.23 there is no contract gate
            generate_contract_error = None
        self.contract = generate_contract_error
        self.results: dict[str, dict] = {}

    def report(self, name: str, problems: list[str], checked: int) -> None:
        entry = self.results.setdefault(name, {"ok": True, "detail": [], "checked": 0})
        entry["detail"] += problems
        entry["ok"] = entry["ok"] and not problems
        entry["checked"] += checked

    # --- requests ----------------------------------------------------------------------------------
    def request(self, route: str, body: dict) -> list[str]:
        label = f"{route} {sorted(body)}"
        if route == "/v1/chat/completions":
            return self._model_request(self.p.ChatCompletionRequest, body, label)
        if route in ("/v1/tokenize", "/tokenize"):
            return self._model_request(self.p.TokenizeRequest, body, label)
        if route == "/generate":
            problems = [f"/generate: {k} is not a GenerateReqInput field" for k in body
                        if k not in self.generate_fields]
            problems += [f"/generate: sampling_params.{k} is not a SamplingParams argument"
                         for k in body.get("sampling_params") or {} if k not in self.sampling_fields]
            if self.contract is not None and (error := self.contract(body)):
                problems.append(f"/generate: the contract gate refuses it: {error}")
            return problems
        return [f"{route}: no request model known for this route"]

    def _model_request(self, model: Any, body: dict, label: str) -> list[str]:
        try:
            parsed = model.model_validate(body)
        except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError, reported as a failure
            return [f"{label}: refused by {model.__name__}: {exc}"]
        return [f"{label}: {key} is not declared by {model.__name__} (the server would ignore it)"
                for key in undeclared(parsed, body)]

    # --- responses ---------------------------------------------------------------------------------
    def _http(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.emulator + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def _parse(self, model: Any, data: dict, label: str) -> list[str]:
        try:
            parsed = model.model_validate(data)
        except Exception as exc:  # noqa: BLE001
            return [f"{label}: does not parse as {model.__name__}: {exc}"]
        return [f"{label}: {key} is not declared by {model.__name__}" for key in undeclared(parsed, data)]

    def response(self, route: str, body: dict) -> list[str]:
        status, raw = self._http("POST", route, body)
        label = f"{route} answer"
        if status != 200:
            data = json.loads(raw)
            if route == "/generate" or "object" not in data:
                return []  # native errors: {"error": {...}} or {"error": "<text>"}; no model
            return self._parse(self.p.ErrorResponse, data, label + f" ({status})")
        if body.get("stream"):
            problems = []
            for line in raw.decode().splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if route == "/v1/chat/completions" and "error" not in chunk:
                        problems += self._parse(self.p.ChatCompletionStreamResponse, chunk, label + " chunk")
            return problems
        data = json.loads(raw)
        if route == "/v1/chat/completions":
            return self._parse(self.p.ChatCompletionResponse, data, label)
        if route in ("/v1/tokenize", "/tokenize"):
            return self._parse(self.p.TokenizeResponse, data, label)
        return self._generate_answer(data)

    def _generate_answer(self, data: dict) -> list[str]:
        meta = data.get("meta_info") or {}
        spans = meta.get("weight_versions")
        if spans is None:
            return []
        weight_versions = self.root / "sglang/srt/utils/weight_versions.py"
        if not weight_versions.exists():
            return ["/generate answer: meta_info.weight_versions, which this version does not have"]
        span_keys = function_dict_keys(weight_versions, "add_weight_versions_to_meta_info") - {"weight_versions",
                                                                                             "weight_version"}
        return [f"/generate answer: a weight_versions span has keys {sorted(s)}, the wheel {sorted(span_keys)}"
                for s in spans if set(s) != span_keys]

    def info_endpoints(self) -> None:
        http_server = self.root / "sglang/srt/entrypoints/http_server.py"
        status, raw = self._http("GET", "/v1/models")
        self.report("responses", self._parse(self.p.ModelList, json.loads(raw), "/v1/models"), 1)
        _, raw = self._http("GET", "/server_info")
        allowed = server_arg_fields(self.root) | function_dict_keys(http_server, "server_info") | {
            "max_total_num_tokens", "max_req_input_len"}  # scheduler_info, merged in by server_info()
        self.report("server_info", [f"/server_info: {k} is not a server argument of this version"
                                    for k in json.loads(raw) if k not in allowed], 1)
        _, raw = self._http("GET", "/model_info")
        allowed = function_dict_keys(http_server, "model_info") | function_dict_keys(http_server, "get_model_info")
        self.report("server_info", [f"/model_info: {k} is not a key this version answers"
                                    for k in json.loads(raw) if k not in allowed], 1)

    # --- the Kimi reasoning split ------------------------------------------------------------------
    def kimi_split(self) -> None:
        from sglang.srt.parser.reasoning_parser import ReasoningParser

        from pipeline.emulator.model import encode, generate, render_chat, split_reasoning
        from pipeline.emulator.protocol import stream_deltas

        problems, checked = [], 0
        for n, max_tokens in enumerate((40, 40, 40, 6, 200)):
            prompt = render_chat([{"role": "user", "content": f"question number {n}: why is the sky blue?"}])
            gen = generate(prompt.encode(), encode(prompt), max_tokens, thinking=True)
            content, reasoning = split_reasoning(gen, True)
            # thinking on: the prompt ends with <think>, so the server's parser starts inside the reasoning
            theirs_reasoning, theirs_content = ReasoningParser("kimi_k2", stream_reasoning=False,
                                                               force_reasoning=True).parse_non_stream(gen.text)
            if ((theirs_reasoning or "").strip(), (theirs_content or "").strip()) != (reasoning or "", content):
                problems.append(f"whole answer {n} ({gen.finish}): ours ({reasoning!r}, {content!r}), "
                                f"SGLang's ({theirs_reasoning!r}, {theirs_content!r})")
            streaming = ReasoningParser("kimi_k2", stream_reasoning=True, force_reasoning=True)
            theirs = ["", ""]
            for piece in gen.pieces:
                r, c = streaming.parse_stream_chunk(piece)
                theirs[0] += r or ""
                theirs[1] += c or ""
            deltas = stream_deltas(gen, True)
            ours = ("".join(d.get("reasoning_content", "") for d in deltas),
                    "".join(d.get("content", "") for d in deltas))
            if (theirs[0].strip(), theirs[1].strip()) != (ours[0].strip(), ours[1].strip()):
                problems.append(f"stream {n}: ours {ours!r}, SGLang's {tuple(theirs)!r}")
            checked += 2
        self.report("kimi_split", problems, checked)


def main(argv: list[str] | None = None) -> int:
    warnings.simplefilter("ignore", DeprecationWarning)  # reading max_tokens warns; it is still declared
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--bodies", type=Path, required=True)
    parser.add_argument("--emulator", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from tests.conformance.sglang_image_checks import ImageChecker

    checker = ImageChecker(args.root, args.emulator)
    for line in args.bodies.read_text().splitlines():
        entry = json.loads(line)
        route, body = entry["route"], entry.get("body")
        if body is None:
            continue
        checker.report("requests", checker.request(route, body), 1)
        checker.report("responses", checker.response(route, body), 1)
        if body.get("tools") and not body.get("stream"):  # tool_answer asks for the stream itself
            checker.report("tool_calls", checker.tool_answer(body), 1)
    checker.info_endpoints()
    checker.kimi_split()
    checker.texts()
    checker.image_checks()
    args.out.write_text(json.dumps(checker.results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
