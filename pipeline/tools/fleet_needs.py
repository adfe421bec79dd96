"""`make generate`'s first step: the make targets the config's local fleet needs installed, one a line.

    python -m pipeline.tools.fleet_needs CONFIG     # prints `vllm` for a local_fleet of engine vllm on the defaults,
                                                    # `vlm` for the tiny Kimi-K2.5 not built yet

A local fleet of engine vllm that names neither `vllm_python` nor `model_path` (nor REGEN_VLLM_PYTHON,
REGEN_VLLM_MODEL) runs on what `make vllm` installs: vLLM's CPU build in its cached venv and SmolLM2 as an HF
folder. `make generate` installs it first, as `make bench` does; anything else (llama.cpp, remote endpoints) needs
only `make setup`. A config that cannot be read prints nothing: `regen generate` then says what is wrong.
"""
from __future__ import annotations

import os
import sys

TINY_VLM = "tiny-kimi-k25"  # the folder `make vlm` writes under the models cache (Makefile TINY_VLM)


def needs(config: str) -> list[str]:
    from ..core.config import load_config
    from ..core.errors import ConfigError

    try:
        fleet = load_config(config).local_fleet
    except ConfigError:
        return []
    if fleet is None or fleet.engine != "vllm":
        return []
    own_python = fleet.vllm_python or os.environ.get("REGEN_VLLM_PYTHON")
    own_model = fleet.model_path or os.environ.get("REGEN_VLLM_MODEL")
    if fleet.model_path and os.path.basename(os.path.normpath(fleet.model_path)) == TINY_VLM \
            and not os.path.exists(os.path.join(fleet.model_path, ".complete")):
        return ["vlm"]  # the tiny Kimi-K2.5 `make vlm` builds (configs/local_vlm.yaml), with vLLM itself
    return [] if own_python and own_model else ["vllm"]


if __name__ == "__main__":
    print("\n".join(needs(sys.argv[1])))
