"""vLLM's own protocol classes, run under the python of vLLM's venv (`make vllm`) with the worktree on PYTHONPATH:

    VLLM_PYTHON -m tests.conformance.vllm_checks samples --out SAMPLES.json
    VLLM_PYTHON -m tests.conformance.vllm_checks requests --bodies BODIES.json --out RESULT.json

`samples`: answers built with vLLM's response classes and serialised as its server does (chat_completion/
serving.py: `model_dump_json()` for an answer, `exclude_unset=True` for stream chunks), plus the declared fields
of each class. `requests`: every body regen sent, parsed by ChatCompletionRequest: a key it does not declare is
a failure (vLLM would ignore it, with only a warning in its log), and so is one its sampling-params conversion
refuses. Nothing here imports regen (its dependencies are not in vLLM's venv).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tests.conformance.sglang_checks import undeclared

PROMPT_IDS = [1, 9690, 198, 2683, 359, 253, 1, 520, 9531, 198]
PIECES = [("reasoning", "Colours", [10, 11]), ("reasoning", " of light.", [12]), ("content", "Red", [13]),
          ("content", ", blue.", [14, 15]), ("content", "", [2])]  # the last chunk: EOS, no text


def samples() -> dict:
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
    from vllm.entrypoints.openai.chat_completion import protocol as chat
    from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList, UsageInfo

    reasoning = "".join(text for kind, text, _ in PIECES if kind == "reasoning")
    content = "".join(text for kind, text, _ in PIECES if kind == "content")
    output_ids = [i for _, _, ids in PIECES for i in ids]
    usage = UsageInfo(prompt_tokens=len(PROMPT_IDS), completion_tokens=len(output_ids),
                      total_tokens=len(PROMPT_IDS) + len(output_ids))
    answer = chat.ChatCompletionResponse(
        id="chatcmpl-1", model="m", usage=usage, prompt_token_ids=PROMPT_IDS,
        choices=[chat.ChatCompletionResponseChoice(
            index=0, finish_reason="stop", token_ids=output_ids,
            message=chat.ChatMessage(role="assistant", content=content, reasoning=reasoning))])
    chunk = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 0, "model": "m"}  # set by serving.py
    first = chat.ChatCompletionStreamResponse(**chunk, prompt_token_ids=PROMPT_IDS, choices=[  # role + prompt ids
        chat.ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""),
                                                finish_reason=None)])
    chunks = [first.model_dump_json(exclude_unset=True)]
    for n, (kind, text, ids) in enumerate(PIECES):
        choice = chat.ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(**{kind: text}), token_ids=ids,
                                                         finish_reason="stop" if n == len(PIECES) - 1 else None)
        chunks.append(chat.ChatCompletionStreamResponse(**chunk, choices=[choice]).model_dump_json(exclude_unset=True))
    chunks.append(chat.ChatCompletionStreamResponse(**chunk, choices=[], usage=usage)
                  .model_dump_json(exclude_unset=True, exclude_none=True))
    models = ModelList(data=[ModelCard(id="m", owned_by="vllm", root="/models/m", max_model_len=2048)])
    fields = {cls.__name__: sorted(cls.model_fields) for cls in (
        chat.ChatMessage, DeltaMessage, chat.ChatCompletionResponse, chat.ChatCompletionResponseChoice,
        chat.ChatCompletionStreamResponse, chat.ChatCompletionResponseStreamChoice, ModelCard)}
    return {"answer": json.loads(answer.model_dump_json()), "stream": [json.loads(c) for c in chunks],
            "models": json.loads(models.model_dump_json()), "fields": fields, "reasoning": reasoning,
            "content": content, "prompt_ids": PROMPT_IDS, "output_ids": output_ids}


def requests(bodies: list[dict]) -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    detail, checked = [], 0
    for body in bodies:
        try:
            request = ChatCompletionRequest.model_validate(body)
            request.to_sampling_params(max_tokens=body.get("max_tokens") or 16, default_sampling_params={})
        except Exception as exc:  # noqa: BLE001 - the refusal is the finding
            detail.append(f"refused {sorted(body)}: {type(exc).__name__}: {exc}")
            continue
        checked += 1
        detail += [f"undeclared {key!r} in a body with keys {sorted(body)}" for key in undeclared(request, body)]
    return {"ok": not detail and checked == len(bodies), "checked": checked, "detail": detail}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("samples", "requests"))
    parser.add_argument("--bodies", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    result = samples() if args.what == "samples" else requests(json.loads(args.bodies.read_text()))
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
