"""A small OpenAI-compatible HTTP server in a thread that answers like vLLM 0.32.0 (the shapes the real server
gave: tests/test_vllm_engine.py), or like that server seen through a proxy that forwards /v1/* only. For what is
regen's own behaviour (identification, probes), where starting the real engine would test nothing more."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# vLLM with VLLM_SERVER_DEV_MODE=1: GET /server_info (vllm/entrypoints/serve/dev/server_info/api_router.py)
DEV_MODE_SERVER_INFO = {"vllm_config": "model='SmolLM2-135M-Instruct', speculative_config=None",
                        "vllm_env": {}, "system_env": {}}


@dataclass
class FakeVLLM:
    model: str = "SmolLM2-135M-Instruct"
    owned_by: str = "vllm"
    version: str | None = "0.32.0"  # None: no /version (404), as behind a proxy
    server_info: dict | None = None  # DEV_MODE_SERVER_INFO: dev mode
    max_model_len: int = 2048
    reasoning: str | None = None  # `message.reasoning` of every answer
    completion_tokens: Any = 2  # usage.completion_tokens (and as many output ids), or a function of the request
    finish_reason: str = "stop"
    requests: list[dict] = field(default_factory=list)

    def start(self) -> "FakeVLLM":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Any, ctype: str = "application/json") -> None:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [
                        {"id": fake.model, "object": "model", "owned_by": fake.owned_by,
                         "max_model_len": fake.max_model_len}]})
                if self.path == "/version" and fake.version:
                    return self._send(200, {"version": fake.version})
                if self.path == "/server_info" and fake.server_info is not None:
                    return self._send(200, fake.server_info)
                if self.path == "/health":
                    return self._send(200, b"", "text/plain")
                self._send(404, {"detail": "Not Found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                self._send(*fake.answer(body))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, body: dict) -> tuple[int, Any, str]:
        ids = bool(body.get("return_token_ids"))
        tokens = self.completion_tokens(body) if callable(self.completion_tokens) else self.completion_tokens
        output = list(range(1, tokens + 1))
        usage = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}
        if not body.get("stream"):
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "ready",
                                                              "reasoning": self.reasoning},
                                      "finish_reason": self.finish_reason}
            answer: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion", "model": self.model,
                                      "choices": [choice], "usage": usage}
            if ids:
                choice["token_ids"], answer["prompt_token_ids"] = output, [7, 8, 9]
            return 200, answer, "application/json"
        first: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": self.model,
                                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        last: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": self.model,
                                "choices": [{"index": 0, "delta": {"content": "ready"},
                                             "finish_reason": self.finish_reason}]}
        if ids:
            first["prompt_token_ids"], last["choices"][0]["token_ids"] = [7, 8, 9], output
        tail = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": self.model, "choices": [],
                "usage": usage}
        events = "".join(f"data: {json.dumps(c)}\n\n" for c in (first, last, tail)) + "data: [DONE]\n\n"
        return 200, events.encode(), "text/event-stream"
