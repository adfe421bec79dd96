"""Capture routes: token ids in, the layout's states out ([T, K, H] float32, row t = after feeding token t).

Every route is one object with `layout` and `capture(token_ids)`; the actor converts its output to bf16 and
stores it (hidden/parts.py). Routes:
- `transformers` (in-process, any HF causal LM): one forward pass with output_hidden_states; the aux states are
  output_hidden_states[i], the final post-norm state is its last entry (transformers applies the final norm
  there), and the pre-norm last layer is taken with a forward hook on the last decoder layer.
- `vllm`: hidden/vllm_route.py (the server writes the states into a safetensors file).
hidden/build.py picks the route a capture config names.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..core.errors import ConfigError
from .layout import AUX, FINAL_POST_NORM, LAST_PRE_NORM, CaptureLayout
from .errors import CaptureSampleError


class CaptureRoute(Protocol):
    layout: CaptureLayout

    def capture(self, token_ids: list[int]) -> np.ndarray:
        """[T, len(layout.states), hidden_size] float32 for T token ids."""


@dataclass(frozen=True)
class TransformersOptions:
    model: str  # a local HF folder or a hub id
    aux_layer_ids: tuple[int, ...] | None = None
    torch_dtype: str = "float32"  # compute dtype; states are stored as bf16 either way
    threads: int | None = None  # torch threads in the actor (None: torch's default)
    weights_identity: str = "sampled"  # how the weight files are hashed (model_identity)


class TransformersRoute:
    """In-process capture through transformers (CPU or the node's GPU)."""

    def __init__(self, opts: TransformersOptions):
        try:
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError:
            raise ConfigError("route transformers needs torch and transformers (pip install -e '.[verify]')") from None
        self.torch = torch
        if opts.threads:
            torch.set_num_threads(opts.threads)
        config = AutoConfig.from_pretrained(opts.model)
        self.model_identity = model_identity(opts.model, config, opts.weights_identity)
        text = getattr(config, "text_config", None) or config
        aux = list(opts.aux_layer_ids) if opts.aux_layer_ids else None
        self.layout = CaptureLayout.build(normalised_model(opts.model), int(text.num_hidden_layers),
                                          int(text.hidden_size), aux)
        self.device = "cuda" if torch.cuda.is_available() and os.environ.get("REGEN_CAPTURE_CPU") != "1" else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(opts.model, dtype=getattr(torch, opts.torch_dtype))
        self.model.to(self.device).eval()
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.decoder_layers = self.model.get_decoder().layers
        if len(self.decoder_layers) != self.layout.num_layers:
            raise ConfigError(f"{opts.model}: {len(self.decoder_layers)} decoder layers, config says "
                              f"{self.layout.num_layers}")

    def capture(self, token_ids: list[int]) -> np.ndarray:
        torch = self.torch
        bad = next(((k, t) for k, t in enumerate(token_ids) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise CaptureSampleError(f"token id {bad[1]} at position {bad[0]} is outside the model's vocabulary "
                                     f"(0..{self.vocab_size - 1})")
        seen: dict[str, object] = {}

        def keep(_module, _inputs, output):
            seen["pre"] = output[0] if isinstance(output, tuple) else output

        hook = self.decoder_layers[-1].register_forward_hook(keep)
        try:
            with torch.inference_mode():
                ids = torch.tensor([list(token_ids)], device=self.device)
                out = self.model(input_ids=ids, use_cache=False, output_hidden_states=True, logits_to_keep=1)
        finally:
            hook.remove()
        hs = out.hidden_states
        picked = []
        for state in self.layout.states:
            if state.kind == AUX:
                picked.append(hs[state.layer][0])
            elif state.kind == FINAL_POST_NORM:
                picked.append(hs[-1][0])
            elif state.kind == LAST_PRE_NORM:
                picked.append(seen["pre"][0])
        return torch.stack(picked, dim=1).float().cpu().numpy()


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json", ".bin.index.json")


def normalised_model(model: str) -> str:
    """A local model folder as its absolute path (a trailing slash or `./` is the same folder); a hub id as is."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.is_dir() else model


IDENTITY_VERSION = 3  # how model_identity's weights digest is made; capture.json records it


def model_identity(model: str, config, weights_identity: str = "sampled") -> dict[str, Any]:
    """What the model is, beyond its name: the config's shape, the weight files' names and sizes and their bytes
    (`sampled`: an index whole, a safetensors header whole and WINDOWS evenly spaced windows of each file; `full`:
    every byte), or the hub revision. No mtime: each node's own copy of the same files is the same model."""
    text = getattr(config, "text_config", None) or config
    ident: dict[str, Any] = {"identity_version": IDENTITY_VERSION, "weights_identity": weights_identity,
                             "architectures": list(getattr(config, "architectures", None) or []),
                             "model_type": getattr(config, "model_type", None),
                             "num_hidden_layers": int(text.num_hidden_layers), "hidden_size": int(text.hidden_size),
                             "vocab_size": getattr(text, "vocab_size", None)}
    folder = Path(model).expanduser()
    if folder.is_dir():
        ident["weights"] = _files_digest(folder, _full_bytes if weights_identity == "full" else _sampled_bytes)
    else:
        ident["revision"] = getattr(config, "_commit_hash", None)
    return ident


def _weight_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))


def _files_digest(folder: Path, described) -> str:
    digest = hashlib.sha256()
    for f in _weight_files(folder):
        digest.update(repr([f.name, f.stat().st_size]).encode())
        described(f, digest)
    return digest.hexdigest()[:16]


def _stat_digest(folder: Path) -> str:
    """The weights digest of capture.json files without identity_version (regen before the version): the weight
    files' names, sizes and mtimes."""
    listing = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in _weight_files(folder)]
    return hashlib.sha256(repr(listing).encode()).hexdigest()[:16]


def legacy_weights_digests(model: str, version: int | None) -> list[str]:
    """The weights digests an identity of an older `identity_version` (None: unversioned) would have for this
    folder as it is now: equal to the recorded one means the same untouched folder."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return []
    ends = _files_digest(folder, _ends_bytes)
    return {None: [_stat_digest(folder), ends], 2: [ends]}.get(version, [])  # unversioned: mtimes, then ends


def _ends_bytes(path: Path, digest) -> None:
    """identity_version 2 (and unversioned after 340be1f): an index whole, else the first and last SAMPLE_BYTES."""
    if path.name.endswith(".index.json"):
        digest.update(path.read_bytes())
        return
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(SAMPLE_BYTES)
        f.seek(max(0, size - SAMPLE_BYTES))
        digest.update(head + f.read(SAMPLE_BYTES))


def _sampled_bytes(path: Path, digest) -> None:
    """An index whole; a safetensors header whole (tensor names, dtypes, shapes, offsets); WINDOWS windows of
    SAMPLE_BYTES evenly spaced from the file's start to its end (a file smaller than those: whole)."""
    size = path.stat().st_size
    if path.name.endswith(".index.json") or size <= WINDOWS * SAMPLE_BYTES:
        _full_bytes(path, digest)
        return
    with path.open("rb") as f:
        if path.name.endswith(".safetensors"):
            header = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(header, size - 8)))
        for k in range(WINDOWS):
            f.seek(k * (size - SAMPLE_BYTES) // (WINDOWS - 1))
            digest.update(f.read(SAMPLE_BYTES))


def _full_bytes(path: Path, digest) -> None:
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)


SAMPLE_BYTES = 1 << 16  # one window of a weight file
WINDOWS = 16  # windows per file (sampled): 1 MiB read per file, whatever its size


def _model_config(model: str):
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError("regen capture needs transformers to read the model's config (pip install transformers)") \
            from None
    try:
        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as exc:  # ValueError: a config.json transformers does not recognise
        raise ConfigError(f"capture model {model!r}: cannot read its config.json ({exc})") from None


def layout_for(cfg) -> CaptureLayout:
    """The layout a capture config gives, from the model's config alone (the driver loads no weights)."""
    text = getattr(config := _model_config(cfg.model), "text_config", None) or config
    try:
        return CaptureLayout.build(normalised_model(cfg.model), int(text.num_hidden_layers), int(text.hidden_size),
                                   cfg.aux_layer_ids)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def identity_for(cfg) -> dict[str, Any]:
    """The model identity a capture config names (config.json and weight files' stat, no weights loaded)."""
    return model_identity(cfg.model, _model_config(cfg.model), cfg.weights_identity)
