"""A tiny stand-in for a vLLM capture server (extract_hidden_states + a hidden-states connector), for route vllm's
contract tests: POST /v1/completions pre-creates `<folder>/cmpl-<X-Request-Id>-0-<hex>.safetensors.lock` under an
exclusive flock, answers with kv_transfer_params.hidden_states_path, and writes the file (random states of the
chosen shape, the chosen metadata) then releases the lock, as vLLM's ExampleHiddenStatesConnector does. Every
field makes it one kind of misconfigured server. It runs in a thread of the test process (no model, no torch)."""
from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import numpy as np
from safetensors.numpy import save_file


def tiny_model_folder(folder: Path, layers: int = 6, hidden: int = 8) -> Path:
    """What route vllm reads of a model: config.json and the final norm's weight."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers,
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_attention_heads": 2, "num_key_value_heads": 2,
        "vocab_size": 64, "rms_norm_eps": 1e-5}))
    save_file({"model.norm.weight": np.linspace(0.5, 1.5, hidden, dtype=np.float32)}, str(folder / "model.safetensors"))
    return folder


@dataclass
class FakeCaptureServer:
    folder: Path  # where it writes (its shared_storage_path)
    model: str  # /v1/models root and model_config.model
    layer_ids: list[int]
    hidden_size: int
    num_hidden_layers: int
    metadata: dict | None = None  # None: regen's connector metadata for the fields above; {}: none (vLLM's own)
    states_per_token: int | None = None  # None: len(layer_ids)
    answer_path: Callable[[Path], str] | None = None  # the path it answers, given the file it writes
    write: bool = True
    error: tuple[int, str] | None = None  # answer every completion with this status and message
    drop_connection: bool = False  # close the connection without an answer
    answer_delay_s: float = 0.0
    hold_until_in_flight: int = 0  # answer only once this many requests are in flight (or hold_limit_s passed)
    hold_limit_s: float = 30.0
    write_delay_s: float = 0.0  # the file is written (and its lock released) this long after the answer
    write_gate: threading.Event | None = None  # if set: the file is written once the test opens the gate
    in_flight: int = 0
    max_in_flight: int = 0
    answered: int = 0
    guard: threading.Condition = field(default_factory=threading.Condition)

    def server_metadata(self) -> dict[str, str]:
        if self.metadata is not None:
            return {"regen_server": json.dumps(self.metadata)} if self.metadata else {}
        return {"regen_server": json.dumps({
            "connector": "regen CpuHiddenStatesConnector", "layer_ids": self.layer_ids, "model": self.model,
            "served_model_name": ["served"], "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers, "vocab_size": 64, "dtype": "float32"})}

    def start(self) -> "FakeCaptureServer":
        self.folder.mkdir(parents=True, exist_ok=True)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def files(self) -> list[str]:
        return sorted(p.name for p in self.folder.iterdir())

    def complete(self, request_id: str, ids: list[int]) -> str:
        """Pre-create the lock (held), answer, then write: returns the path answered."""
        file = self.folder / f"cmpl-{request_id}-0-{os.urandom(4).hex()}.safetensors"  # vLLM's req_id
        lock_fd = os.open(f"{file}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        width = self.states_per_token or len(self.layer_ids)
        states = np.random.default_rng(len(ids)).standard_normal((len(ids), width, self.hidden_size)).astype(np.float32)

        def write() -> None:
            time.sleep(self.write_delay_s)
            if self.write_gate is not None:
                self.write_gate.wait(60)
            try:
                if self.write:
                    save_file({"hidden_states": states, "token_ids": np.asarray(ids, dtype=np.int64)}, str(file),
                              metadata=self.server_metadata())
            finally:
                os.close(lock_fd)

        threading.Thread(target=write, daemon=True).start()
        return self.answer_path(file) if self.answer_path else str(file)


def _handler(server: FakeCaptureServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send(200, {"object": "list", "data": [{"id": "served", "object": "model", "root": server.model}]})

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with server.guard:
                server.in_flight += 1
                server.max_in_flight = max(server.max_in_flight, server.in_flight)
                if server.hold_until_in_flight and server.in_flight >= server.hold_until_in_flight:
                    server.hold_until_in_flight = 0  # a one-shot barrier: the ones after it are not held
                server.guard.notify_all()
                server.guard.wait_for(lambda: server.in_flight >= server.hold_until_in_flight, server.hold_limit_s)
            try:
                reply = self._reply(request)
            finally:  # done before the answer leaves: a client may send its next request the moment it has it
                with server.guard:
                    server.in_flight -= 1
                    server.answered += 1
            if reply is None:
                self.close_connection = True
                self.connection.close()
            else:
                self._send(*reply)

        def _reply(self, request: dict) -> tuple[int, dict] | None:
            """The status and body to answer, or None to drop the connection."""
            time.sleep(server.answer_delay_s)
            if server.drop_connection:
                return None
            if server.error:
                status, message = server.error
                return status, {"error": {"message": message, "type": "BadRequestError", "code": status}}
            path = server.complete(self.headers["X-Request-Id"], list(request["prompt"]))
            return 200, {"choices": [{"text": "x"}], "kv_transfer_params": {"hidden_states_path": path}}

    return Handler
