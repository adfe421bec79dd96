"""The run config: strict YAML, validated, plus the fingerprint of what shapes the data.

Every section rejects unknown keys, so a typo such as `concurency:` is an error naming the key and the file.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from .errors import ConfigError, SecretMissing
from .paths import check_config_paths, resolve_config_paths, resolve_tokenizer
from .identity import current_identity, flat_diff, identity_fingerprint  # noqa: F401 (flat_diff: its readers)
from .uri import check_uri
from .yaml_model import load_yaml_model


from .config_sections import (  # noqa: F401 (the sections are part of this module's interface)
    RETIRED_HIDDEN_STATES, Endpoint, Images, LocalFleet, MetricsServer, QualityThresholds, RayOptions, Sampling,
    SourceRef, _Strict,
)


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
    samples_per_prompt: int = Field(1, ge=1, le=1000, description=(
        "k: draw k completions of each prompt (all_turns: conversations), each a unit of work of its own. Sample 0 "
        "keeps the prompt's id and seed; sample j > 0 is exported as `<id>#s<j>`, seeded from a hash of the prompt "
        "and j. Needs temperature > 0 (and top_k not 1, min_p below 1). In the run identity only when not 1; "
        "raising it on a run needs `regen generate --add-samples`, lowering it is refused (docs/samples.md)."))
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
    tool_result_match: Literal["name", "arguments"] = Field(
        "name",
        description="all_turns with tools: when a cached tool result of the source answers a call of the target. "
                    "name: the calls name the same tools in the same order (speculators' rule); a result spliced "
                    "into a call whose arguments differ from the source's is flagged (`spliced_other_arguments` on "
                    "the records whose history holds it) and counted. arguments: the canonical JSON arguments must "
                    "match too, else the conversation ends there (`conversation_end` other_arguments). Parallel "
                    "calls are matched call by call. In the run identity only when not name (docs/tool-calls.md)")
    sampling: Sampling = Field(Sampling(), description="Sampling parameters (the `sampling:` section).")
    selection_seed: int = Field(0, description=(
        "Seed of the per-source `limit` selection (the prompts of lowest sha256(seed:prompt_id) are kept)."))
    images: Images = Field(Images(), description="Image prompts (the `images:` section).")
    sources: list[SourceRef] = Field(min_length=1, description=(
        "The sources, in order (an exact duplicate prompt is kept by the first source that has it)."))
    endpoints: list[Endpoint] = Field(default_factory=list, description="The endpoints of the fleet.")
    endpoints_file: str | None = Field(None, description=(
        "A file of endpoints (`URL [concurrency]` a line, `#` comments), re-read during the run: new endpoints join "
        "after passing the preflight, removed ones drain. A relative path resolves against the config file's "
        "folder."))
    endpoints_file_interval_s: float = Field(10.0, gt=0.0, description=(
        "How often the endpoints file is re-read; a change applies once two reads in a row agree."))
    endpoints_file_concurrency: int | Literal["auto"] = Field(64, description=(
        "Concurrency of an endpoints-file line that gives none (a number, or `auto`: see the endpoints' "
        "`concurrency`)."))
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

    @model_validator(mode="after")
    def _samples_differ(self) -> "RunConfig":
        self.sampling.check_samples_differ(self.samples_per_prompt)
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
            **({"tool_result_match": self.tool_result_match} if self.tool_result_match != "name" else {}),
            **({"samples_per_prompt": self.samples_per_prompt} if self.samples_per_prompt != 1 else {}),
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
            # the images keys that select or shape the set, only those not at their default (Images.identity)
            **({"images": images} if (images := self.images.identity(self.max_prompt_tokens)) else {}),
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


def read_endpoints_file(path: str | Path, concurrency: int | str, api_key_env: str | None = None) -> list[Endpoint]:
    """`URL [concurrency]` per line (a number or `auto`); blank lines and `#` comments are skipped. Errors name the line."""
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
            given = fields[1] if len(fields) == 2 else concurrency
            endpoints.append(Endpoint(url=fields[0], concurrency=given if given == "auto" else int(given),
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
