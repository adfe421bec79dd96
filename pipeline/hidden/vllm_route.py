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

What the server is, is checked, not assumed: `/v1/models` (`root`) once at start, and each file's metadata, written
by regen's connector (the layer ids the server captures, its model, hidden size, layers, dtype), against the
capture's layout and model. A server that cannot serve this capture (other layers or model, a file of another
shape, a folder this host cannot see, a path outside its folder or not named after the request) raises
ContractError; a server that does not answer, EndpointDown or Retryable (endpoints/classify.py `classify`); a sample
the server refuses (HTTP 400, e.g. past its context), CaptureSampleError. Only a file in the server's folder named
after this request (vLLM's `{req_id}.safetensors`, req_id `cmpl-<X-Request-Id>-0-<8 hex>`) is ever deleted.

A file whose reader dies (an actor killed with its driver, its request already at the server) would stay on the
server's disk for good. So every request is named (X-Request-Id, which vLLM puts in the file name) after the
capture (its host, location and creation), the driver's session and the actor, and each call removes the files of
the same capture left by earlier sessions: only one session holds a capture's lock at a time, and other runs' (a
capture at the same path on another host included) or other clients' files never match.
"""
from __future__ import annotations

import fcntl
import http.client
import itertools
import json
import os
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.errors import ConfigError, ContractError, Retryable, TerminalForPrompt
# the one classifier of server errors, with its helpers for an error body and a lost connection
from ..endpoints.classify import classify, error_message, parse_body, unexpected, was_dropped
from .layout import AUX, FINAL_POST_NORM, LAST_PRE_NORM, CaptureLayout
from .errors import CaptureSampleError
from .routes import normalised_model

# The metadata key regen's connector writes (pipeline/endpoints/vllm_plugins/, not importable from regen).
METADATA_KEY = "regen_server"


@dataclass(frozen=True)
class RequestOwner:
    """Names the server's files `cmpl-regen-<capture_key>-<session>-<actor>-<n>-...` (vLLM prefixes `cmpl-` and
    appends its own suffix to the request id): unique across captures, sessions and actors without that suffix."""

    capture_key: str  # the same for every session of one capture on one host (capture_worker.request_owner_key)
    session: str  # one driver's session; no "-" in it
    actor: str = "a"  # the actor's tag (a restarted actor has another); no "-" in it

    def request_id(self, n: int) -> str:
        return f"regen-{self.capture_key}-{self.session}-{self.actor}-{n}"

    def left_by_an_earlier_session(self, name: str) -> bool:
        prefix = f"cmpl-regen-{self.capture_key}-"
        return name.startswith(prefix) and not name[len(prefix):].startswith(f"{self.session}-")


def is_file_of_request(name: str, request_id: str) -> bool:
    """vLLM names the file `{req_id}.safetensors`: req_id is `cmpl-<X-Request-Id>-<choice index>` (the completion
    server) then `-<8 random hex>` (the engine's input processor, to keep internal ids unique)."""
    prefix, suffix = f"cmpl-{request_id}-", ".safetensors"
    middle = name[len(prefix):-len(suffix)] if name.startswith(prefix) and name.endswith(suffix) else ""
    return bool(middle) and "/" not in middle


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
        self.expected_layer_ids = [*self.layout.aux_layer_ids, self.layout.num_layers]
        self.folder = Path(os.path.normpath(self.opts.hidden_states_dir)) if self.opts.hidden_states_dir else None
        self.server: dict | None = None  # the first file's metadata: every later file must say the same
        self.abandoned: set[Path] = set()  # files not yet written when their request gave up (removed later)
        self.guard = threading.Lock()
        self.pool: ThreadPoolExecutor | None = None
        self.model = self._served_model()
        self.norm_weight, self.eps = _final_norm(cfg.model)

    # --- the server -------------------------------------------------------------------------------------------
    def _request(self, path: str, body: dict | None = None, request_id: str | None = None) -> dict:
        """One HTTP call; every failure leaves as a class of the error taxonomy."""
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.key}"} if self.key else {}),
                   **({"X-Request-Id": request_id} if request_id else {})}
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.opts.timeout_s) as answer:
                payload = answer.read()
        except urllib.error.HTTPError as exc:
            error = classify(exc.code, error_message(parse_body(exc.read()), f"{path} answered {exc.code}"),
                             self.url)
            if isinstance(error, TerminalForPrompt):  # this sample only (e.g. past the server's context)
                error = CaptureSampleError(f"{self.url} refused the sample: {error.message}", status=exc.code,
                                           endpoint=self.url)
            raise error from None
        except (TimeoutError, urllib.error.URLError, http.client.HTTPException, OSError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            if isinstance(reason, TimeoutError):
                raise Retryable(f"{self.url}{path}: no answer within {self.opts.timeout_s:.0f}s",
                                endpoint=self.url) from None
            raise classify(None, f"{self.url}{path}: connection failed: {reason or type(reason).__name__}",
                           self.url, dropped=was_dropped(exc)) from None
        try:
            return json.loads(payload)
        except ValueError as exc:
            raise unexpected(exc, self.url) from None

    def _served_model(self) -> str:
        """The model name requests use; the server's model (`root`) must be the capture's."""
        served = self._request("/v1/models").get("data") or []
        entry = next((m for m in served if not self.opts.model or m.get("id") == self.opts.model), None)
        if entry is None:
            raise ContractError(f"{self.url} serves {[m.get('id') for m in served]}, not vllm.model "
                                f"{self.opts.model!r}", endpoint=self.url)
        root = entry.get("root")
        if root and not self._same_model(root):
            raise ContractError(f"{self.url} serves {root} (/v1/models root), the capture expects {self.cfg.model}"
                                f"{self._server_model_hint()}", endpoint=self.url)
        return entry["id"]

    def _same_model(self, name: str) -> bool:
        if self.opts.server_model:
            return name == self.opts.server_model
        return Path(name.rstrip("/")).name == Path(normalised_model(self.cfg.model)).name

    def _server_model_hint(self) -> str:
        return "" if self.opts.server_model else " (a model of another name: set vllm.server_model to the name " \
                                                 "the server runs it under)"

    # --- one sample -------------------------------------------------------------------------------------------
    def capture(self, token_ids: list[int]) -> np.ndarray:
        """[T, len(layout.states), H] float32 for the ids; raises the taxonomy's classes (module docstring)."""
        self._remove_abandoned()
        request_id = self.owner.request_id(next(self.requests))
        answer = self._request("/v1/completions", {"model": self.model, "prompt": list(token_ids), "max_tokens": 1,
                                                   "temperature": 0.0, "return_token_ids": True}, request_id)
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise ContractError(f"{self.url} returned no kv_transfer_params.hidden_states_path: start vLLM with "
                                "--speculative-config method=extract_hidden_states and regen's hidden-states KV "
                                "connector", endpoint=self.url)
        file = self._own_file(path, request_id)  # a path not ours is refused before anything is deleted
        try:
            self._wait_unlocked(file)
            tensors, metadata = self._load(file)
        finally:
            self._remove(file)
            self._remove_earlier_sessions_files(file.parent)
        self._check_server(metadata, file)
        return self._states(tensors, token_ids, file)

    def capture_many(self, samples: list[list[int]]) -> list[np.ndarray | Exception]:
        """Each sample's states or the exception it raised, in order, up to `vllm.concurrency` requests in flight."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.opts.concurrency, thread_name_prefix="regen-vllm-capture")
        return list(self.pool.map(self._capture_or_error, samples))

    def _capture_or_error(self, token_ids: list[int]) -> np.ndarray | Exception:
        try:
            return self.capture(token_ids)
        except Exception as exc:  # handed back, in order, to the caller that decides
            return exc

    def _own_file(self, path: str, request_id: str) -> Path:
        file = Path(os.path.normpath(path))
        with self.guard:
            folder = self.folder or file.parent
            if file.is_absolute() and file.parent == folder and is_file_of_request(file.name, request_id):
                self.folder = folder
                return file
        raise ContractError(f"{self.url} named {path} for request {request_id}: not a file "
                            f"cmpl-{request_id}-<...>.safetensors in the server's folder {folder} (nothing deleted)",
                            endpoint=self.url)

    def _wait_unlocked(self, file: Path) -> None:
        """The connector creates `<path>.lock` (exclusive flock) before answering and releases it once written."""
        lock = Path(f"{file}.lock")
        visible_by = time.monotonic() + self.opts.visible_timeout_s
        while not file.exists() and not lock.exists():
            if not file.parent.is_dir() or time.monotonic() > visible_by:
                raise ContractError(
                    f"{self.url} wrote {file.name} into {file.parent}, which this host "
                    f"{'does not have' if not file.parent.is_dir() else 'has, but without the file'}: the "
                    "server's hidden-states folder (its connector's shared_storage_path) must be shared with the "
                    "capture actors, at the same path", endpoint=self.url)
            time.sleep(0.02)
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            return  # no lock (use_synchronization_lock false): the file is there
        try:
            locked_by = time.monotonic() + self.opts.lock_timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    return
                except BlockingIOError:
                    if time.monotonic() > locked_by:
                        raise Retryable(f"{self.url}: {file} still locked after {self.opts.lock_timeout_s:.0f}s "
                                        "(the server has not finished writing it)", endpoint=self.url) from None
                    time.sleep(0.02)
        finally:
            os.close(fd)

    def _load(self, file: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(file), framework="numpy") as f:
                return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
        except FileNotFoundError:
            raise Retryable(f"{self.url}: released the lock of {file} without writing it", endpoint=self.url) \
                from None
        except SafetensorError as exc:
            raise unexpected(exc, self.url) from None

    def _check_server(self, metadata: dict[str, str], file: Path) -> None:
        """The server's own account of what it is (regen's connector), against the capture's layout and model."""
        raw = metadata.get(METADATA_KEY)
        if raw is None:
            if self.opts.accept_unverified_files:
                return
            raise ContractError(f"{self.url}: {file.name} carries no regen metadata, so the server's layer ids and "
                                "model cannot be checked: load regen's connector (kv_connector "
                                "CpuHiddenStatesConnector, kv_connector_module_path regen_hidden_states_connector) "
                                "or set vllm.accept_unverified_files: true", endpoint=self.url)
        try:
            server = json.loads(raw)
        except ValueError:
            server = None
        if not isinstance(server, dict):
            raise ContractError(f"{self.url}: {file.name}'s {METADATA_KEY} metadata is not a JSON object "
                                f"({raw[:80]!r}): the server's connector is not regen's, or another version of it", endpoint=self.url)
        with self.guard:
            if self.server is not None:
                if server != self.server:
                    raise ContractError(f"{self.url} changed under the capture: {self.server} then {server}",
                                        endpoint=self.url)
                return
            expected = {"layer_ids": self.expected_layer_ids, "hidden_size": self.layout.hidden_size,
                        "num_hidden_layers": self.layout.num_layers}
            diff = [f"{key} {server.get(key)} (capture expects {want})" for key, want in expected.items()
                    if server.get(key) != want]
            if not self._same_model(str(server.get("model"))):
                diff.append(f"model {server.get('model')} (capture expects {self.cfg.model}"
                            f"{self._server_model_hint()})")
            if diff:
                raise ContractError(f"{self.url} serves {server.get('model')}, not what the capture expects: "
                                    + "; ".join(diff), endpoint=self.url)
            self.server = server

    def _states(self, tensors: dict[str, np.ndarray], token_ids: list[int], file: Path) -> np.ndarray:
        if "hidden_states" not in tensors or "token_ids" not in tensors:
            raise ContractError(f"{self.url}: {file.name} holds {sorted(tensors)}, not hidden_states and token_ids",
                                endpoint=self.url)
        states, ids = tensors["hidden_states"].astype(np.float32), tensors["token_ids"]
        want = (len(token_ids), len(self.expected_layer_ids), self.layout.hidden_size)
        if states.shape != want or ids.tolist() != list(token_ids):
            raise ContractError(f"{self.url}: {file.name} holds states {list(states.shape)} for {ids.shape[0]} ids"
                                f"{'' if ids.tolist() == list(token_ids) else ' (not the ids sent)'}; the capture "
                                f"expects {list(want)}: [T, 4, H], layer ids {self.expected_layer_ids}, "
                                f"H = {self.layout.hidden_size}", endpoint=self.url)
        pre = states[:, 3]
        post = pre / np.sqrt(np.mean(pre.astype(np.float64) ** 2, axis=-1, keepdims=True) + self.eps) * self.norm_weight
        by_kind = {AUX: iter(states[:, k] for k in range(3)), FINAL_POST_NORM: iter([post]), LAST_PRE_NORM: iter([pre])}
        return np.stack([next(by_kind[s.kind]) for s in self.layout.states], axis=1).astype(np.float32)

    # --- the server's files -----------------------------------------------------------------------------------
    def _remove(self, file: Path) -> None:
        """This request's file and lock; a file not yet written (its wait gave up) is removed once it appears."""
        existed = file.exists()
        for leftover in (file, Path(f"{file}.lock")):
            leftover.unlink(missing_ok=True)
        if not existed:
            with self.guard:
                self.abandoned.add(file)

    def _remove_abandoned(self) -> None:
        with self.guard:
            for file in [f for f in self.abandoned if f.exists()]:
                file.unlink(missing_ok=True)
                Path(f"{file}.lock").unlink(missing_ok=True)
                self.abandoned.discard(file)

    def _remove_earlier_sessions_files(self, folder: Path) -> None:
        for file in folder.glob(f"cmpl-regen-{self.owner.capture_key}-*"):
            if self.owner.left_by_an_earlier_session(file.name):
                file.unlink(missing_ok=True)


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
