"""Route `vllm`: the server writes the states into a safetensors file; only its path travels over HTTP.

The server runs `--speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
"draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [a, b, c, L]}}}'` (the three aux ids, then
L = num_hidden_layers: the last layer's output before the final norm) and a hidden-states KV connector with
`kv_role: kv_producer` and a `shared_storage_path` this actor can read (on vLLM's CPU build, regen's
CpuHiddenStatesConnector, pipeline/endpoints/vllm_plugins/, which does not pin memory; `local_fleet` with
`hidden_states_dir` starts such a server). Per sample: POST /v1/completions with the ids as the
prompt and max_tokens 1; the answer's `kv_transfer_params.hidden_states_path` names a file holding
`hidden_states` [T, 4, H] and `token_ids` [T]; the actor waits on `<path>.lock`, checks the ids, computes the final
post-norm state with the model's own RMSNorm weight and epsilon (read from the model folder), and deletes the file.

A file whose reader dies (an actor killed with its driver, its request already at the server) would stay on the
server's disk for good. So every request is named (X-Request-Id, which vLLM puts in the file name) after the
capture and the driver's session, and each call removes the files of the same capture left by earlier sessions:
only one session holds a capture's lock at a time, and other runs' or other clients' files never match.
"""
from __future__ import annotations

import fcntl
import itertools
import json
import os
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.errors import ConfigError
from .layout import AUX, FINAL_POST_NORM, LAST_PRE_NORM, CaptureLayout


@dataclass(frozen=True)
class RequestOwner:
    """Names the server's files `cmpl-regen-<capture_key>-<session>-<n>-...` (vLLM prefixes `cmpl-` and appends
    its own suffix to the request id)."""

    capture_key: str  # the same for every session of one capture (a hash of RUN/capture's location)
    session: str  # one driver's session; no "-" in it

    def request_id(self, n: int) -> str:
        return f"regen-{self.capture_key}-{self.session}-{n}"

    def left_by_an_earlier_session(self, name: str) -> bool:
        prefix = f"cmpl-regen-{self.capture_key}-"
        return name.startswith(prefix) and not name[len(prefix):].startswith(f"{self.session}-")


class VllmRoute:
    def __init__(self, cfg, owner: RequestOwner | None = None):
        from .routes import identity_for, layout_for

        self.cfg, self.opts = cfg, cfg.vllm
        self.owner = owner or RequestOwner(uuid.uuid4().hex[:12], uuid.uuid4().hex[:12])
        self.requests = itertools.count()
        self.layout: CaptureLayout = layout_for(cfg)
        self.model_identity = identity_for(cfg)
        self.url = self.opts.url.rstrip("/")
        self.key = os.environ.get(self.opts.api_key_env) if self.opts.api_key_env else None
        self.model = self.opts.model or self._get("/v1/models")["data"][0]["id"]
        self.norm_weight, self.eps = _final_norm(cfg.model)

    def _request(self, path: str, body: dict | None = None, request_id: str | None = None) -> dict:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.key}"} if self.key else {}),
                   **({"X-Request-Id": request_id} if request_id else {})}
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, headers=headers)
        with urllib.request.urlopen(req, timeout=self.opts.timeout_s) as answer:
            return json.loads(answer.read())

    def _get(self, path: str) -> dict:
        return self._request(path)

    def capture(self, token_ids: list[int]) -> np.ndarray:
        from safetensors.numpy import load_file

        answer = self._request("/v1/completions", {"model": self.model, "prompt": list(token_ids), "max_tokens": 1,
                                                   "temperature": 0.0, "return_token_ids": True},
                               self.owner.request_id(next(self.requests)))
        path = ((answer.get("kv_transfer_params") or {}).get("hidden_states_path"))
        if not path:
            raise ConfigError(f"{self.url} returned no kv_transfer_params.hidden_states_path: start vLLM with "
                              "--speculative-config method=extract_hidden_states and a hidden-states KV connector")
        _wait_unlocked(path, self.opts.lock_timeout_s)
        try:
            tensors = load_file(path)
        finally:
            for leftover in (path, path + ".lock"):
                Path(leftover).unlink(missing_ok=True)  # the server's own file is removed once read
            self._remove_earlier_sessions_files(Path(path).parent)
        states = self.check_file(tensors["hidden_states"].astype(np.float32), tensors["token_ids"], token_ids)
        pre = states[:, 3]
        post = pre / np.sqrt(np.mean(pre.astype(np.float64) ** 2, axis=-1, keepdims=True) + self.eps) * self.norm_weight
        by_kind = {AUX: iter(states[:, k] for k in range(3)), FINAL_POST_NORM: iter([post]), LAST_PRE_NORM: iter([pre])}
        return np.stack([next(by_kind[s.kind]) for s in self.layout.states], axis=1).astype(np.float32)

    def check_file(self, states: np.ndarray, ids: np.ndarray, token_ids: list[int]) -> np.ndarray:
        """The server's states of one request: [T, 4, H] for the ids sent. Another width is another model behind the
        server, wrong for every sample: ConfigError, which stops the capture at its first sample."""
        if states.ndim == 3 and states.shape[2] != self.layout.hidden_size:
            raise ConfigError(f"{self.url} returns {states.shape[2]}-wide hidden states, but capture.json's layout is "
                              f"{self.layout.hidden_size} wide ({self.layout.model}): the server runs another model "
                              f"than the capture's (vllm.url serves {self.model})")
        if ids.tolist() != list(token_ids) or states.shape[:2] != (len(token_ids), 4):
            raise ValueError(f"the server's file holds {states.shape} for ids {ids.shape}; expected "
                             f"[{len(token_ids)}, 4, H] for the ids sent (aux ids then L in the server's config)")
        return states

    def _remove_earlier_sessions_files(self, folder: Path) -> None:
        for file in folder.glob(f"cmpl-regen-{self.owner.capture_key}-*"):
            if self.owner.left_by_an_earlier_session(file.name):
                file.unlink(missing_ok=True)


def _wait_unlocked(path: str, timeout_s: float) -> None:
    """The connector writes the file after answering and holds an exclusive flock on `<path>.lock` meanwhile."""
    deadline = time.monotonic() + timeout_s
    lock = path + ".lock"
    while not os.path.exists(path) and not os.path.exists(lock):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: the server wrote no file within {timeout_s}s")
        time.sleep(0.02)
    if os.path.exists(lock):
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        finally:
            os.close(fd)


def _final_norm(model: str) -> tuple[np.ndarray, float]:
    """The final RMSNorm's weight and epsilon, read from the model folder's safetensors and config.json."""
    from safetensors import safe_open

    folder = Path(model)
    config = json.loads((folder / "config.json").read_text())
    eps = float(config.get("rms_norm_eps", 1e-6))
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            for name in ("model.norm.weight", "model.language_model.norm.weight"):
                if name in f.keys():
                    return f.get_tensor(name).astype(np.float32), eps
    raise ConfigError(f"{model}: no final norm weight (model.norm.weight) in its safetensors")
