"""Progress: the tqdm bar (done/total, tok/s, ETA) and status.json, rewritten atomically."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from .rundir import RunDir, now_utc


@dataclass
class Progress:
    run_dir: RunDir
    total: int
    already_done: int
    failed_before: int
    rejects: int
    status_interval_s: float = 2.0
    done: int = 0
    failed: int = 0
    completion_tokens: int = 0
    endpoints: dict[str, dict] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.started = time.monotonic()
        self._last_status = 0.0
        self.bar = tqdm(
            total=self.total,
            initial=self.already_done + self.failed_before,
            unit="prompt",
            dynamic_ncols=True,
            file=sys.stderr,
            mininterval=0.5,
            smoothing=0.05,
        )

    def record(self, ok: bool, completion_tokens: int) -> None:
        if ok:
            self.done += 1
            self.completion_tokens += completion_tokens
        else:
            self.failed += 1
        self.bar.update(1)

    def tok_s(self) -> float:
        return self.completion_tokens / max(1e-9, time.monotonic() - self.started)

    def tick(self, endpoints: dict[str, dict]) -> None:
        self.endpoints = endpoints
        now = time.monotonic()
        if now - self._last_status < self.status_interval_s:
            return
        self._last_status = now
        states = "".join({"healthy": "+", "probing": "?", "open": "x", "fatal": "!"}.get(e.get("state"), ".")
                         for e in endpoints.values())
        self.bar.set_postfix_str(f"{self.tok_s():.0f} tok/s, failed {self.failed_before + self.failed}, fleet [{states}]")
        self.write("running")

    def status(self, state: str) -> dict[str, Any]:
        done = self.already_done + self.done
        failed = self.failed_before + self.failed
        return {
            "state": state,
            "updated_at": now_utc().isoformat(timespec="seconds"),
            "total": self.total,
            "done": done,
            "failed": failed,
            "pending": max(0, self.total - done - failed),
            "rejects": self.rejects,
            "this_session": {
                "done": self.done,
                "failed": self.failed,
                "completion_tokens": self.completion_tokens,
                "elapsed_s": round(time.monotonic() - self.started, 1),
                "tok_s": round(self.tok_s(), 1),
            },
            "endpoints": self.endpoints,
            **self.extra,
        }

    def write(self, state: str) -> None:
        self.run_dir.write_status(self.status(state))

    def close(self) -> None:
        self.bar.close()
