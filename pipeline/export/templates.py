"""Which SpecForge chat template renders a run's `specforge` export, per model family (the export manifest's
`chat_template`). SpecForge renders conversations with the tokenizer's own chat template; its template entry adds
a system prompt to rows without one and the loss-mask markers (specforge/data/template.py)."""
from __future__ import annotations

CHAT_TEMPLATE_NOTE = ("SpecForge re-renders these conversations with the tokenizer's chat template and its own "
                      "template entry, and most entries inject a system prompt (\"You are a helpful assistant.\") "
                      "into rows without one, which the target never saw (the manifest's `chat_template` says which "
                      "entry fits this model). Rendering closes every assistant turn with an end-of-turn token; "
                      "records cut at max_tokens are therefore dropped unless --keep-truncated")
EXACT_EXPORT = ("`specforge-tokens` is the exact export: the server's own prompt and output ids, with loss_mask 1 "
                "exactly on the target's tokens")
# Seen on vLLM 0.32 (CPU) serving configs/templates/smollm2_tools.jinja: the prompt renders each tool as vLLM's
# request model dumps it (type, then function: name, description, parameters), not in the order sent.
TOOLS_NOT_EXACT = ("Rows with tools are not rendered exactly by any template: the server renders each tool as its "
                   "own request model re-serialises it (vLLM: `type`, then `function` with name, description, "
                   "parameters; SGLang: its Tool model dump, which differs between versions), while the export "
                   "holds the tools as the source wrote them, which SpecForge renders as written. For a "
                   "tool-calling run, export `specforge-tokens`, the server's own ids")
# What SpecForge's parsers (specforge/data/parse.py) and the server's tool-call parser do to a tool-calling run's
# rows (docs/tool-calls.md, section Exports).
TOOL_CALLS_NOTE = (
    "For a run with tools: SpecForge's GeneralParser (templates without parser_type thinking, e.g. kimi-k2-instruct) "
    "keeps only role, content and tool_calls of each message, so tool results lose `tool_call_id` and `name`, "
    "which Kimi's template renders (`## Return of ID`); ThinkingParser (kimi-k2-thinking) keeps them. Both replace "
    "call arguments that are not JSON with {} (with a warning) and pass JSON that is not an object as it is; such "
    "records carry the flag arguments_not_object (--drop-flagged drops them). The target's calls are what the "
    "server's tool-call parser returned: SGLang's kimi_k2 parser drops a call cut at max_tokens from an unstreamed "
    "answer (flag truncated_call: its tokens are only in the output ids) and streams it with its arguments cut "
    "(flag arguments_not_object); it drops a call whose arguments are not an object, unstreamed, and streams it "
    "from 0.5.17. `specforge-tokens` trains each step on the server's own ids, whatever the parser made of them")
# What SpecForge's conversation templates (specforge/data/template.py) do with a model family's rows.
TEMPLATE_ADVICE = {
    "kimi": ("no SpecForge template renders Kimi's ids exactly: both kimi-k2-thinking and kimi-k2-instruct inject "
             "\"You are a helpful assistant.\" into rows without a system message, which the target never saw. "
             "To train on exactly what the target saw, export `specforge-tokens`; with this export, use "
             "kimi-k2-thinking for thinking runs and kimi-k2-instruct otherwise, knowing that the system prompt "
             "differs"),
    "chatml": ("lfm for ChatML models such as SmolLM2 (it injects no system prompt, so it renders the server's exact "
               "prompt ids of tool-free rows); not qwen (it injects its own system prompt). " + TOOLS_NOT_EXACT),
}


def model_family(model: str) -> str | None:
    name = model.lower()
    if "kimi" in name:
        return "kimi"
    if "smollm" in name:
        return "chatml"
    return None


def template_advice(model: str) -> dict[str, str]:
    """The manifest's `chat_template` entry of a `specforge` export, for the run's model family."""
    family = model_family(model)
    advice = TEMPLATE_ADVICE.get(family) if family else (
        f"no advice for {model!r}: pick the SpecForge template of its family, and check whether it injects a system "
        "prompt into rows without one (the target never saw it)")
    return {"family": family or "unknown", "specforge": advice, "exact_export": EXACT_EXPORT,
            "note": CHAT_TEMPLATE_NOTE, "tool_calls": TOOL_CALLS_NOTE}
