"""The capture actor: builds its route once (the model, or the vLLM client), then turns batches of prompts into
committed hidden parts. One hidden part per call, committed before the call returns the ledger rows that name it
(the driver commits those): a kill in between leaves an unreferenced part, removed on the next start."""
from __future__ import annotations

import hashlib
import itertools
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from ..core.errors import ConfigError, ContractError, DriftError, EndpointFatal, Retryable, RunFatal
from ..hidden.bf16 import f32_to_bf16
from ..hidden.layout import layout_shape
from ..hidden.errors import CaptureSampleError
from ..hidden.parts import HiddenPartWriter
from ..hidden.build import build_route
from ..hidden.vllm_route import RequestOwner


# passed through to the pool as they are: it stops the pass (config, drift, contract, storage) or retries (down)
ROUTE_FATAL = (ConfigError, DriftError, EndpointFatal, Retryable, RunFatal, ImportError, MemoryError)


@dataclass(frozen=True)
class Sample:
    """One capture sample: an exported record (or turn) with its exact token ids."""

    prompt_id: str
    turn_index: int
    sample_id: str
    token_ids: list[int]
    n_prompt: int
    finish_reason: str | None


def request_owner_key(capture_dir: str, manifest: dict | None) -> str:
    """The key in route vllm's request ids: the same for every session of one capture on one host, another for a
    capture at the same path on another host (or a capture made again there): the driver's hostname, RUN/capture's
    location and capture.json's created_at. Computed by the driver: actors may run on other nodes."""
    created = (manifest or {}).get("created_at", "")
    return hashlib.sha1(f"{socket.gethostname()}\n{capture_dir}\n{created}".encode()).hexdigest()[:12]


class CaptureWorker:
    def __init__(self, cfg, capture_dir: str, tag: str, fingerprint: str, session: str = "s",
                 expected: dict | None = None, owner_key: str | None = None):
        self.cfg, self.capture_dir, self.tag, self.fingerprint = cfg, capture_dir, tag, fingerprint
        self.expected = expected  # capture.json as the driver read it
        self.owner = RequestOwner(owner_key or request_owner_key(capture_dir, expected), session, tag)
        self.route = None
        self.counter = itertools.count(1)

    def ready(self) -> bool:
        if self.route is None:
            self.route = build_route(self.cfg, self.owner)
            self._check_route()
        return True

    def _check_route(self) -> None:
        """The model this actor loaded is the one capture.json names: a folder replaced after the driver checked
        it (other width or layers, other weights) must not add its states to this capture."""
        if self.expected is None:
            return
        got = {**layout_shape(self.route.layout.as_dict()), "model_identity": self.route.model_identity}
        want = {**layout_shape(self.expected["layout"]), "model_identity": self.expected.get("model_identity")}
        diff = [f"{key}: {want[key]!r} (capture.json) -> {got[key]!r} (this actor's model)"
                for key in got if orjson.dumps(got[key], option=orjson.OPT_SORT_KEYS)
                != orjson.dumps(want[key], option=orjson.OPT_SORT_KEYS)]
        if diff:
            raise DriftError(self.capture_dir, diff + ["the model folder changed under a running capture"],
                             "Restore the model folder capture.json names to resume, or capture into another copy "
                             "of the run.")

    def _check_shape(self, s: Sample, states) -> None:
        layout = self.route.layout
        if tuple(states.shape[1:]) != (len(layout.states), layout.hidden_size):
            # every sample would get it: the route gives other states or another width than capture.json's
            raise ContractError(f"route {self.cfg.route}: it returned states of shape {tuple(states.shape)} for "
                                f"prompt {s.prompt_id}, the layout needs [T, {len(layout.states)}, "
                                f"{layout.hidden_size}]", endpoint=self.cfg.route)
        if states.shape[0] != len(s.token_ids):
            raise CaptureSampleError(f"prompt {s.prompt_id} (sample {s.sample_id}): the route returned "
                                     f"{states.shape[0]} rows for {len(s.token_ids)} tokens")

    def _route_states(self, chunk: list[Sample]) -> list:
        """Each sample's states, or the exception it raised: several requests in flight where the route can."""
        if hasattr(self.route, "capture_many"):
            return self.route.capture_many([s.token_ids for s in chunk])
        results: list = []
        for s in chunk:
            try:
                results.append(self.route.capture(s.token_ids))
            except Exception as exc:
                results.append(exc)
        return results

    def capture(self, prompts: list[list[Sample]]) -> list[list[dict[str, Any]]]:
        """For each prompt (all its samples), its ledger rows; the hidden part is committed first."""
        self.ready()
        writer = HiddenPartWriter(self.capture_dir, tag=self.tag, counter=self.counter)
        timings: dict[str, float] = {}
        flat = [s for samples in prompts for s in samples]
        in_flight = getattr(getattr(self.route, "opts", None), "concurrency", 1)  # route vllm: requests at once
        for start in range(0, len(flat), in_flight):  # a chunk at a time: its states are all held until stored
            chunk = flat[start:start + in_flight]
            started = time.perf_counter()
            results = self._route_states(chunk)
            in_flight_s = (time.perf_counter() - started) / len(chunk)  # each sample's share of the chunk's time
            fatal = next((r for r in results if isinstance(r, ROUTE_FATAL)), None)
            if fatal is not None:
                raise fatal  # the route cannot work at all (or the server is down): the pool decides, by class
            for s, states in zip(chunk, results):
                if isinstance(states, BaseException):  # this sample's failure: named, so the pool can fail it alone
                    raise CaptureSampleError(f"prompt {s.prompt_id} (sample {s.sample_id}): "
                                             f"{type(states).__name__}: {states}") from states
                timings[s.sample_id] = in_flight_s
                self._check_shape(s, states)
                bits, _ = f32_to_bf16(np.ascontiguousarray(states, dtype=np.float32).reshape(len(s.token_ids), -1))
                writer.add(s.prompt_id, s.turn_index, s.token_ids, s.n_prompt, bits)
        part, rows = writer.commit()
        return [[{"prompt_id": s.prompt_id, "turn_index": s.turn_index, "sample_id": s.sample_id,
                  "n_tokens": len(s.token_ids), "n_prompt": s.n_prompt, "finish_reason": s.finish_reason,
                  "hidden_part": part, "hidden_row": rows[(s.prompt_id, s.turn_index)], "actor": self.tag,
                  "capture_s": timings[s.sample_id], "capture_fingerprint": self.fingerprint}
                 for s in samples] for samples in prompts]
