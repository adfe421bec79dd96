"""The chat bodies regen sends with images, checked against each SGLang version's own request model, in one
subprocess (torch is imported once; each version's modules are dropped before the next is installed):

    python -m tests.conformance.sglang_request_images --bodies BODIES.json --out RESULT.json

BODIES.json: {version: {"root": wheel dir, "bodies": [chat body, ...]}}. Per version: every body parses with the
version's ChatCompletionRequest, no key is left undeclared (a key the version does not declare would be ignored
without a word), every image part's `content_hash` is what the version's validator keeps, and its
http_server.py's /model_info names `has_image_understanding`.
Writes {version: {"ok": bool, "detail": [...], "checked": n, "content_hashes": [...]}}.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tests.conformance.sglang_source import install_namespace


def check_version(root: Path, bodies: list[dict]) -> dict:
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        del sys.modules[name]
    install_namespace(root)
    from sglang.srt.entrypoints.openai import protocol

    from tests.conformance.sglang_checks import undeclared

    detail: list[str] = []
    hashes: list[str | None] = []
    for i, body in enumerate(bodies):
        try:
            request = protocol.ChatCompletionRequest.model_validate(body)
        except Exception as exc:  # noqa: BLE001 - reported, the parent test fails on it
            detail.append(f"body {i}: refused by ChatCompletionRequest: {exc}")
            continue
        detail += [f"body {i}: undeclared {key}" for key in undeclared(request, body)]
        for message in request.messages:
            for part in message.content if isinstance(message.content, list) else []:
                if getattr(part, "type", None) == "image_url":
                    hashes.append(getattr(part.image_url, "content_hash", None))
    server = (root / "sglang/srt/entrypoints/http_server.py").read_text()
    if '"has_image_understanding"' not in server:
        detail.append("http_server.py's /model_info names no has_image_understanding")
    return {"ok": not detail, "detail": detail, "checked": len(bodies), "content_hashes": hashes}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bodies", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    versions = json.loads(Path(a.bodies).read_text())
    results = {v: check_version(Path(entry["root"]), entry["bodies"]) for v, entry in versions.items()}
    Path(a.out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
