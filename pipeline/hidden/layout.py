"""What a capture stores, as data: which states, from which layer, before or after the final norm.

A captured sample is a bf16 matrix [T, K * H]: row t holds K states of width H, computed when token t of
prompt + completion was fed (T rows for T tokens). The K states, in order, are `CaptureLayout.states`:

- `aux` (3 of them): the residual stream entering decoder layer i, for i in `aux_layer_ids` (default
  [2, L//2, L-3]; [1, L//2, L-1] at 6 layers or fewer). In transformers' terms `output_hidden_states[i]`; in vLLM's and
  speculators' terms layer id i ("the input of layer i"); SpecForge names the same physical states [1, L//2-1, L-4] (the output of layer
  i-1, which SGLang captures as the input of layer i). No norm.
- `final_post_norm`: the last decoder layer's output after the model's final norm: the input of lm_head
  (SpecForge's `hidden_state`, its teacher).
- `last_pre_norm`: the last decoder layer's output before the final norm (speculators' 4th layer; its trainer
  applies the verifier's norm itself).

The ids are never inferred from a note: they come from the model config (num_hidden_layers) or the config
file, and are written into RUN/capture/capture.json and every export manifest.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

AUX, FINAL_POST_NORM, LAST_PRE_NORM = "aux", "final_post_norm", "last_pre_norm"
NORM_OF = {AUX: "none (residual stream entering the layer)", FINAL_POST_NORM: "after the final norm (lm_head input)",
           LAST_PRE_NORM: "before the final norm"}


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default auxiliary layers in vLLM/speculators ids (input of layer i): speculators' [2, L//2, L-3].
    At 6 layers or fewer that repeats a layer (L=6: [2, 3, 3]), which speculators refuses; such a model then takes
    [1, L//2, L-1] (distinct for L >= 4; below 4 layers no 3 distinct ids in 1..L-1 exist)."""
    ids = [2, num_layers // 2, num_layers - 3]
    return ids if len(set(ids)) == 3 else [1, num_layers // 2, num_layers - 1]


@dataclass(frozen=True)
class State:
    kind: str  # AUX, FINAL_POST_NORM or LAST_PRE_NORM
    layer: int  # vLLM/speculators id: the input of decoder layer `layer` (num_layers: after the last layer)
    norm: str

    @property
    def hf_hidden_states_index(self) -> int | None:
        """The index in transformers' output_hidden_states that holds this state (None: not there)."""
        return self.layer if self.kind == AUX else None

    @property
    def specforge_layer_id(self) -> int | None:
        """SpecForge's `aux_hidden_state_layer_ids` naming of an aux state (the output of layer - 1)."""
        return self.layer - 1 if self.kind == AUX else None


@dataclass(frozen=True)
class CaptureLayout:
    model: str
    num_layers: int
    hidden_size: int
    aux_layer_ids: tuple[int, ...]
    dtype: str = "bf16"
    states: tuple[State, ...] = field(default=())

    @classmethod
    def build(cls, model: str, num_layers: int, hidden_size: int, aux_layer_ids: list[int] | None = None,
              dtype: str = "bf16") -> "CaptureLayout":
        if not aux_layer_ids and num_layers < 4:
            raise ValueError(f"the model has {num_layers} decoder layers, too few for the default aux layers: "
                             "EAGLE-3 needs 3 distinct aux layer ids in 1..L-1 (set aux_layer_ids, for a model of "
                             "4 or more layers)")
        aux = list(aux_layer_ids) if aux_layer_ids else default_aux_layers(num_layers)
        if len(aux) != 3 or len(set(aux)) != 3 or any(not 0 < i < num_layers for i in aux):
            raise ValueError(f"aux_layer_ids {aux}: EAGLE-3 needs 3 distinct layer ids in 1..{num_layers - 1} "
                             f"(the model has {num_layers} decoder layers)")
        states = tuple(State(AUX, i, NORM_OF[AUX]) for i in aux) + (
            State(FINAL_POST_NORM, num_layers, NORM_OF[FINAL_POST_NORM]),
            State(LAST_PRE_NORM, num_layers, NORM_OF[LAST_PRE_NORM]))
        return cls(model, num_layers, hidden_size, tuple(aux), dtype, states)

    @property
    def width(self) -> int:
        return len(self.states) * self.hidden_size

    def index(self, kind: str) -> list[int]:
        return [k for k, s in enumerate(self.states) if s.kind == kind]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["states"] = [{**asdict(s), "hf_hidden_states_index": s.hf_hidden_states_index,
                          "specforge_layer_id": s.specforge_layer_id} for s in self.states]
        out["aux_layer_ids"] = list(self.aux_layer_ids)
        out["specforge_aux_hidden_state_layer_ids"] = [i - 1 for i in self.aux_layer_ids]
        out["row_alignment"] = "row t = the states computed when token t of prompt + completion was fed; T rows"
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CaptureLayout":
        states = tuple(State(s["kind"], int(s["layer"]), s["norm"]) for s in d["states"])
        return cls(d["model"], int(d["num_layers"]), int(d["hidden_size"]), tuple(d["aux_layer_ids"]),
                   d.get("dtype", "bf16"), states)


def capture_fingerprint(route: str, layout: CaptureLayout, model_identity: dict[str, Any] | None = None,
                        compute_dtype: str | None = None) -> str:
    """The capture's identity: route, model (its path and what its config and weight files say it is), layers,
    stored and compute dtype (a resume with another is drift)."""
    ident = {"route": route, "model": layout.model, "aux_layer_ids": list(layout.aux_layer_ids),
             "states": [[s.kind, s.layer] for s in layout.states], "dtype": layout.dtype,
             "num_layers": layout.num_layers, "hidden_size": layout.hidden_size,
             "model_identity": model_identity or {}, "compute_dtype": compute_dtype}
    return hashlib.sha256(orjson.dumps(ident, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def layout_shape(layout: dict[str, Any]) -> dict[str, Any]:
    """What an actor's route must agree on with capture.json before it stores a state."""
    return {key: layout.get(key) for key in ("num_layers", "hidden_size", "aux_layer_ids", "states")}
