"""A tiny fault-injecting reverse proxy on 127.0.0.1 in front of the S3 server (moto), so that an S3 fault is
what the AWS SDK inside pyarrow really gets: its retries, its error mapping, pyarrow's OSError.

Armed with (N, fault), it counts the HTTP requests it receives and answers the N-th one (and, persistent,
every later one) with the fault:
- "500": the request IS forwarded and done by the server, then answered 500 InternalError (the worst case
  for the client: the effect happened, the answer says it did not);
- "503" (SlowDown) and "403" (AccessDenied): answered without forwarding (refused before any effect);
- "reset": the connection is reset (RST) once the request has arrived, without forwarding or answering.
Everything else is relayed byte for byte (head and body), one upstream connection per request.
`python -m tests.s3_fault_proxy UPSTREAM_PORT` runs it and prints its port; FaultProxy drives it.
"""
from __future__ import annotations

import asyncio
import json
import socket
import struct
import subprocess
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

S3_FAULTS = ("500", "503", "403", "reset")
_ERRORS = {"500": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
           "503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
           "403": (403, "Forbidden", "AccessDenied", "Access Denied")}


@dataclass
class Plan:
    at: int
    fault: str
    persistent: bool
    requests: list[str] = field(default_factory=list)  # counted requests: "WHAT /bucket/key"
    fired: list[str] = field(default_factory=list)


class FaultProxy:
    """The proxy in its own process (an in-process one would share the GIL with pyarrow, which holds it while
    a dropped upload stream completes), controlled over HTTP under /__fault/ on its own port."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.port = 0
        self._proc: subprocess.Popen | None = None
        self._plan: Plan | None = None

    def start(self) -> "FaultProxy":
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.s3_fault_proxy", str(self.upstream_port)],
                                      stdout=subprocess.PIPE, text=True)
        line = self._proc.stdout.readline()
        if not line.strip().isdigit():
            self._proc.kill()
            raise RuntimeError(f"the fault proxy did not start: {line!r}")
        self.port = int(line)
        return self

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(10)

    def _control(self, action: str, **params: object) -> dict:
        query = urllib.parse.urlencode(params)
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/__fault/{action}?{query}", method="POST")
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.loads(answer.read())

    def arm(self, at: int, fault: str, persistent: bool = False) -> Plan:
        if fault not in S3_FAULTS:
            raise ValueError(f"unknown S3 fault {fault!r}")
        self._control("arm", at=at, fault=fault, persistent=int(persistent))
        self._plan = Plan(at, fault, persistent)
        return self._plan

    def disarm(self) -> Plan:
        """The plan that was armed, with the requests it counted and those it faulted."""
        state = self._control("disarm")
        plan, self._plan = self._plan or Plan(0, "500", False), None
        plan.requests, plan.fired = state.get("requests", []), state.get("fired", [])
        return plan


class _Server:
    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.plan: Plan | None = None

    def _decide(self, what: str) -> str | None:
        plan = self.plan
        if plan is None:
            return None
        plan.requests.append(what)
        n = len(plan.requests)
        if n == plan.at or (plan.persistent and n > plan.at):
            plan.fired.append(what)
            return plan.fault
        return None

    def _control(self, target: str) -> bytes:
        action, _, query = target[len("/__fault/"):].partition("?")
        params = dict(urllib.parse.parse_qsl(query))
        if action == "arm":
            self.plan = Plan(int(params["at"]), params["fault"], params.get("persistent") == "1")
            state: dict = {}
        else:  # disarm
            plan, self.plan = self.plan, None
            state = {"requests": plan.requests, "fired": plan.fired} if plan else {}
        body = json.dumps(state).encode()
        return (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                ).encode() + body

    # --- HTTP/1.1 relaying --------------------------------------------------------------------------
    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await _read_head(reader)
                if head is None:
                    break
                request_line, headers = _parse_head(head)
                method, target = request_line.split(" ")[:2]
                if headers.get("expect", "").lower() == "100-continue":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    head = _without_header(head, b"expect")
                body = await _read_body(reader, headers)
                if target.startswith("/__fault/"):
                    writer.write(self._control(target))
                    await writer.drain()
                    continue
                fault = self._decide(_describe(method, target, headers))
                if fault == "reset":
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                if fault in ("403", "503"):
                    writer.write(_error_response(fault, method))
                    await writer.drain()
                    continue
                response, keep_alive = await self._forward(head + body, method)
                writer.write(_error_response(fault, method) if fault == "500" else response)
                await writer.drain()
                if not keep_alive and fault != "500":
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _forward(self, request: bytes, method: str) -> tuple[bytes, bool]:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            up_writer.write(request)
            await up_writer.drain()
            while True:
                head = await _read_head(up_reader)
                status_line, headers = _parse_head(head)
                if not status_line.split(" ")[1].startswith("1"):
                    break  # skip interim 1xx answers
            if method == "HEAD" or status_line.split(" ")[1] in ("204", "304"):
                return head, headers.get("connection", "").lower() != "close"
            if "content-length" in headers or "chunked" in headers.get("transfer-encoding", "").lower():
                body = await _read_body(up_reader, headers)
                return head + body, headers.get("connection", "").lower() != "close"
            return head + await up_reader.read(), False  # framed by the end of the connection: pass the close on
        finally:
            up_writer.close()


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None


def _parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return lines[0], headers


def _without_header(head: bytes, name: bytes) -> bytes:
    lines = head.split(b"\r\n")
    return b"\r\n".join(line for line in lines if not line.lower().startswith(name + b":"))


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raw = bytearray()
        while True:
            size_line = await reader.readuntil(b"\r\n")
            raw += size_line
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    line = await reader.readuntil(b"\r\n")
                    raw += line
                    if line == b"\r\n":
                        return bytes(raw)
            raw += await reader.readexactly(size + 2)
    length = int(headers.get("content-length", "0"))
    return await reader.readexactly(length) if length else b""


def _describe(method: str, target: str, headers: dict[str, str]) -> str:
    """What a request does and to which key, for the table: "COPY /bucket/key" (a PUT with a copy source),
    "LIST /bucket/prefix" (a GET with list-type), "CREATE-UPLOAD ...", or the method."""
    path, _, query = target.partition("?")
    params = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
    what = method
    if method == "PUT" and "x-amz-copy-source" in headers:
        what = "COPY"
    elif method == "GET" and "list-type" in params:
        what, path = "LIST", f"{path.rstrip('/')}/{params.get('prefix', '')}"
    elif method == "PUT" and path.endswith("/"):
        what = "PUT-MARKER"  # a folder marker: pyarrow writes one after deleting a folder's last file
    elif method == "POST" and "uploads" in params:
        what = "CREATE-UPLOAD"
    elif method == "POST" and "uploadId" in params:
        what = "COMPLETE-UPLOAD"
    return f"{what} {urllib.parse.unquote(path)}"


def _error_response(fault: str, method: str) -> bytes:
    status, reason, code, message = _ERRORS[fault]
    body = b"" if method == "HEAD" else (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
        f"<RequestId>injected</RequestId></Error>").encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
            f"x-amz-request-id: injected\r\n\r\n").encode()
    return head + body


async def _main(upstream_port: int) -> None:
    server = await asyncio.start_server(_Server(upstream_port).serve, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1])))
