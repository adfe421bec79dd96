"""A real vision-language engine: one vLLM server (its CPU build) of a tiny Kimi-K2.5 with random weights
(pipeline/tools/make_tiny_vlm.py, `make vlm`), asked OpenAI chat requests with `image_url` parts holding
scikit-image's photographs. vLLM's own Kimi-K2.5 processor expands each image's one `<|media_pad|>` into as many
as its vision tower yields; the expected count comes from that processor's own code, run in vLLM's venv.
The server is started for the module and stopped when it ends (about 4 GB: it shares the real-vLLM worker,
tests/conftest.py). What it answers to URLs it cannot use (a file outside --allowed-local-media-path, a missing
file, an http URL that 404s, a data: URL that is no image) is pinned here, exactly, with regen's classification."""
from __future__ import annotations

import asyncio
import base64
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.tools.make_tiny_vlm import DEFAULT_OUT
from tests.helpers import free_port, require_installed

pytestmark = [pytest.mark.vllm, pytest.mark.vlm]

ALIAS = "tiny-kimi-k25"
SKIMAGE_DATA = Path.home() / ".cache/regen/skimage-0.26.0/skimage/data"  # `make vlm` (REGEN_SKIMAGE_DATA)
PHOTOS = {"chelsea.png": "image/png", "rocket.jpg": "image/jpeg"}  # 451x300 and 640x427
ASK = {"type": "text", "text": "What is in this picture?"}
# vLLM detects Kimi's template (content rendered by a macro over the message) as the 'string' content format: it
# puts each image's placeholder before the text, joined by a newline.
PROMPT = ("<|im_user|>user<|im_middle|>{media}What is in this picture?<|im_end|>"
          "<|im_assistant|>assistant<|im_middle|><think>")
MEDIA = "<|media_begin|>image<|media_content|>{pads}<|media_end|>\n"
# The count of <|media_pad|> of each photo, by vLLM's own processor (the fused CPU one the server logs it uses),
# from the model folder's preprocessor_config.json.
COUNT_SCRIPT = """
import json, sys
from PIL import Image
from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor
processor = KimiK25FusedVisionProcessor.from_pretrained(sys.argv[1])
print(json.dumps({path: processor.media_tokens_calculator({"type": "image", "image": Image.open(path)})
                  for path in sys.argv[2:]}))
"""


def tiny_vlm_dir() -> Path:
    return Path(os.environ.get("REGEN_VLM_MODEL") or DEFAULT_OUT)


def photo_dir() -> Path:
    return Path(os.environ.get("REGEN_SKIMAGE_DATA") or SKIMAGE_DATA)


def session_rss_mib(leader: int) -> float:
    import psutil

    total = 0
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == os.getsid(leader):
                total += proc.memory_info().rss
        except (psutil.Error, OSError):
            continue
    return total / 2**20


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """The server (one core, float32, eager, CPU_MLA: the AMX MLA kernel takes bf16 only) with file:// URLs
    allowed under one temp folder holding chelsea.png; the processor's counts, computed while it starts."""
    from pipeline.core.config import LocalFleet
    from pipeline.endpoints.localfleet import LocalFleetProcesses, vllm_python

    model, photos = tiny_vlm_dir(), photo_dir()
    if not vllm_python().exists() or not (model / ".complete").exists() or \
            not all((photos / name).exists() for name in PHOTOS):
        require_installed(f"vLLM's venv ({vllm_python()}), the tiny VLM ({model}) or the photos ({photos})")
    media = tmp_path_factory.mktemp("vlm-media")
    shutil.copy(photos / "chelsea.png", media)
    fleet = LocalFleet(engine="vllm", servers=1, base_port=free_port(), slots=2, ctx_per_slot=4096, threads=1,
                       model_path=str(model), model_alias=ALIAS, attention_backend="CPU_MLA",
                       allowed_local_media_path=str(media),
                       extra_args=["--enable-scale-out"])  # vLLM 0.32 answers /v1/chat/completions/render 403 without it
    url = fleet.endpoints()[0].url
    processes = LocalFleetProcesses(fleet, tmp_path_factory.mktemp("vlm-logs"))
    log = processes.log_path(fleet.base_port)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    counter = subprocess.Popen([str(vllm_python()), "-c", COUNT_SCRIPT, str(model), *(str(photos / n) for n in PHOTOS)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    started = time.monotonic()
    try:
        processes.start()  # the fleet's own launch: the typed fields give --attention-backend and the media path
        ready_s = time.monotonic() - started
        out, err = counter.communicate(timeout=300)
        assert counter.returncode == 0, err[-3000:]
    except BaseException:
        counter.kill()
        processes.stop()
        raise
    counts = {Path(path).name: n for path, n in json.loads(out).items()}
    print(f"\ntiny Kimi-K2.5 vLLM server ready in {ready_s:.1f}s, {session_rss_mib(processes.processes[0].pid):.0f} "
          f"MiB resident; <|media_pad|> per photo: {counts}")
    config = json.loads((model / "config.json").read_text())
    specials = {t["content"]: int(i) for i, t in
                json.loads((model / "tokenizer_config.json").read_text())["added_tokens_decoder"].items()}
    yield SimpleNamespace(url=url, model=model, photos=photos, media=media, log=log, counts=counts,
                          pad=config["image_token_id"], specials=specials)
    processes.stop()


@pytest.fixture(scope="module")
def tokenizer(vlm):
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_file(str(vlm.model / "tokenizer.json"))


def data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def post(vlm, content: list[dict], **fields) -> tuple[int, dict]:
    body = {"model": ALIAS, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0.0,
            "return_token_ids": True, **fields}
    request = urllib.request.Request(f"{vlm.url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def expected_ids(tokenizer, pads: int | None) -> list[int]:
    media = "" if pads is None else MEDIA.format(pads="<|media_pad|>" * pads)
    return tokenizer.encode(PROMPT.format(media=media), add_special_tokens=False).ids


def test_each_photo_expands_to_the_processors_count_of_media_pads(vlm, tokenizer):
    assert vlm.pad == vlm.specials["<|media_pad|>"] == 163605, "Kimi's id"
    assert "Using fused CPU image preprocessing" in vlm.log.read_text(), "the processor the counts were taken from"
    assert len(set(vlm.counts.values())) == len(PHOTOS), f"photos of different sizes, different counts: {vlm.counts}"
    status, text_only = post(vlm, [ASK])
    assert status == 200, text_only
    assert text_only["prompt_token_ids"] == expected_ids(tokenizer, None)
    assert vlm.pad not in text_only["prompt_token_ids"]
    for name, mime in PHOTOS.items():
        status, body = post(vlm, [ASK, image(data_url(vlm.photos / name, mime))])
        assert status == 200, body
        ids = body["prompt_token_ids"]
        assert ids.count(vlm.pad) == vlm.counts[name], name
        assert ids == expected_ids(tokenizer, vlm.counts[name]), "one block of pads, before the text"
        assert body["usage"]["prompt_tokens"] == len(ids)
        [choice] = body["choices"]
        assert isinstance(choice["message"]["content"], str) and 0 < len(choice["token_ids"]) <= 8, choice
        assert body["usage"]["completion_tokens"] == len(choice["token_ids"])


def test_regens_client_reads_an_image_prompts_ids_streamed_and_not(vlm):
    from pipeline.endpoints.client import ClientSettings, EndpointClient
    from pipeline.endpoints.engines import VLLMAdapter

    messages = [{"role": "user", "content": [ASK, image(data_url(vlm.photos / "rocket.jpg", "image/jpeg"))]}]

    async def ask(stream: bool):
        client = EndpointClient(vlm.url, "vlm", ClientSettings(
            model=ALIAS, temperature=0.0, top_p=1.0, max_tokens=8, stream=stream,
            engines={"vlm": VLLMAdapter(version="0.32.0")}))
        try:
            return await client.chat(messages, None)
        finally:
            await client.close()

    plain, streamed = asyncio.run(ask(False)), asyncio.run(ask(True))
    assert plain.prompt_token_ids.count(vlm.pad) == vlm.counts["rocket.jpg"]
    assert streamed.prompt_token_ids == plain.prompt_token_ids
    assert streamed.output_token_ids == plain.output_token_ids and 0 < len(plain.output_token_ids) <= 8
    assert plain.prompt_tokens == len(plain.prompt_token_ids)


def error(message: str, kind: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def regen_class(status: int, body: dict) -> str:
    from pipeline.endpoints.classify import classify
    from pipeline.endpoints.engines import VLLMAdapter

    return type(classify(status, body["error"]["message"], engine=VLLMAdapter(version="0.32.0"))).__name__


def test_file_urls_only_under_the_allowed_local_media_path(vlm):
    """Inside the folder: the same ids as the photo sent as data. Outside it: 400, on which regen stops using the
    endpoint (ContractError: every file:// image of the run would be refused). A missing file inside: 500 (an
    internal error to vLLM), which regen retries. (A server without the flag answers any file:// URL with 500
    "Cannot load local files without `--allowed-local-media-path`.": seen by hand, not started here.)"""
    status, by_file = post(vlm, [ASK, image((vlm.media / "chelsea.png").as_uri())])
    assert status == 200, by_file
    _, by_data = post(vlm, [ASK, image(data_url(vlm.photos / "chelsea.png", "image/png"))])
    assert by_file["prompt_token_ids"] == by_data["prompt_token_ids"]
    assert by_file["prompt_token_ids"].count(vlm.pad) == vlm.counts["chelsea.png"]
    outside = post(vlm, [ASK, image((vlm.photos / "rocket.jpg").as_uri())])
    assert outside == (400, error("The file path <path> must be a subpath of `--allowed-local-media-path <path>`.",
                                  "BadRequestError", 400))
    missing = post(vlm, [ASK, image((vlm.media / "absent.png").as_uri())])
    assert missing == (500, error("[Errno 2] No such file or directory: '<path>'", "InternalServerError", 500))
    assert (regen_class(*outside), regen_class(*missing)) == ("ContractError", "Retryable")


class NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_an_http_url_that_404s_and_a_data_url_that_is_no_image(vlm):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        missing = f"http://127.0.0.1:{server.server_address[1]}/missing.png"
        fetched = post(vlm, [ASK, image(missing)])
    finally:
        server.shutdown()
        server.server_close()
    assert fetched == (422, error(f"Failed to fetch media from URL: HTTP 404 error (parameter=image_url, value="
                                  f"{missing})", "UnprocessableEntityError", 422, "image_url"))
    not_an_image = post(vlm, [ASK, image("data:text/plain;base64," + base64.b64encode(b"no image").decode())])
    assert not_an_image == (400, error("Failed to load image: cannot identify image file <_io.BytesIO object>",
                                       "BadRequestError", 400))
    assert (regen_class(*fetched), regen_class(*not_an_image)) == ("TerminalForPrompt", "TerminalForPrompt")
    status, body = post(vlm, [ASK, image(data_url(vlm.photos / "chelsea.png", "image/png"))])
    assert status == 200 and body["prompt_token_ids"].count(vlm.pad) == vlm.counts["chelsea.png"], "still serving"


def test_models_and_version(vlm):
    with urllib.request.urlopen(f"{vlm.url}/v1/models", timeout=30) as response:
        [model] = json.load(response)["data"]
    assert (model["id"], model["owned_by"], model["root"], model["max_model_len"]) == \
        (ALIAS, "vllm", str(vlm.model), 4096), model
    with urllib.request.urlopen(f"{vlm.url}/version", timeout=30) as response:
        assert json.load(response) == {"version": "0.32.0"}


def test_regen_generate_commits_image_records_holding_the_processors_count_of_media_pads(vlm, tokenizer, tmp_path,
                                                                                        ray_cluster):
    """The real command on this server: an OpenAI-messages source of the photos (by path, beside a text prompt) is
    regenerated, and each record's prompt ids are the server's, as the processor expands them. Its `speculators`
    export holds no image row: random weights never stop, every answer is cut at max_tokens, and that export drops
    cut image conversations (speculators renders them, with an end of turn after the reply; --keep-truncated is
    specforge's and torchspec's), while a cut text record stays a pre-tokenized row.
    speculators' own preprocessing of image rows with this server as its render endpoint: the next test."""
    import hashlib

    import orjson
    import pyarrow.parquet as pq

    from pipeline.export.jsonl import images_path
    from tests.helpers import run_regen, write_config

    asks = {name: [{"type": "image_url", "image_url": {"url": str(vlm.photos / name)}}, ASK] for name in PHOTOS}
    records = [{"messages": [{"role": "user", "content": content}]} for content in asks.values()]
    records.append({"messages": [{"role": "user", "content": [ASK]}]})  # text parts only: a text prompt
    (tmp_path / "photos.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    spec = tmp_path / "photos.yaml"  # the photos are outside the data file's folder: image_root says where
    spec.write_text(json.dumps({"name": "photos", "kind": "jsonl", "path": str(tmp_path / "photos.jsonl"),
                                "format": "openai", "image_root": str(vlm.photos)}))
    config = write_config(tmp_path, [{"url": vlm.url, "name": "tiny-vlm", "concurrency": 2}], [spec], model=ALIAS,
                          return_token_ids=True, output_dir=str(vlm.media / "regen-out"))
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "selected 3" in result.stderr, result.stderr
    run = vlm.media / "regen-out" / "t"
    rows = [r for p in sorted((run / "data").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert len(rows) == len({r["prompt_id"] for r in rows}) == len(records)
    by_image = {}
    names = {hashlib.sha256((vlm.photos / name).read_bytes()).hexdigest(): name for name in PHOTOS}
    for row in rows:
        [message] = row["messages"]
        shas = [p["sha256"] for p in message["parts"] if p["type"] == "image"]
        by_image[names[shas[0]] if shas else None] = row["prompt_token_ids"]
    assert set(by_image) == {*PHOTOS, None}
    for name in PHOTOS:
        assert by_image[name].count(vlm.pad) == vlm.counts[name], name
        assert by_image[name] == expected_ids(tokenizer, vlm.counts[name]), name
    assert by_image[None] == expected_ids(tokenizer, None)

    out = tmp_path / "speculators.jsonl"
    exported = run_regen("export", str(run), "--format", "speculators", "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    assert all(r["finish_reason"] == "length" for r in rows)
    # the text record stays a pre-tokenized row (its last position masked out); the cut image conversations go
    assert re.search(r"dropped: truncated\s+2$", exported.stderr, re.M), exported.stderr
    assert not images_path(out).exists() and len(out.read_text().splitlines()) == 1


def test_speculators_prepares_the_image_rows_of_the_export_with_this_server_as_its_render_endpoint(vlm, tokenizer):
    """The `speculators` export of an image run (tests/image_records.py), its image rows through speculators' own
    `_preprocess_batch` (tests/trainlib_checks.py) with this server as `--render-endpoint`: vLLM reads each image
    from the run's folder (under --allowed-local-media-path) and expands it, and speculators trains the reply."""
    import hashlib

    from pipeline.core.images import image_part
    from pipeline.export.jsonl import export_run, images_path
    from tests.image_records import image_record, user, write_run
    from tests.trainlib import run_checks

    data = (vlm.photos / "chelsea.png").read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    run_path = vlm.media / "speculators-run"  # the run inside the folder the server may read
    (run_path / "images" / sha[:2]).mkdir(parents=True)
    (run_path / "images" / sha[:2] / sha).write_bytes(data)
    cat = image_part(sha, "image/png", 451, 300, len(data))
    records = [image_record("v-img", 0, [user(cat, "What is in this picture?")], "A cat on a table.",
                            source_ref="coco-1"),
               image_record("v-text", 0, [user("Say hello")], "Hello.", source="chat")]
    run = write_run(run_path, "last_turn", [records])
    out = vlm.media / "spec.jsonl"
    assert export_run(run.path, "speculators", out).image_rows == 1
    got = run_checks({"check": "speculators_image_rows", "render_endpoint": vlm.url,
                      "exports": [{"rows": str(out), "images": str(images_path(out))}]})["exports"][0]
    assert len(got["images"]["rows"]) == 1, got["log"]
    ids, mask = got["images"]["rows"][0]["input_ids"], got["images"]["rows"][0]["loss_mask"]
    assert ids.count(vlm.pad) == vlm.counts["chelsea.png"], "vLLM read the run's file and expanded the image"
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert "A cat on a table." in trained and not any(mask[:ids.index(vlm.pad) + 1]), trained
    assert len(got["rows"]["rows"]) == 1  # the text record: its pre-tokenized row, passed through
