"""Image prompts on the emulator (pipeline/emulator/media.py, media_load.py), tested as real processes on
127.0.0.1 with small real images made by Pillow. Faithfulness to each SGLang version's own code is
tests/test_sglang_conformance.py's; here: the emulated Kimi-K2.5 receives the image (its answer names it), counts
its placeholders in the prompt, reads the URL forms a run sends; a text-only model refuses it."""
from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request

import pytest

from pipeline.emulator import expected_chat, make_config, start_emulator
from pipeline.emulator.media import MEDIA_PAD_ID
from tests.image_helpers import ImageServer, data_url, image_chat, image_part, jpeg, png

VERSIONS = ("0.5.14", "0.5.17", "0.5.18", "0.5.23")
QUESTION = "What is in this picture?"


def post(url: str, body: dict) -> tuple[int, dict | bytes]:
    """(status, the JSON answer; the raw bytes of a stream)."""
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            data = answer.read()
            return answer.status, data if body.get("stream") else json.loads(data)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def seen(data: bytes, width: int, height: int) -> str:
    return f"I see an image ({width}x{height}, sha256 {sha(data)[:16]})."


@pytest.fixture(scope="module")
def servers():
    """server(preset, version): one emulator each, started when first asked for."""
    started: dict[tuple[str, str], object] = {}

    def server(preset: str = "kimi", version: str = "0.5.23"):
        if (preset, version) not in started:
            started[preset, version] = start_emulator(preset=preset, sglang_version=version, enable_cache_report=True)
        return started[preset, version]

    yield server
    for process in started.values():
        process.stop()


def test_the_answer_names_the_image_it_received(servers):
    kimi = servers()
    red, blue = png(64, 32, (220, 20, 20)), png(64, 32, (20, 20, 220))
    contents = []
    for image in (red, blue, red):
        body = image_chat(image_part(data_url(image)), QUESTION)
        status, answer = post(kimi.url, body)
        assert status == 200, answer
        content = answer["choices"][0]["message"]["content"]
        assert content.startswith(seen(image, 64, 32)) and content == expected_chat(
            body, make_config(preset="kimi"))["content"]
        contents.append(content)
    assert contents[0] != contents[1] and contents[0] == contents[2]  # another image, another answer
    status, stream = post(kimi.url, {**image_chat(image_part(data_url(blue)), QUESTION), "stream": True,
                                     "return_prompt_token_ids": False})
    deltas = [json.loads(line[6:]) for line in stream.decode().splitlines() if line.startswith("data: {")]
    assert status == 200 and "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas
                                     if d["choices"]) == contents[1]


def test_prompt_tokens_grow_with_the_image(servers):
    """Kimi-K2.5's processor: a pad per 28x28 block of the image (14-pixel patches merged 2x2), in the prompt ids
    between <|media_content|> and <|media_end|>; four more tokens mark the image."""
    kimi = servers()
    _, plain = post(kimi.url, image_chat(QUESTION))
    base = plain["usage"]["prompt_tokens"]
    for (width, height), pads in (((28, 28), 1), ((100, 60), 12), ((400, 300), 165)):
        status, answer = post(kimi.url, image_chat(image_part(data_url(png(width, height))), QUESTION))
        ids = answer["choices"][0]["prompt_token_ids"]
        assert status == 200 and ids.count(MEDIA_PAD_ID) == pads, (width, height)
        start = ids.index(MEDIA_PAD_ID)
        assert ids[start - 1] == 163603 and ids[start:start + pads] == [MEDIA_PAD_ID] * pads and \
            ids[start + pads] == 163604
        assert answer["usage"]["prompt_tokens"] == len(ids) == base + 4 + pads
    _, two = post(kimi.url, image_chat(image_part(data_url(png(28, 28))), image_part(data_url(jpeg(100, 60))),
                                       QUESTION))
    assert two["usage"]["prompt_tokens"] == base + 8 + 1 + 12
    assert two["choices"][0]["message"]["content"].startswith(seen(png(28, 28), 28, 28) + " " +
                                                              seen(jpeg(100, 60), 100, 60))


def test_another_image_of_the_same_size_is_not_a_cache_hit(servers):
    """SGLang's radix cache keys an image's pads on the image: only the text before it is shared."""
    kimi = servers()
    first, second = png(56, 56, (1, 1, 1)), png(56, 56, (2, 2, 2))
    cached = []
    for image in (first, second, first):
        _, answer = post(kimi.url, image_chat("Look:", image_part(data_url(image)), QUESTION))
        cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        prompt = answer["choices"][0]["prompt_token_ids"]
    assert cached[1] == prompt.index(MEDIA_PAD_ID) < cached[2] == len(prompt) - 1


@pytest.mark.parametrize("version", VERSIONS)
def test_a_text_only_model_refuses_an_image(servers, version):
    """`plain` is a text-only model: 0.5.17+ answers an image 400 with SGLang's text; 0.5.14 has no such check
    and ignores the image (the prompt is the text alone). /model_info says which model reads images."""
    plain, kimi = servers("plain", version), servers("kimi", version)
    status, answer = post(plain.url, image_chat(image_part(data_url(png(8, 8))), QUESTION))
    if version == "0.5.14":
        _, text_only = post(plain.url, image_chat(QUESTION))
        assert status == 200 and answer["choices"][0]["message"] == text_only["choices"][0]["message"]
    else:
        assert (status, answer["type"]) == (400, "BadRequestError")
        assert answer["message"] == "Model only supports text input; received unsupported content type 'image_url'."
    for server, vision in ((plain, False), (kimi, True)):
        with urllib.request.urlopen(server.url + "/model_info", timeout=10) as info:
            assert json.loads(info.read())["has_image_understanding"] is vision


def test_images_over_http_from_files_and_paths(servers, tmp_path):
    """What a run sends besides data: URLs: http(s) (fetched from 127.0.0.1 only), file:// and absolute paths.
    A missing image is 500 on 0.5.23 (requests' error is not a ValueError there) and 400 on 0.5.18."""
    on_disk = png(50, 20, (9, 9, 9))
    (tmp_path / "b.png").write_bytes(on_disk)
    with ImageServer({"/a.png": png(40, 30)}) as site:
        for url, data, size in ((site.url("/a.png"), site.files["/a.png"], (40, 30)),
                                (f"file://{tmp_path}/b.png", on_disk, (50, 20)),
                                (str(tmp_path / "b.png"), on_disk, (50, 20))):
            status, answer = post(servers().url, image_chat(image_part(url), QUESTION))
            assert status == 200 and answer["choices"][0]["message"]["content"].startswith(seen(data, *size)), url
        for version, want in (("0.5.23", 500), ("0.5.18", 400)):
            status, answer = post(servers("kimi", version).url, image_chat(image_part(site.url("/gone.png")), QUESTION))
            assert status == want and "404 Client Error: Not Found for url: " + site.url("/gone.png") in \
                answer["message"], (version, answer)
    status, answer = post(servers().url, image_chat(image_part("http://example.com/cat.png"), QUESTION))
    assert status == 500 and "fetches images only from 127.0.0.1" in answer["message"]


@pytest.mark.parametrize("version", VERSIONS)
def test_content_hash_as_each_version_reads_it(servers, version):
    """image_url.content_hash ("sha256:" + 64 hex digits) is declared from 0.5.18 and checked for its form only
    (Kimi-K2.5's processor does not compare it with the bytes); before, it is an unknown key, ignored."""
    kimi, image = servers("kimi", version), png(16, 16)
    for content_hash in ("sha256:" + sha(image).upper(), "sha256:" + "0" * 64):
        status, answer = post(kimi.url, image_chat(image_part(data_url(image), content_hash=content_hash), QUESTION))
        assert status == 200 and answer["choices"][0]["message"]["content"].startswith(seen(image, 16, 16))
    status, answer = post(kimi.url, image_chat(image_part(data_url(image), content_hash=sha(image)), QUESTION))
    if version in ("0.5.14", "0.5.17"):
        assert status == 200
    else:
        assert (status, answer["type"]) == (400, "Bad Request")
        assert "content_hash must use the form 'sha256:<64 hex digits>'" in answer["message"]
