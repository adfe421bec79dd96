"""Exports of the stored hidden states for the training libraries.

`export_hidden(run_dir, fmt, out_dir) -> dict` (the summary, with `notes` to print on the terminal):

- `specforge-offline`: SpecForge's offline layout (scripts/prepare_hidden_states.py), one `torch.save`
  file per sample at `rows_{g}-{g+2000}/data_{idx}.ckpt` with
      input_ids [T] int64, loss_mask [T] int64, aux_hidden_state [1, T, W] bf16
  (or hidden_state [1, T, W] when the run captured the last layer rather than the auxiliary layers).
  The last token: SGLang gives no vector for the last generated token, so the stored matrix has T - 1
  rows. The export keeps all T tokens (the last one is still the target of position T - 2), appends one
  row of zeros as the last token's hidden state, and sets loss_mask[T - 1] = 0 so that padded position
  never counts. torch is needed for this format only (imported here, lazily).
- `speculators-hidden`: `hs_{idx}.safetensors` with `hidden_states` [T - 1, k, H] bf16 (the stored
  matrix split into its k layers, not padded) and `token_ids` [T] int64. speculators' own dumps hold
  4 layers [2, L//2, L-3, L] with the last one before the final norm; this export holds what SGLang
  returned, and says so in the manifest and the returned notes.
Both write `manifest.json` (layers, norm convention, alignment, counts) last, atomically.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from ..core.errors import ConfigError
from ..hidden.parts import HiddenSample, iter_hidden
from ..store.rundir import RunDir, atomic_write
from ..store.storage import Location

FORMATS = ("specforge-offline", "speculators-hidden")
GROUP = 2000
ALIGNMENT_NOTE = ("row i of the stored matrix is the hidden state computed when token i of prompt + completion "
                  "was fed; the last generated token has no vector (T - 1 rows)")


def _run_hidden_config(rd: RunDir) -> dict[str, Any]:
    try:
        manifest = rd.read_manifest()
    except FileNotFoundError:
        return {}
    return ((manifest.get("generation") or {}).get("hidden_states")) or {}


def _kind(cfg: dict[str, Any], width: int) -> tuple[str, int]:
    """('aux', 3) for EAGLE-3 auxiliary layers, ('last', 1) for the final layer, from the run's config."""
    note = str(cfg.get("layers_note") or "").lower()
    if "aux" in note or "eagle-3" in note or "eagle3" in note:
        return "aux", 3 if width % 3 == 0 else 1
    if "last" in note or "final" in note:
        return "last", 1
    return "aux", 3 if width % 3 == 0 else 1


def _layers_and_norm(kind: str, cfg: dict[str, Any]) -> dict[str, Any]:
    if kind == "aux":
        norm = ("the auxiliary layers' outputs as SGLang captures them for EAGLE-3 (residual stream, no final norm); "
                "no final-layer state is included")
    else:
        norm = "the last layer's output after the final norm (the input to lm_head), as SGLang returns it"
    return {"kind": kind, "layers_note": cfg.get("layers_note", ""), "norm": norm}


def _torch():
    try:
        import torch
    except ImportError:
        raise ConfigError("--format specforge-offline needs torch (pip install torch; the CPU build is enough). "
                          "It is an optional extra used by this export only.") from None
    return torch


def _specforge_write(torch, sample: HiddenSample, idx: int, out_dir: Path, kind: str) -> Path:
    group = (idx // GROUP) * GROUP
    folder = out_dir / f"rows_{group}-{group + GROUP}"
    folder.mkdir(parents=True, exist_ok=True)
    T = len(sample.token_ids)
    bits = np.zeros((T, sample.width), dtype=np.uint16)  # the last token's row stays zero (padding)
    bits[:sample.n_rows] = sample.hidden.view(np.uint16)
    hidden = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).unsqueeze(0)
    loss_mask = sample.loss_mask.astype(np.int64)
    if T:
        loss_mask[T - 1] = 0
    obj = {"input_ids": torch.from_numpy(sample.token_ids.astype(np.int64)),
           "loss_mask": torch.from_numpy(loss_mask),
           ("aux_hidden_state" if kind == "aux" else "hidden_state"): hidden}
    path = folder / f"data_{idx}.ckpt"
    tmp = path.with_name(f".tmp-{path.name}")
    torch.save(obj, tmp)
    os.replace(tmp, path)
    return path


def _speculators_write(sample: HiddenSample, idx: int, out_dir: Path, n_layers: int) -> Path:
    """hs_{idx}.safetensors: bf16 through ml_dtypes and safetensors' numpy API (no torch needed)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    hs = sample.hidden.view(np.uint16).reshape(sample.n_rows, n_layers, sample.width // n_layers)
    tensors = {"hidden_states": np.ascontiguousarray(hs).view(ml_dtypes.bfloat16),
               "token_ids": sample.token_ids.astype(np.int64)}
    path = out_dir / f"hs_{idx}.safetensors"
    tmp = path.with_name(f".tmp-{path.name}")
    save_file(tensors, str(tmp), metadata={"prompt_id": sample.prompt_id, "turn_index": str(sample.turn_index),
                                           "n_prompt": str(sample.n_prompt)})
    os.replace(tmp, path)
    return path


def export_hidden(run_dir: str | Path | Location | RunDir, fmt: str, out_dir: str | Path) -> dict[str, Any]:
    """Write every committed hidden sample in `fmt`; returns the summary (also in out_dir/manifest.json)."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown hidden-state export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _run_hidden_config(rd)
    torch = _torch() if fmt == "specforge-offline" else None
    n = tokens = 0
    width = kind = n_layers = None
    index = []
    for idx, sample in enumerate(iter_hidden(rd)):
        if width is None:
            width = sample.width
            kind, n_layers = _kind(cfg, width)
        elif sample.width != width:
            raise ValueError(f"sample {sample.prompt_id!r} has width {sample.width}, the others {width}")
        if fmt == "specforge-offline":
            path = _specforge_write(torch, sample, idx, out, kind)
        else:
            path = _speculators_write(sample, idx, out, n_layers)
        index.append({"idx": idx, "file": str(path.relative_to(out)), "prompt_id": sample.prompt_id,
                      "turn_index": sample.turn_index, "tokens": len(sample.token_ids),
                      "n_prompt": sample.n_prompt, "n_rows": sample.n_rows})
        n += 1
        tokens += len(sample.token_ids)
    kind = kind or _kind(cfg, int(cfg.get("expected_width") or 3))[0]
    layers = _layers_and_norm(kind, cfg)
    notes: list[str] = []
    if fmt == "specforge-offline":
        last = ("the last token has no stored vector: its row in "
                f"{'aux_hidden_state' if kind == 'aux' else 'hidden_state'} is zeros and its loss_mask is 0")
        notes.append(last)
        if kind == "aux":
            notes.append("no hidden_state (last layer after the final norm) was captured; only aux_hidden_state")
        else:
            notes.append("only the last layer was captured (no aux_hidden_state): SpecForge's EAGLE-3 offline "
                         "training needs the auxiliary layers (run the server with EAGLE3 aux hidden states)")
    else:
        notes.append(f"LAYOUT DIFFERS from speculators' own dumps: they hold 4 layers [2, L//2, L-3, L] with the "
                     f"last one BEFORE the final norm; this export holds {n_layers or '?'} layer(s) as SGLang "
                     f"returned them ({layers['layers_note'] or kind}; {layers['norm']}).")
        notes.append("hidden_states has T - 1 rows for T token_ids: the last generated token has no vector "
                     "(not padded)")
    summary = {
        "format": fmt, "run": str(rd.path), "samples": n, "tokens": tokens, "width": width,
        "layers": layers, "n_layers": n_layers, "alignment": ALIGNMENT_NOTE, "dtype": "bf16",
        "layout_differs_from_speculators": fmt == "speculators-hidden", "notes": notes,
    }
    atomic_write(out / "manifest.json", orjson.dumps({**summary, "files": index}, option=orjson.OPT_INDENT_2))
    return summary
