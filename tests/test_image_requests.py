"""Image prompts on the request side (issue 28, SEND): what the endpoint worker sends for image parts (a data: URL
of the image's bytes, read and checked when sent; file:// on request; SGLang's content_hash where the version
declares it), a changed image failing its prompt unsent, the prompt ids stored as returned, the preflight's refusal
of a fleet that cannot take images, and max_prompt_tokens counting images.

The servers: a stand-in recording every body (tests/image_servers.py; until the emulator takes images), the
SGLang emulator as a text-only model, each SGLang wheel's own request model (one subprocess,
tests/conformance/sglang_request_images.py), and vLLM's own texts and Kimi-K2.5 processor read from its venv. Real
images, made with Pillow; a real run directory on disk."""
from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from PIL import Image

from pipeline.core.errors import ConfigError
from pipeline.core.images import image_part, stored_image_path, text_part
from pipeline.core.work import DONE, ENDPOINT_FATAL, TERMINAL, WorkItem
from pipeline.dispatch.images import ConversationImages, check_send_as
from pipeline.dispatch.worker import EndpointWorker
from pipeline.endpoints.client import ClientSettings
from pipeline.endpoints.engines import SGLangAdapter, VLLMAdapter
from tests.image_servers import IMAGE_ID, MODEL, PLACEHOLDERS, StandIn, data_url_bytes, image_urls

WORKTREE = Path(__file__).resolve().parent.parent
SGLANG_CACHE = Path(os.environ.get("REGEN_SGLANG_CACHE", Path.home() / ".cache/regen/sglang"))
VERSIONS = ("0.5.14", "0.5.17", "0.5.18", "0.5.23")


def photo(seed: int, size=(64, 48), kind: str = "PNG") -> bytes:
    """A small real image: a gradient whose colours depend on `seed`."""
    image = Image.new("RGB", size)
    image.putdata([((x * 4 + seed * 40) % 256, (y * 5) % 256, (x * y + seed) % 256)
                   for y in range(size[1]) for x in range(size[0])])
    out = io.BytesIO()
    image.save(out, format=kind)
    return out.getvalue()


def copied(run: Path, data: bytes, size=(64, 48), media_type="image/png") -> dict:
    """An image copied into the run directory (images.store: copy): its part has no path."""
    sha = hashlib.sha256(data).hexdigest()
    where = run / stored_image_path(sha)
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_bytes(data)
    return image_part(sha, media_type, size[0], size[1], len(data))


def ask(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def item(prompt_id: str, messages: list[dict]) -> WorkItem:
    return WorkItem(prompt_id, orjson.dumps(messages), None)


def worker(server: StandIn, engine, run: Path | None, **options) -> EndpointWorker:
    settings = ClientSettings(model=MODEL, temperature=0.0, top_p=1.0, max_tokens=8,
                              engines={server.label: engine} if engine else {})
    return EndpointWorker(server.url, server.label, 2, settings, run_uri=str(run) if run else None, **options)


async def outcomes(w: EndpointWorker, items: list[WorkItem]) -> dict:
    """Every item's outcome, by prompt id: each exchange waits on the worker's ready event."""
    got: dict = {}
    work = list(items)
    for _ in range(50):
        exchange = await w.exchange(work, wait_s=10)
        work = []
        got.update({o.prompt_id: o for o in exchange.outcomes})
        if len(got) == len(items):
            break
    await w.close()
    return got


def run_items(server_options: dict, engine, run: Path | None, items: list[WorkItem], **options):
    async def main():
        server = await StandIn(**server_options).start()
        try:
            return await outcomes(worker(server, engine, run, **options), items), server.bodies
        finally:
            await server.stop()

    return asyncio.run(main())


# --- the request ---------------------------------------------------------------------------------------------------
ENGINES = {"sglang-0.5.14": ("sglang", "0.5.14"), "sglang-0.5.17": ("sglang", "0.5.17"),
           "sglang-0.5.18": ("sglang", "0.5.18"), "sglang-0.5.23": ("sglang", "0.5.23"), "vllm": ("vllm", "0.32.0")}


@pytest.fixture(scope="module")
def sent(tmp_path_factory):
    """One prompt (text, image, text, JPEG image) sent through the worker as each engine and version."""
    run = tmp_path_factory.mktemp("run")
    png, jpeg = photo(1), photo(2, (40, 30), "JPEG")
    messages = ask(text_part("Compare"), copied(run, png), text_part("with"),
                   copied(run, jpeg, (40, 30), "image/jpeg"))
    out = {}
    for name, (engine, version) in ENGINES.items():
        adapter = SGLangAdapter(version=version) if engine == "sglang" else VLLMAdapter(version=version)
        done, bodies = run_items({"engine": engine, "version": version}, adapter, run, [item("p", messages)])
        out[name] = (done["p"], bodies)
    return {"run": run, "png": png, "jpeg": jpeg, "messages": messages, "by_engine": out}


def test_each_image_goes_as_a_data_url_of_its_bytes_in_its_place(sent):
    for name, (outcome, [body]) in sent["by_engine"].items():
        assert outcome.kind == DONE, (name, outcome.message)
        content = body["messages"][0]["content"]
        assert [p["type"] for p in content] == ["text", "image_url", "text", "image_url"], name
        assert content[0] == {"type": "text", "text": "Compare"} and content[2]["text"] == "with"
        png, jpeg = (p["image_url"]["url"] for p in content[1::2])
        assert png.startswith("data:image/png;base64,") and data_url_bytes(png) == sent["png"]
        assert jpeg.startswith("data:image/jpeg;base64,") and data_url_bytes(jpeg) == sent["jpeg"]


def test_sglangs_content_hash_only_where_the_version_declares_it(sent):
    for name, (_, [body]) in sent["by_engine"].items():
        hashes = [u.get("content_hash") for u in image_urls(body)]
        if name in ("sglang-0.5.18", "sglang-0.5.23"):
            assert hashes == [f"sha256:{hashlib.sha256(sent[k]).hexdigest()}" for k in ("png", "jpeg")], name
        else:
            assert hashes == [None, None], name


def test_the_prompt_ids_are_stored_as_the_server_returned_them(sent):
    outcome, _ = sent["by_engine"]["sglang-0.5.23"]
    [completion] = outcome.completions
    assert completion.prompt_token_ids.count(IMAGE_ID) == 2 * PLACEHOLDERS  # the image placeholders, as returned
    assert completion.prompt_tokens == len(completion.prompt_token_ids)


def test_each_sglang_versions_request_model_takes_the_request(sent, tmp_path):
    """The bodies regen sent, parsed by each wheel's own ChatCompletionRequest: nothing undeclared (0.5.14 and
    0.5.17 get no content_hash), the hash kept as sent by 0.5.18 and 0.5.23, /model_info has_image_understanding in
    every version's http_server.py."""
    roots = {v: SGLANG_CACHE / v for v in VERSIONS}
    missing = [v for v, root in roots.items() if not (root / ".installed").exists()]
    if missing:
        why = f"SGLang {missing} not unpacked in {SGLANG_CACHE}: run `make sglang-wheels`"
        pytest.skip(why) if os.environ.get("REGEN_ALLOW_MISSING_WHEELS") == "1" else pytest.fail(why)
    bodies = {v: {"root": str(roots[v]), "bodies": sent["by_engine"][f"sglang-{v}"][1]} for v in VERSIONS}
    (tmp_path / "bodies.json").write_text(json.dumps(bodies))
    done = subprocess.run([sys.executable, "-m", "tests.conformance.sglang_request_images", "--bodies",
                           str(tmp_path / "bodies.json"), "--out", str(tmp_path / "out.json")], cwd=WORKTREE,
                          env={**os.environ, "PYTHONPATH": str(WORKTREE)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "out.json").read_text())
    sent_hashes = [f"sha256:{hashlib.sha256(sent[k]).hexdigest()}" for k in ("png", "jpeg")]
    for version in VERSIONS:
        result = results[version]
        assert result["ok"] and result["checked"] == 1, (version, result["detail"])
        assert result["content_hashes"] == (sent_hashes if version in ("0.5.18", "0.5.23") else [None, None])


def test_a_changed_or_vanished_image_fails_its_prompt_unsent_and_the_others_go_on(tmp_path):
    run = tmp_path / "run"
    good = copied(run, photo(1))
    (run / "run.json").write_text("{}")
    changed, deleted = copied(run, photo(2)), copied(run, photo(4))
    (run / stored_image_path(changed["sha256"])).write_bytes(photo(3))  # replaced after the set was built
    (run / stored_image_path(deleted["sha256"])).unlink()
    gone = image_part(hashlib.sha256(b"x").hexdigest(), "image/png", 8, 8, 1, path=str(tmp_path / "moved.png"))
    items = [item("good", ask(good, text_part("What is it?"))), item("changed", ask(changed, text_part("And?"))),
             item("deleted", ask(deleted)), item("gone", ask(text_part("This?"), gone))]
    done, bodies = run_items({}, SGLangAdapter(version="0.5.23"), run, items)
    assert done["good"].kind == DONE
    for name, part in (("changed", changed), ("deleted", deleted), ("gone", gone)):
        outcome = done[name]
        assert outcome.kind == TERMINAL and part["sha256"] in outcome.message and outcome.attempts == 1, outcome
    assert f"now holds {len(photo(3))} bytes of sha256 {hashlib.sha256(photo(3)).hexdigest()}" in \
        done["changed"].message and str(run / stored_image_path(changed["sha256"])) in done["changed"].message
    assert "is gone" in done["deleted"].message and str(run / stored_image_path(deleted["sha256"])) in \
        done["deleted"].message
    assert "is gone" in done["gone"].message and str(tmp_path / "moved.png") in done["gone"].message
    assert len(bodies) == 1 and data_url_bytes(image_urls(bodies[0])[0]["url"]) == photo(1), "only the good one"


def test_a_node_that_does_not_see_the_run_directory_leaves_the_prompts_to_others(tmp_path):
    """A local run directory, an actor on another node: no copied image is there, nor run.json. Not the prompt's
    fault: the endpoint's actor goes fatal (with why) and the prompt is returned unsent, no attempt counted."""
    part = copied(tmp_path / "driver-node" / "run", photo(1))
    done, bodies = run_items({}, SGLangAdapter(version="0.5.23"), tmp_path / "elsewhere" / "run",
                             [item("p", ask(part))])
    assert done["p"].kind == ENDPOINT_FATAL and done["p"].attempts == 0 and not bodies
    assert "is not visible from this actor's node" in done["p"].message


def test_file_url_is_refused_up_front_for_a_run_on_an_object_store():
    check_send_as("file_url", "copy", "/runs/r")  # a filesystem: the servers may mount it
    check_send_as("data_url", "copy", "s3://bucket/runs/r?endpoint_override=127.0.0.1:9")
    with pytest.raises(ConfigError, match="set images.send_as: data_url"):
        check_send_as("file_url", "copy", "s3://bucket/runs/r?endpoint_override=127.0.0.1:9")


def test_file_url_sends_where_the_bytes_are_after_checking_them(tmp_path):
    run = tmp_path / "run dir"
    copy = copied(run, photo(1))
    referenced = tmp_path / "coco" / "a b.jpg"
    referenced.parent.mkdir()
    referenced.write_bytes(photo(2, kind="JPEG"))
    ref = image_part(hashlib.sha256(referenced.read_bytes()).hexdigest(), "image/jpeg", 64, 48,
                     referenced.stat().st_size, path=str(referenced))
    done, [body] = run_items({}, SGLangAdapter(version="0.5.23"), run, [item("p", ask(copy, ref))],
                             images_send_as="file_url")
    assert done["p"].kind == DONE
    urls = [u["url"] for u in image_urls(body)]
    assert urls == [(run / stored_image_path(copy["sha256"])).as_uri(), referenced.as_uri()]
    assert "%20" in urls[0], "the path is percent-encoded: SGLang unquotes it"


def test_all_turns_resends_the_image_each_step_reading_it_once_per_conversation(tmp_path):
    run = tmp_path / "run"
    part = copied(run, photo(1))
    conversation = ask(part, text_part("Describe it.")) + [{"role": "assistant", "content": "A gradient."},
                                                           {"role": "user", "content": "Shorter."}]
    done, bodies = run_items({}, SGLangAdapter(version="0.5.23"), run, [item("p", conversation)], mode="all_turns")
    assert done["p"].kind == DONE and len(bodies) == 2
    assert all(data_url_bytes(image_urls(b)[0]["url"]) == photo(1) for b in bodies), "every step carries the image"
    reads = []
    images = ConversationImages(str(run), reader=lambda uri, p: reads.append(p["sha256"]) or photo(1))
    first, second = images.messages(conversation[:1]), images.messages(conversation)
    assert first[0]["content"][0] == second[0]["content"][0] and reads == [part["sha256"]], "read once"
    ConversationImages(str(run), reader=lambda uri, p: reads.append(p["sha256"]) or photo(1)).messages(conversation)
    assert len(reads) == 2, "nothing is kept across conversations"
