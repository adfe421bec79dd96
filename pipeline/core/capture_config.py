"""capture.yaml: the config of `regen capture RUN` (strict, like the run config)."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .config import RayOptions, _Strict
from .yaml_model import load_yaml_model


class VllmCapture(_Strict):
    """Route `vllm`: a vLLM server started with `--speculative-config method=extract_hidden_states` and a
    hidden-states KV connector (kv_role kv_producer) whose `shared_storage_path` this host can read."""

    url: str = Field(description="The vLLM server's root URL.")
    model: str | None = Field(None, description="The served model name (None: the first of /v1/models).")
    api_key_env: str | None = Field(None, description="Name of an environment variable holding the server's API key.")
    timeout_s: float = Field(600.0, gt=0.0, description="Deadline of one request; past it the server is down.")
    lock_timeout_s: float = Field(120.0, gt=0.0, description=(
        "How long to wait for the server to finish writing a states file (its `.lock`)."))
    visible_timeout_s: float = Field(5.0, gt=0.0, description=(
        "The server pre-creates each file's `.lock` before it answers: a path still invisible after this long is in "
        "a folder this host does not share with the server (a ContractError)."))
    concurrency: int = Field(4, ge=1, le=256, description="Requests in flight per actor.")
    hidden_states_dir: str | None = Field(None, description=(
        "The connector's shared_storage_path as the server names it (None: the folder of its first answer, then "
        "held): a path elsewhere is refused and never deleted."))
    server_model: str | None = Field(None, description=(
        "The server's model_config.model / `/v1/models` root (None: a path or hub id whose last component is the "
        "capture model folder's name)."))
    accept_unverified_files: bool = Field(False, description=(
        "Accept files without regen's connector metadata (vLLM's own connector): then only their shape and width "
        "are checked, not the server's layer ids or model."))


class CaptureConfig(_Strict):
    route: Literal["transformers", "vllm"] = Field(description=(
        "`transformers`: the model in the actor's process (CPU or its GPU); `vllm`: a vLLM server that writes the "
        "states to files (the `vllm:` section)."))
    model: str = Field(description=(
        "The model the states come from: a local HF folder (or hub id). Route vllm reads only its config.json and "
        "the final norm's weight from it (the server reports no layer count)."))
    aux_layer_ids: list[int] | None = Field(None, min_length=3, max_length=3, description=(
        "EAGLE-3 auxiliary layers in vLLM/speculators ids (input of layer i), distinct; default [2, L//2, L-3] "
        "([1, L//2, L-1] at 6 layers or fewer, where that repeats a layer)."))
    dtype: Literal["bf16"] = Field("bf16", description="The stored dtype of the states.")
    weights_identity: Literal["sampled", "full"] = Field("sampled", description=(
        "The weight files in the model identity: `sampled` (each file's safetensors header and 16 evenly spaced "
        "64 KiB windows, cheap at any size) or `full` (every byte: slow on a large model). Changing it is drift."))
    torch_dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description=(
        "Route transformers: the compute dtype (the states are stored as bf16 either way)."))
    actors: int = Field(1, ge=1, le=1024, description="Capture actors (each loads the model, for route transformers).")
    actor_num_cpus: float = Field(1.0, ge=0.0, description="CPUs Ray reserves for each capture actor.")
    actor_num_gpus: float = Field(0.0, ge=0.0, description="GPUs Ray reserves for each capture actor.")
    torch_threads: int | None = Field(None, ge=1, description=(
        "Route transformers: torch threads per actor (None: torch's default)."))
    prompts_per_call: int = Field(4, ge=1, description="Prompts (all their samples) an actor takes per call.")
    down_deadline_s: float = Field(300.0, gt=0.0, description=(
        "A route whose server has not answered at all (EndpointDown: refused, reset before an answer) for this long "
        "stops the pass (resumable)."))
    max_consecutive_failures: int = Field(8, ge=1, description=(
        "This many prompts failing alone in a row, none captured between, stop the pass: the route is broken."))
    max_solo_crashes: int = Field(2, ge=1, description=(
        "Deaths of the actor running a prompt alone before the prompt fails."))
    max_prompt_retries: int = Field(3, ge=1, description=(
        "Any other retryable error (a timeout, a lock held, a dropped connection, an unreadable file) a prompt gets "
        "running alone this many times fails it, named, with the last error."))
    flush_records: int = Field(64, ge=1, description="Samples buffered before a ledger part is committed.")
    flush_interval_s: float = Field(10.0, gt=0.0, description="Commit the buffered samples at least this often.")
    follow: bool = Field(False, description=(
        "Keep capturing what generation commits until its run is no longer locked (a live run); else one pass."))
    poll_interval_s: float = Field(5.0, gt=0.0, description="With follow: how often to look for newly committed parts.")
    vllm: VllmCapture | None = Field(None, description="Route vllm: the server (the `vllm:` section).")
    ray: RayOptions = Field(RayOptions(), description="The Ray cluster (as in the run config).")

    @field_validator("aux_layer_ids")
    @classmethod
    def _distinct(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and len(set(ids)) != len(ids):
            raise ValueError(f"{ids} repeats a layer: EAGLE-3 needs 3 distinct layer ids")
        return ids

    @model_validator(mode="after")
    def _route_section(self) -> "CaptureConfig":
        if self.route == "vllm" and self.vllm is None:
            raise ValueError("route vllm needs a `vllm:` section (url of the server)")
        return self


def load_capture_config(path: str | Path) -> CaptureConfig:
    return load_yaml_model(path, CaptureConfig, "capture config")
