"""The target's tool calls in an answer: `message.tool_calls` of a chat answer, and `delta.tool_calls` of a
stream joined by index (OpenAI's streaming shape, which SGLang and vLLM follow)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson


def tool_calls_of(message: dict[str, Any]) -> list[dict] | None:
    """A message's `tool_calls` as OpenAI objects with `arguments` a JSON string (a server that sends an object
    gets it dumped); None when it calls no tool."""
    calls = message.get("tool_calls")
    if not calls:
        return None
    out = []
    for call in calls:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = orjson.dumps(arguments if arguments is not None else {}).decode()
        out.append({"id": call.get("id") or "", "type": call.get("type") or "function",
                    "function": {"name": function.get("name") or "", "arguments": arguments}})
    return out


@dataclass
class ToolCallFragments:
    """`delta.tool_calls` of a stream, joined as OpenAI streams them: each fragment names its call by `index`;
    the first brings the id, type and name, the following ones pieces of `arguments` to append."""

    calls: dict[int, dict[str, Any]] = field(default_factory=dict)

    def add(self, fragments: list[dict[str, Any]]) -> None:
        for position, fragment in enumerate(fragments):
            index = fragment.get("index")
            call = self.calls.setdefault(index if isinstance(index, int) else position,
                                         {"id": "", "type": "function", "name": "", "arguments": []})
            call["id"] = call["id"] or fragment.get("id") or ""
            call["type"] = fragment.get("type") or call["type"]
            function = fragment.get("function") or {}
            call["name"] = call["name"] or function.get("name") or ""
            if function.get("arguments"):
                call["arguments"].append(function["arguments"])

    def joined(self) -> list[dict] | None:
        if not self.calls:
            return None
        return [{"id": c["id"], "type": c["type"], "function": {"name": c["name"], "arguments": "".join(c["arguments"])}}
                for _, c in sorted(self.calls.items())]
