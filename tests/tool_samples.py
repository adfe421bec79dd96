"""The project's tool-calling samples regenerated under all_turns on an emulated Kimi-K2.5 (SGLang's kimi_k2 parser),
through the real endpoint worker and record builder: shared by tests/test_tool_fidelity_runs.py and the figures of
docs/tool-calls.md (`python -m tests.tool_samples`, which prints them).

`splices(messages, rows)` reads what each spliced result answered without regen's own matching: a result in a
record's history is found among the source's results by its tool and its text, and the arguments of the source
call(s) it answered are compared (as JSON objects) with those of the target's call it was put under.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ("sample_tools", "sample_tools_sharegpt")
MODEL = "moonshotai/Kimi-K2.5"


def sample_table(tmp: Path, extra: list[dict] | None = None):
    """The samples' all_turns prompts (and `extra` OpenAI records), staged and committed as a run does:
    (prompts, the prompt set table)."""
    from pipeline.prompts.prompt_set import build_prompt_set
    from pipeline.prompts.sources import SourceSpec, load_source_spec
    from pipeline.store.promptset import StagedPromptSet
    from pipeline.store.rundir import RunDir

    specs = [(load_source_spec(ROOT / "prompts_sources" / f"{name}.yaml"), None) for name in SAMPLES]
    if extra:
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "extra.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in extra))
        specs.append((SourceSpec(name="extra", kind="jsonl", path=str(tmp / "extra.jsonl"), format="openai",
                                 id_field="id"), None))
    prompts = build_prompt_set(specs, mode="all_turns").prompts
    staged = StagedPromptSet()
    for p in prompts:
        staged.add_prompt(p)
    run = RunDir(tmp / "run")
    run.create()
    staged.commit(run)
    return prompts, run.load_prompt_set()


def regenerate(url: str, rule: str, tmp: Path, thinking: bool = False, max_tokens: int = 128,
               extra: list[dict] | None = None):
    """Every sample prompt's conversation under `tool_result_match: rule`: (prompts, rows by prompt, builder)."""
    from pipeline.core.config import Endpoint, RunConfig, SourceRef
    from pipeline.dispatch.worker import EndpointWorker
    from pipeline.endpoints.client import ClientSettings
    from pipeline.endpoints.engines import SGLangAdapter
    from tests.helpers import exchange_all, handed_out

    prompts, table = sample_table(tmp, extra)
    cfg = RunConfig(run_name="t", model=MODEL, mode="all_turns", sources=[SourceRef(spec="s.yaml")],
                    endpoints=[Endpoint(url=url)], sampling={"temperature": 0.0, "max_tokens": max_tokens},
                    thinking=thinking, tool_result_match=rule)
    settings = ClientSettings(model=MODEL, temperature=0.0, top_p=1.0, max_tokens=max_tokens,
                              chat_template_kwargs={"thinking": thinking}, engines={"e": SGLangAdapter(version="0.5.23")})
    builder, handed = handed_out(table, cfg, tmp / "prompts", fingerprint="fp")

    async def scenario():
        worker = EndpointWorker(url, "e", 8, settings, mode="all_turns", attempts_per_endpoint=1,
                                tool_result_match=rule)
        return await exchange_all(worker, list(handed.values()))

    outcomes = asyncio.run(scenario())
    assert all(o.kind == "done" for o in outcomes), [o.message for o in outcomes]
    rows = {}
    for outcome in outcomes:
        done = builder.records(outcome, outcome.attempts)
        rows[outcome.prompt_id] = sorted(done, key=lambda r: r["turn_index"])
    return prompts, rows, builder


def _object(arguments) -> dict | None:
    try:
        value = orjson.loads(arguments) if isinstance(arguments, str) else arguments
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def splices(messages: list[dict], rows: list[dict]) -> list[tuple[int, bool]]:
    """(the turn whose history first holds it, whether its arguments are the source call's) of every result spliced
    into a conversation's records."""
    from pipeline.prompts.tool_calls import message_from_row

    source: dict[tuple, list[dict]] = {}  # (tool, result as JSON) -> the arguments of the calls it answered
    call_args = {c["id"]: _object(c["function"]["arguments"]) for m in messages for c in m.get("tool_calls") or ()}
    for m in messages:
        if m["role"] == "tool":
            source.setdefault((m.get("name"), orjson.dumps(m["content"])), []).append(call_args.get(m["tool_call_id"]))
    out, seen = [], 0
    for row in rows:
        history = [message_from_row(m) for m in row["messages"]]
        results = [(k, m) for k, m in enumerate(history) if m["role"] == "tool"]
        for k, m in results[seen:]:
            caller = next(msg for msg in reversed(history[:k]) if msg["role"] == "assistant")
            call = next(c for c in caller["tool_calls"] if c["id"] == m["tool_call_id"])
            wanted = _object(call["function"]["arguments"])
            out.append((row["turn_index"], wanted in source[(m.get("name"), orjson.dumps(m["content"]))]))
        seen = len(results)
    return out


def figures(prompts, rows) -> dict:
    """What the samples' conversations came to: splices and how many answered other arguments, records, flags."""
    by_id = {p.prompt_id: p for p in prompts}
    every = [s for pid, steps in rows.items() for s in splices(list(by_id[pid].messages), steps)]
    records = [r for steps in rows.values() for r in steps]
    ends: dict[str, int] = {}
    for r in records:
        if r.get("conversation_end"):
            ends[r["conversation_end"].split(":")[0]] = ends.get(r["conversation_end"].split(":")[0], 0) + 1
    with_tools = [pid for pid, p in by_id.items() if p.tools or any(m["role"] == "tool" for m in p.messages)]
    return {"conversations_with_tools": len(with_tools), "records": len(records),
            "tool_records": sum(len(rows[pid]) for pid in with_tools),
            "splices": len(every), "splices_other_arguments": sum(not ok for _, ok in every),
            "records_flagged_spliced_other_arguments": sum("spliced_other_arguments" in r["flags"] for r in records),
            "conversations_to_their_end": sum(not steps[-1].get("conversation_end") for pid, steps in rows.items()
                                              if pid in with_tools),
            "conversation_end": ends}


def main() -> int:
    import tempfile

    from tests.helpers import emulators

    with emulators(1, preset="kimi") as (server,), tempfile.TemporaryDirectory() as tmp:
        for thinking, max_tokens in ((False, 128), (True, 1024)):
            for rule in ("name", "arguments"):
                prompts, rows, _ = regenerate(server.url, rule, Path(tmp) / f"{rule}-{thinking}", thinking,
                                              max_tokens)
                print(f"thinking {thinking}, max_tokens {max_tokens}, tool_result_match {rule}:",
                      orjson.dumps(figures(prompts, rows)).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
