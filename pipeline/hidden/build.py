"""The capture route a capture config names, built in the actor (apart from routes.py, which vllm_route.py
imports: the two routes stay free of a circle)."""
from __future__ import annotations

from .routes import CaptureRoute, TransformersOptions, TransformersRoute


def build_route(cfg, owner=None) -> CaptureRoute:
    """The route a capture config names (`cfg`: core.capture_config.CaptureConfig), built in the actor. `owner`
    (vllm_route.RequestOwner): the capture and session that name route vllm's server-side files."""
    if cfg.route == "transformers":
        return TransformersRoute(TransformersOptions(cfg.model, tuple(cfg.aux_layer_ids or ()) or None,
                                                     cfg.torch_dtype, cfg.torch_threads, cfg.weights_identity))
    from .vllm_route import VllmRoute

    return VllmRoute(cfg, owner)
