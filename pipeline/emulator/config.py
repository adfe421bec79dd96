"""Emulator settings: the `EmulatorConfig` dataclass, presets and the argparse front end.

Every option of `python -m pipeline.emulator` is a field of `EmulatorConfig`. The run-time fault settings are the
fields listed in `FAULT_FIELDS`; `POST /admin/faults` may change them (plus a few identity fields that model a
misconfigured server: served model name, context length, and the decode speed of a slowed one).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from .versions import Behaviour, behaviour, version_tuple  # noqa: F401 - version_tuple: re-exported

DEFAULT_MODEL = "moonshotai/Kimi-K2.5"

# Fault settings that /admin/faults may change at run time.
FAULT_FIELDS = (
    "fault_500", "fault_503", "fault_429", "fault_400",
    "fault_hang", "fault_reset", "fault_abort",
    "slow_stream_s", "health_ok_while_hung", "health_503",
    "served_model_name", "context_length", "fault_seed", "fault_weight_switch", "tok_per_s",
)
# The error/behaviour draws, in the order they are tested against one uniform draw per request.
RATE_FIELDS = ("fault_500", "fault_503", "fault_429", "fault_400", "fault_hang", "fault_reset", "fault_abort",
               "fault_weight_switch")

PRESETS: dict[str, dict[str, Any]] = {
    # Kimi-K2.5 as launched in production: kimi_k2 reasoning and tool parsers; it reads images (image_url parts).
    "kimi": {"reasoning_parser": "kimi_k2", "tool_call_parser": "kimi_k2", "image_understanding": True},
    # ... with an EAGLE-3 draft (speculative decoding: accept length in meta_info and /metrics).
    "kimi-eagle3": {"reasoning_parser": "kimi_k2", "tool_call_parser": "kimi_k2", "speculative_algorithm": "EAGLE3",
                    "image_understanding": True},
    # Kimi-K2.5 with a throughput curve: steps grow past the knee, a KV pool, retraction, metrics on.
    "kimi-curve": {"reasoning_parser": "kimi_k2", "tool_call_parser": "kimi_k2", "image_understanding": True,
                   "throughput_curve": True, "enable_metrics": True},
    # A text-only model: a media part is refused (0.5.17+) or ignored (0.5.14).
    "plain": {},
}


@dataclass
class EmulatorConfig:
    # --- identity ----------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = 30000
    model_path: str = DEFAULT_MODEL
    served_model_name: str | None = None          # None: same as model_path
    weight_version: str = "default"
    sglang_version: str = "0.5.23"
    preset: str | None = None
    # --- model shape -------------------------------------------------------------------------
    context_length: int = 262144
    num_layers: int = 61
    reasoning_parser: str | None = None           # "kimi_k2" splits reasoning at </think>
    tool_call_parser: str | None = None           # "kimi_k2" cuts Kimi's calls out of content into tool_calls
    tp_size: int = 8
    image_understanding: bool = False             # a vision model (Kimi-K2.5's processor); else text-only
    # --- features ----------------------------------------------------------------------------
    speculative_algorithm: str | None = None      # "EAGLE3", "EAGLE", ...
    enable_deterministic_inference: bool = False  # without it SGLang ignores seed / sampling_seed
    speculative_num_steps: int = 3
    accept_length: float = 3.2
    enable_metrics: bool = False
    enable_cache_report: bool = False
    disable_radix_cache: bool = False
    chunked_prefill_size: int = 8192              # reported only
    cache_max_tokens: int = 262_144               # prefix-cache capacity (token prefixes, LRU)
    max_total_num_tokens: int = 1_048_576
    default_max_tokens: int = 512                 # natural answer budget when a chat request has no max_tokens
    unknown_model_status: int = 400  # what SGLang answers (its own tests show 400)
    # --- speed and capacity ------------------------------------------------------------------
    tok_per_s: float = 0.0                        # per-request decode speed; 0 = instant
    prefill_tok_per_s: float = 0.0                # 0 = instant
    capacity: int = 256                           # running requests; <= 0: unlimited
    max_queue: int = -1                           # waiting requests; < 0: unlimited
    queue_timeout: float | None = None            # seconds in the queue before 503
    startup_delay: float = 0.0                    # /health answers 503 this long after start
    health_check_timeout: float = 5.0             # /health_generate gives up (503) after this
    keepalive_timeout: float = 5.0
    # --- the throughput curve (batch.py): off, each request decodes at tok_per_s whatever the batch ----------
    throughput_curve: bool = False                # one batch: step(B) = step_ms * max(1, B/knee), a KV pool
    step_ms: float = 30.0                         # decode step of a small (memory-bound) batch, in ms
    knee: int = 64                                # batch size where the step turns compute-bound
    decode_log_interval: int = 40                 # the gauges (/metrics) refresh every this many steps
    # --- faults ------------------------------------------------------------------------------
    fault_seed: int = 0
    fault_500: float = 0.0
    fault_503: float = 0.0
    fault_429: float = 0.0
    fault_400: float = 0.0
    fault_hang: float = 0.0
    fault_reset: float = 0.0
    fault_abort: float = 0.0
    fault_weight_switch: float = 0.0              # 0.5.23: the weights change mid-answer (two weight_versions spans)
    slow_stream_s: float = 0.0                    # extra delay between SSE chunks
    health_ok_while_hung: bool = False            # every generation hangs, /health still 200
    health_503: bool = False                      # /health and /health_generate answer 503
    # A poison prompt: a generation request whose text contains `poison_text` always gets `poison_fault`
    # (500, 503, 429, 400, hang, reset, abort), or only the first `poison_times` such requests (0: every one).
    poison_text: str | None = None
    poison_fault: str = "reset"
    poison_times: int = 0
    # --- logging -----------------------------------------------------------------------------
    request_log: str | None = None
    request_log_bodies: bool = False              # each log line also holds the whole request body
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if self.served_model_name is None:
            self.served_model_name = self.model_path

    # -- derived --------------------------------------------------------------------------------
    @property
    def behaviour(self) -> Behaviour:
        return behaviour(self.sglang_version)

    @property
    def thinking_parser(self) -> bool:
        return self.reasoning_parser in ("kimi_k2", "kimi", "deepseek-r1", "qwen3")

    @property
    def is_speculative(self) -> bool:
        return bool(self.speculative_algorithm)

    def faults(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in FAULT_FIELDS}

    def server_args(self) -> dict[str, Any]:
        """What /get_server_info reports, named like SGLang's ServerArgs."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "served_model_name": self.served_model_name,
            "host": self.host,
            "port": self.port,
            "trust_remote_code": True,
            "context_length": self.context_length,
            "tp_size": self.tp_size,
            "dp_size": 1,
            "pp_size": 1,
            "ep_size": 1,
            "max_running_requests": self.capacity if self.capacity > 0 else None,
            "max_queued_requests": self.max_queue if self.max_queue >= 0 else None,
            "max_total_tokens": self.max_total_num_tokens,
            "chunked_prefill_size": self.chunked_prefill_size,
            "disable_radix_cache": self.disable_radix_cache,
            "page_size": 1,
            "speculative_algorithm": self.speculative_algorithm if self.is_speculative else None,
            "speculative_num_steps": self.speculative_num_steps if self.is_speculative else None,
            "speculative_eagle_topk": 1 if self.is_speculative else None,
            "speculative_num_draft_tokens": self.speculative_num_steps + 1 if self.is_speculative else None,
            "enable_deterministic_inference": self.enable_deterministic_inference,
            "reasoning_parser": self.reasoning_parser,
            "tool_call_parser": self.tool_call_parser,
            "enable_metrics": self.enable_metrics,
            "enable_cache_report": self.enable_cache_report,
            "weight_version": self.weight_version,
            "stream_interval": 1,
            "skip_tokenizer_init": False,
            "random_seed": self.fault_seed,
        }


def output_ids_field(sglang_version: str) -> str | None:
    """Where the chat route puts the output ids asked for with return_token_ids, as SGLang's own
    ChatCompletionResponseChoice has it: `response_token_ids` from 0.5.18, `token_ids` in 0.5.17; before
    0.5.17 there is no return_token_ids (the field is ignored, like any unknown field)."""
    return behaviour(sglang_version).output_ids_field


def _bool_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(EmulatorConfig) if f.type in ("bool", bool)}


# (field, type, help) for each CLI option; the flag is --field-with-dashes.
_OPTIONS: list[tuple[str, Any, str]] = [
    ("host", str, "bind address"),
    ("port", int, "port (0 picks a free one)"),
    ("model_path", str, "model path reported by the info endpoints"),
    ("served_model_name", str, "model name requests must use and responses report (default: model path)"),
    ("weight_version", str, "weight version in metadata/meta_info"),
    ("sglang_version", str, "the SGLang version to behave as (0.5.14, 0.5.17, 0.5.18, 0.5.23): field names, "
                            "flags and checks follow it"),
    ("context_length", int, "context length in tokens"),
    ("num_layers", int, "number of layers reported"),
    ("reasoning_parser", str, "reasoning parser (kimi_k2 splits at </think>)"),
    ("tool_call_parser", str, "tool-call parser (kimi_k2 returns Kimi's calls in tool_calls; other names and none "
                              "leave them in content, as SGLang does)"),
    ("tp_size", int, "tensor parallel size (reported only)"),
    ("image_understanding", bool, "read image_url parts as SGLang's Kimi-K2.5 processor does (the kimi presets); "
                                  "without it the model is text-only"),
    ("speculative_algorithm", str, "speculative algorithm (EAGLE3, EAGLE, ...)"),
    ("enable_deterministic_inference", bool, "report --enable-deterministic-inference (seeds then reproduce)"),
    ("speculative_num_steps", int, "draft steps (spec_accept_rate = (accept_length-1)/steps)"),
    ("accept_length", float, "mean speculative accept length"),
    ("enable_metrics", bool, "serve Prometheus /metrics"),
    ("enable_cache_report", bool, "report usage.prompt_tokens_details.cached_tokens"),
    ("disable_radix_cache", bool, "no prefix cache (no cached_tokens)"),
    ("chunked_prefill_size", int, "prefill chunk size (reported only)"),
    ("cache_max_tokens", int, "prefix cache capacity in token prefixes"),
    ("max_total_num_tokens", int, "KV pool size reported (token_usage denominator)"),
    ("default_max_tokens", int, "natural answer budget when max_tokens is absent"),
    ("unknown_model_status", int, "HTTP status for a request naming another model"),
    ("tok_per_s", float, "per-request decode speed in tokens/s (0 = instant)"),
    ("prefill_tok_per_s", float, "prefill speed in tokens/s (0 = instant)"),
    ("capacity", int, "concurrent running requests (<=0: unlimited)"),
    ("max_queue", int, "waiting requests before 503 'The request queue is full.' (<0: unlimited)"),
    ("queue_timeout", float, "seconds a request may wait before 503 'Request waiting timeout reached.'"),
    ("throughput_curve", bool, "one continuous batch: the decode step grows past --knee, admission is bounded by "
                               "the KV pool (--max-total-num-tokens) and a full pool retracts requests (batch.py)"),
    ("step_ms", float, "with --throughput-curve: ms of a decode step while the batch is small"),
    ("knee", int, "with --throughput-curve: the batch size past which a step grows linearly"),
    ("decode_log_interval", int, "with --throughput-curve: steps between refreshes of the /metrics gauges"),
    ("startup_delay", float, "/health answers 503 for this many seconds after start"),
    ("health_check_timeout", float, "/health_generate gives up after this many seconds"),
    ("keepalive_timeout", float, "HTTP keep-alive timeout (SGLang: 5 s)"),
    ("fault_seed", int, "seed of the fault draws (one draw per generation request)"),
    ("fault_500", float, "rate of 500 answers (mid-stream error event for streams)"),
    ("fault_503", float, "rate of 503 answers"),
    ("fault_429", float, "rate of 429 answers"),
    ("fault_400", float, "rate of 400 answers (mid-stream error event for streams)"),
    ("fault_hang", float, "rate of requests that never answer"),
    ("fault_reset", float, "rate of connections closed mid-body"),
    ("fault_abort", float, "rate of 200 answers with finish_reason abort"),
    ("fault_weight_switch", float, "rate of answers whose weights changed mid-answer (0.5.23: two spans)"),
    ("slow_stream_s", float, "delay between SSE chunks in seconds"),
    ("health_ok_while_hung", bool, "every generation hangs while /health stays 200"),
    ("health_503", bool, "/health and /health_generate answer 503"),
    ("poison_text", str, "a generation request containing this text gets --poison-fault (a poison prompt)"),
    ("poison_fault", str, "what a poison prompt gets: 500, 503, 429, 400, hang, reset or abort"),
    ("poison_times", int, "only the first N poison requests get the fault (0: every one)"),
    ("request_log", str, "append one JSON line per generation request to this file"),
    ("request_log_bodies", bool, "log each request's whole body too (the conformance test checks them)"),
    ("log_level", str, "logging level"),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="regen emulate",  # also `python -m pipeline.emulator`: the same options
        description="SGLang-faithful emulated server (deterministic answers, fault injection).",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="option bundle: kimi (kimi_k2 parsers, images), kimi-eagle3 (+ an EAGLE3 draft), kimi-curve (+ the "
                        "throughput curve and /metrics), plain (text-only)")
    for name, typ, help_ in _OPTIONS:
        flag = "--" + name.replace("_", "-")
        if typ is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            p.add_argument(flag, dest=name, type=typ, default=None, help=help_)
    # Not a setting of the emulated server: how it is run (regen's local fleet, `engine: emulator`).
    p.add_argument("--lifeline-fd", type=int, default=None,
                   help="stop when this pipe reaches end of file (the local fleet's driver exited)")
    # SGLang spellings accepted as aliases.
    p.add_argument("--model", dest="model_path", type=str, default=None, help=argparse.SUPPRESS)
    p.add_argument("--tp", dest="tp_size", type=int, default=None, help=argparse.SUPPRESS)
    return p


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    values: dict[str, Any] = {}
    if args.preset:
        values.update(PRESETS[args.preset])
        values["preset"] = args.preset
    for name, _typ, _h in _OPTIONS:
        v = getattr(args, name, None)
        if v is not None:
            values[name] = v
    return make_config(**values)


def make_config(**options: Any) -> EmulatorConfig:
    """EmulatorConfig from keyword options; `preset=` is applied first, explicit options win."""
    preset = options.get("preset")
    values: dict[str, Any] = {}
    if preset:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
        values.update(PRESETS[preset])
    values.update(options)
    for k in ("reasoning_parser", "tool_call_parser", "speculative_algorithm", "request_log", "poison_text"):
        if isinstance(values.get(k), str) and values[k].lower() in ("", "none", "null"):
            values[k] = None            # lets the CLI undo a preset: --reasoning-parser none
    known = {f.name for f in dataclasses.fields(EmulatorConfig)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown emulator options: {sorted(unknown)}")
    return EmulatorConfig(**values)


def options_to_argv(options: dict[str, Any]) -> list[str]:
    """Keyword options -> CLI flags (inverse of the parser), for subprocess launches."""
    argv: list[str] = []
    bools = _bool_fields()
    for key, value in options.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if key in bools or isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    return argv


__all__ = ["EmulatorConfig", "FAULT_FIELDS", "RATE_FIELDS", "PRESETS", "build_parser", "config_from_args",
           "make_config", "options_to_argv", "DEFAULT_MODEL"]
