"""Image prompts and the fleet (issue 28, SEND): the preflight refuses a prompt set with images on a server that
cannot take them, before the first prompt, naming the endpoint and the launch fix (SGLang: /model_info
has_image_understanding; a server that does not say: the tiny image probe; llama.cpp: never), a readmitted endpoint
too; what needs images (the prompt set's messages); and max_prompt_tokens counting images (a budget, or Kimi-K2.5's
exact count from the image's size, checked against vLLM's own processor code).

The engines' refusals are their own texts, read from the SGLang wheel and the vLLM venv (the real text-only vLLM
is refused in test_vllm_engine.py); the SGLang emulator is a text-only model; the rest is a stand-in server."""
from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.core.config import RunConfig
from pipeline.core.errors import ContractError, PreflightError
from pipeline.dispatch.needs import has_images
from pipeline.dispatch.worker import EndpointWorker
from pipeline.emulator import start_emulator
from pipeline.endpoints.classify import classify
from pipeline.endpoints.client import ClientSettings
from pipeline.endpoints.engines import SGLangAdapter, VLLMAdapter
from pipeline.endpoints.preflight import preflight_async
from pipeline.endpoints.preflight_table import render_table
from pipeline.prompts.image_tokens import image_token_counter, navit_tokens
from pipeline.prompts.records import InvalidRecord, RejectCode
from pipeline.prompts.tokens import PromptLength
from pipeline.store.prompt_reader import PromptSetReader
from pipeline.store.storage import Location
from tests.conformance.sglang_source import render, templates_with
from tests.image_servers import MODEL, StandIn, image_urls
from tests.test_image_requests import SGLANG_CACHE
from tests.test_vllm_conformance import vllm_env

SGLANG_TEXT_ONLY = "Model only supports text input; received unsupported content type"


def run_config(*urls: str, **overrides) -> RunConfig:
    return RunConfig.model_validate({"run_name": "t", "model": MODEL, "sources": [{"spec": "u.yaml"}],
                                     "endpoints": [{"url": u} for u in urls], "sampling": {"max_tokens": 24},
                                     "dead_fleet_deadline_s": 5, **overrides})


def with_stand_in(check, **options):
    """`check(server)` (a coroutine) against a stand-in started for it."""
    async def main():
        server = await StandIn(**options).start()
        try:
            return await check(server), server.bodies
        finally:
            await server.stop()

    return asyncio.run(main())


async def refusal(cfg: RunConfig) -> str:
    with pytest.raises(PreflightError) as refused:
        await preflight_async(cfg, {}, announce=False, images=True)
    return str(refused.value)


def wheel_text(version: str, phrase: str) -> str:
    root = SGLANG_CACHE / version
    if not (root / ".installed").exists():
        pytest.skip(f"SGLang {version} is not unpacked: run `make sglang-wheels`")
    [template] = [t for t in templates_with(root, ("sglang/srt/entrypoints/openai/serving_chat.py",), phrase)
                  if "\x00" in t]
    return render(template, "image_url")


# --- SGLang -------------------------------------------------------------------------------------------------------
def test_an_images_run_is_refused_on_a_text_only_sglang_naming_the_endpoint_and_the_fix():
    server = start_emulator(preset="plain")  # a text-only model: has_image_understanding false
    try:
        cfg = run_config(server.url)
        [report] = asyncio.run(preflight_async(cfg, {}, announce=False))  # text prompts: nothing to refuse
        assert report.ok and report.images is False
        assert render_table([report], cfg).splitlines()[1].split()[-1] == "no"
        message = asyncio.run(refusal(cfg))
    finally:
        server.stop()
    line = next(line for line in message.splitlines() if server.url.split("://")[1] in line)
    assert "the prompt set has images" in line and "has_image_understanding: false" in line
    assert "--language-model-only" in line and "vision-language model" in line


def test_sglang_reporting_image_understanding_is_admitted_without_a_probe():
    async def check(server):
        return await preflight_async(run_config(server.url), {}, announce=False, images=True)

    [report], bodies = with_stand_in(check, has_image_understanding=True)
    assert report.ok and report.images is True and not any(image_urls(b) for b in bodies)
    assert render_table([report], run_config("http://x")).splitlines()[1].split()[-1] == "yes"


def test_a_server_that_does_not_say_gets_the_tiny_image_probe():
    async def check(server):
        return await preflight_async(run_config(server.url), {}, announce=False, images=True)

    [report], bodies = with_stand_in(check, has_image_understanding=None)
    assert report.ok and report.images is True
    [probe] = [image_urls(b) for b in bodies if image_urls(b)]
    assert probe[0]["url"].startswith("data:image/png;base64,") and probe[0]["content_hash"].startswith("sha256:")
    assert any(b["max_tokens"] == 1 and not image_urls(b) for b in bodies), "its text-only twin"

    async def refused(server):
        return await refusal(run_config(server.url))

    dropped, _ = with_stand_in(refused, has_image_understanding=None, drop_images=True)
    assert "no more than the same text alone" in dropped and "it dropped the image" in dropped
    text = wheel_text("0.5.23", SGLANG_TEXT_ONLY)
    assert type(classify(400, text, engine=SGLangAdapter(version="0.5.23"))) is ContractError
    said, _ = with_stand_in(refused, has_image_understanding=None, refuse_images=text)
    assert "a tiny image request" in said and text in said and "--language-model-only" in said


# --- vLLM, llama.cpp ------------------------------------------------------------------------------------------------
def test_vllm_is_probed_and_refused_with_its_own_text_for_a_text_only_model():
    env = vllm_env()
    [template] = [t for t in templates_with(env.root, ("vllm/multimodal/registry.py",), "is not a multimodal model")
                  if "\x00" in t]
    text = render(template, MODEL)  # what a text-only model answers an image part with (create_processor)
    assert type(classify(400, text, engine=VLLMAdapter(version="0.32.0"))) is ContractError

    async def refused(server):
        return await refusal(run_config(server.url))

    message, bodies = with_stand_in(refused, engine="vllm", version="0.32.0", refuse_images=text)
    assert f"{MODEL} is not a multimodal model" in message and "vision-language model" in message
    assert "--allowed-local-media-path" in message and any(image_urls(b) for b in bodies)

    async def admitted(server):
        return await preflight_async(run_config(server.url), {}, announce=False, images=True)

    [report], _ = with_stand_in(admitted, engine="vllm", version="0.32.0")
    assert report.ok and report.images is True


def test_llamacpp_is_refused_for_images_without_a_request():
    async def refused(server):
        return await refusal(run_config(server.url))

    message, bodies = with_stand_in(refused, engine="llamacpp")
    assert "regen's llama.cpp fleet serves text only" in message and "mmproj" in message
    assert not any(image_urls(b) for b in bodies)


def test_a_readmitted_endpoint_must_take_images_too():
    server = start_emulator(preset="plain")
    try:
        cfg = run_config(server.url)
        settings = ClientSettings(model=MODEL, temperature=0.0, top_p=1.0, max_tokens=8, needs_images=True)
        w = EndpointWorker(server.url, server.url.split("://")[1], 1, settings, readmission=cfg)
        assert asyncio.run(w._passes_preflight()) is False
        assert "has_image_understanding: false" in w.last_error
        asyncio.run(w.close())
    finally:
        server.stop()


# --- what needs images -------------------------------------------------------------------------------------------
PART = pa.struct([("type", pa.string()), ("text", pa.string()), ("sha256", pa.string()), ("width", pa.int32())])
MESSAGE6 = pa.struct([("role", pa.string()), ("content", pa.string()), ("parts", pa.list_(PART))])
MESSAGE5 = pa.struct([("role", pa.string()), ("content", pa.string())])


def prompt_set(path: Path, rows: list, message=MESSAGE6) -> PromptSetReader:
    schema = pa.schema([("prompt_id", pa.string()), ("messages", pa.list_(message))])
    pq.write_table(pa.table({"prompt_id": [f"p{i}" for i in range(len(rows))], "messages": rows}, schema=schema),
                   path, row_group_size=1)
    return PromptSetReader(Location.at(path))


def test_the_prompt_sets_need_of_images_is_read_from_its_messages(tmp_path):
    text = [{"role": "user", "content": "Hi.", "parts": None}]
    image = [{"role": "user", "content": None, "parts": [{"type": "text", "text": "What?"},
                                                         {"type": "image", "sha256": "ab" * 32, "width": 8}]}]
    only_text_parts = [{"role": "user", "content": None, "parts": [{"type": "text", "text": "Hi."}]}]
    assert has_images(prompt_set(tmp_path / "a.parquet", [text, only_text_parts, image]))
    assert not has_images(prompt_set(tmp_path / "b.parquet", [text, only_text_parts]))
    assert not has_images(prompt_set(tmp_path / "c.parquet", [[{"role": "user", "content": "Hi."}]], MESSAGE5))

    counted = pa.table({"prompt_id": ["a", "b"], "images": pa.array([0, 2], pa.int32())})
    pq.write_table(counted, tmp_path / "d.parquet", row_group_size=1)
    assert has_images(PromptSetReader(Location.at(tmp_path / "d.parquet"))), "the set's own count, no message read"
    pq.write_table(counted.set_column(1, "images", pa.array([0, None], pa.int32())), tmp_path / "e.parquet")
    assert not has_images(PromptSetReader(Location.at(tmp_path / "e.parquet")))

    class Counted:  # the store's reader, if it says so itself: asked, nothing read
        def has_images(self) -> bool:
            return True

    assert has_images(Counted())


# --- max_prompt_tokens -------------------------------------------------------------------------------------------
class Words:
    """A tokenizer without a chat template: a token a word."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [0] * len(text.split())


def image(width: int = 64, height: int = 48) -> dict:
    return {"type": "image", "sha256": "ab" * 32, "media_type": "image/png", "width": width, "height": height,
            "bytes": 100}


def test_max_prompt_tokens_counts_each_image_at_the_budget():
    counter, how = image_token_counter(None, 100)
    assert "images.tokens_per_image (100 an image)" == how
    check = PromptLength(Words(), 300, "words", image_tokens=counter)
    two = ({"role": "user", "content": [image(), {"type": "text", "text": "Compare them."}, image()]},)
    check(two)  # 2 x 100 + a few words
    with pytest.raises(InvalidRecord) as too_long:
        check(({"role": "user", "content": [image(), image(), {"type": "text", "text": "Compare."}, image()]},))
    assert too_long.value.code == RejectCode.TOO_LONG and "its images 300" in str(too_long.value)
    assert check.count(two) == 2 + 200


KIMI_MEDIA_PROC_CFG = {"in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5],
                       "image_std": [0.5, 0.5, 0.5], "merge_kernel_size": 2, "fixed_output_tokens": None,
                       "patch_limit_on_one_side": 512, "temporal_merge_kernel_size": 4}
SIZES = [(8, 8), (640, 480), (1792, 1792), (4000, 3000), (1000, 3000), (100000, 20), (7119, 499), (1, 1)]


def test_kimi_k25_images_are_counted_exactly_as_vllms_own_processor_counts_them(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": KIMI_MEDIA_PROC_CFG}))
    counter, how = image_token_counter(str(tmp_path), 4096)
    assert "NaViT processor (exact" in how
    assert counter(image(4000, 3000)) == navit_tokens(4000, 3000) + 16 == 4216, "over 4,096: padded blocks"
    env = vllm_env()
    script = ("import json, sys\nfrom vllm.transformers_utils.processors.kimi_k25_vision_fused import "
              "navit_resize_image\ncfg = json.loads(sys.argv[1])\nprint(json.dumps([navit_resize_image(w, h, "
              "cfg['patch_size'], cfg['merge_kernel_size'], cfg['in_patch_limit'], cfg['patch_limit_on_one_side'], "
              "cfg['fixed_output_tokens'])['num_tokens'] for w, h in json.loads(sys.argv[2])]))")
    done = subprocess.run([str(env.python), "-c", script, json.dumps(KIMI_MEDIA_PROC_CFG), json.dumps(SIZES)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [navit_tokens(w, h) for w, h in SIZES]
