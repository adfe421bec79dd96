"""llama.cpp (its server, as xllamacpp embeds it: the local default fleet). It returns no token ids, splits no
reasoning, takes no images (the local fleet launches no --mmproj), and has no information endpoints of SGLang's;
/v1/models says `owned_by: llamacpp`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import ErrorTexts, OpenAIAdapter

ERRORS = ErrorTexts(context_overflow=("exceeds the available context size",))  # 400 "the request exceeds ..."


@dataclass(frozen=True)
class LlamaCppAdapter(OpenAIAdapter):
    engine: str = "llamacpp"

    reported_build: str | None = None  # /props build_info when it names no build (then `version` is None)

    @classmethod
    def from_props(cls, props: Any) -> "LlamaCppAdapter":
        """/props `build_info` ("b6670-..."), when the server answers it. A build of number 0 ("b0-unknown": a
        llama.cpp built outside its git tree, as xllamacpp's embedded one) names no version."""
        build = props.get("build_info") if isinstance(props, dict) else None
        if build and str(build).startswith("b0-"):
            return cls(version=None, reported_build=str(build))
        return cls(version=str(build) if build else None)

    def version_warning(self) -> str | None:
        if self.version is None:
            said = f"/props build_info {self.reported_build!r}" if self.reported_build else "no /props build_info"
            return f"the llama.cpp server names no build ({said}): records say engine_version null"
        return None

    @property
    def error_texts(self) -> ErrorTexts:
        return ERRORS

    def context_fix(self, needed: int) -> str:
        return f"give the server a context of {needed} tokens or more (local_fleet.ctx_per_slot for the local fleet)"

    @property
    def returns_output_ids(self) -> bool | None:
        return False

    def chat_extras(self, *, want_ids: bool, stream: bool) -> dict[str, Any]:
        return {}

    @property
    def takes_images(self) -> bool | None:
        return False

    def images_fix(self) -> str:
        return ("regen's llama.cpp fleet serves text only (xllamacpp answers an image part with 500 'image input is "
                "not supported - hint: if this is unexpected, you may need to provide the mmproj', and its /props "
                "says modalities.vision: false): run an image prompt set on SGLang or vLLM serving a vision-language "
                "model")
