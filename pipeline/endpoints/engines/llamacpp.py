"""llama.cpp (its server, as xllamacpp embeds it: the local default fleet). It returns no token ids, splits no
reasoning, and has no information endpoints of SGLang's; /v1/models says `owned_by: llamacpp`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import ErrorTexts, OpenAIAdapter

ERRORS = ErrorTexts(context_overflow=("exceeds the available context size",))  # 400 "the request exceeds ..."


@dataclass(frozen=True)
class LlamaCppAdapter(OpenAIAdapter):
    engine: str = "llamacpp"

    @classmethod
    def from_props(cls, props: Any) -> "LlamaCppAdapter":
        """/props `build_info` ("b6670-..."), when the server answers it."""
        build = props.get("build_info") if isinstance(props, dict) else None
        return cls(version=str(build) if build else None)

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
