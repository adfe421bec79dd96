"""Image prompts in the SGLang conformance (tests/test_sglang_conformance.py), run in the version's subprocess
against its emulator (a Kimi-K2.5, so a vision model) with the version's own code (sglang_image_source.py):

- image_tokens: the emulator's placeholder count for many sizes is the wheel's navit_resize_config; an image
  request's prompt_token_ids hold exactly that many of KimiK25Config's media_placeholder_token_id, in one run;
- image_loads: each image URL form (data:, bare base64, http on 127.0.0.1, file://, paths; and the broken ones)
  read by the wheel's own loaders and by the emulator: the same size (its answer names it) or the same error,
  answered with the status and text the wheel's wrapping makes of it (base_processor's and serving_base's texts);
- image_parts: image_url variants (content_hash, detail, shapes) accepted or refused by the version's own
  ChatCompletionRequest exactly when the emulator accepts or refuses them, refusals naming pydantic's message;
- model_info: /model_info has the wheel route's keys, has_image_understanding as ModelConfig decides it.
`drive_images` (in the test process) sends the image requests whose bodies and answers sglang_checks.py checks.
"""
from __future__ import annotations

import hashlib
import json
import re
import socket
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from pipeline.emulator.media import KIMI_K25_MEDIA, MEDIA_PAD, MEDIA_PAD_ID, kimi_image_tokens, mention, SeenImage
from tests.conformance import sglang_image_source as wheel_code
from tests.conformance.sglang_source import function_dict_keys, templates_with
from tests.conformance.sglang_tool_checks import ToolChecker
from tests.image_helpers import ImageServer, data_url, image_chat, image_part, jpeg, png

SIZES = [(1, 1), (13, 200), (28, 28), (29, 29), (64, 32), (100, 50), (640, 480), (1920, 1080), (2400, 1800),
         (7168, 7168), (8000, 100), (100, 8000), (20000, 20000)]
CHAT, BASE = "sglang/srt/entrypoints/openai/serving_chat.py", "sglang/srt/entrypoints/openai/serving_base.py"
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
HASH = "sha256:" + "AB" * 32


def drive_images(url: str, version: str) -> None:
    """Image requests as a run would send them (data: URLs; content_hash where the version declares it), so the
    request and response checks of sglang_checks.py cover their bodies and answers; each must be answered 200."""
    from pipeline.emulator.versions import behaviour

    photo, icon = png(64, 32), jpeg(100, 50)
    extra = {"content_hash": "sha256:" + hashlib.sha256(photo).hexdigest()} if behaviour(version).content_hash else {}
    bodies = [image_chat(image_part(data_url(photo), detail="high", **extra), "What is in this picture?"),
              image_chat("Compare", image_part(data_url(photo)), image_part(data_url(icon, "image/jpeg")), "these."),
              {**image_chat(image_part(data_url(icon, "image/jpeg")), "Describe it."), "stream": True,
               "return_prompt_token_ids": False}]
    for body in bodies:
        request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            answer.read()


def _masked(text: str) -> str:
    return _ADDRESS.sub("0x?", text)


def _fill(template: str, *values: str) -> str:
    for value in values:
        template = template.replace("\x00", value, 1)
    return template


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ImageChecker(ToolChecker):
    def __init__(self, root: Path, emulator: str):
        super().__init__(root, emulator)
        self.navit = wheel_code.navit_resize_config(root)
        self.loaders = wheel_code.loaders(root)
        self.k25 = wheel_code.kimi_k25_config(root)

    def _chat(self, body: dict) -> tuple[int, dict]:
        status, raw = self._http("POST", "/v1/chat/completions", body)
        return status, json.loads(raw)

    def theirs_tokens(self, width: int, height: int) -> int:
        return self.navit(width, height, **KIMI_K25_MEDIA)["num_tokens"]

    def image_checks(self) -> None:
        self.image_tokens()
        with ImageServer({}) as server, tempfile.TemporaryDirectory() as tmp:
            self.image_loads(server, Path(tmp))
        self.image_parts()
        self.model_info()

    # --- the placeholder count --------------------------------------------------------------------------------
    def image_tokens(self) -> None:
        problems = []
        if self.k25.media_placeholder_token_id != MEDIA_PAD_ID:
            problems.append(f"media_placeholder_token_id {self.k25.media_placeholder_token_id}, ours {MEDIA_PAD_ID}")
        if f'image_token="{MEDIA_PAD}"' not in (self.root / wheel_code.K25).read_text():
            problems.append(f"kimi_k25.py's image_token is not {MEDIA_PAD}")
        vision = self.k25.vision_config
        if (vision.patch_size, tuple(vision.merge_kernel_size)) != (KIMI_K25_MEDIA["patch_size"],
                                                                     (KIMI_K25_MEDIA["merge_kernel_size"],) * 2):
            problems.append(f"vision_config patch {vision.patch_size} merge {vision.merge_kernel_size}")
        for width, height in SIZES:
            if kimi_image_tokens(width, height) != self.theirs_tokens(width, height):
                problems.append(f"{width}x{height}: ours {kimi_image_tokens(width, height)}, "
                                f"navit_resize_config {self.theirs_tokens(width, height)}")
        self.report("image_tokens", problems, len(SIZES) + 3)

    def prompt_pads(self, answer: dict, width: int, height: int) -> list[str]:
        ids = answer["choices"][0].get("prompt_token_ids") or []
        want = self.theirs_tokens(width, height)
        first = ids.index(MEDIA_PAD_ID) if MEDIA_PAD_ID in ids else -1
        if ids.count(MEDIA_PAD_ID) != want or ids[first:first + want] != [MEDIA_PAD_ID] * want:
            return [f"{width}x{height}: {ids.count(MEDIA_PAD_ID)} placeholder ids, the wheel expands to {want}"]
        return []

    # --- reading the image ------------------------------------------------------------------------------------
    def cases(self, server: ImageServer, tmp: Path) -> list[tuple[str, dict, bytes | None]]:
        """(name, image_url, the image's bytes when it is one)."""
        small, photo, big = png(64, 32), jpeg(30, 20), png(2400, 1800, (10, 200, 10))
        whole = png(300, 200, (1, 2, 3))
        broken = whole[:len(whole) // 2]
        server.files.update({"/img.png": png(100, 50), "/big.png": big})
        (tmp / "img.png").write_bytes(small)
        (tmp / "img.bin").write_bytes(small)
        urls = [
            ("data_png", data_url(small), small), ("bare_base64", data_url(photo).split(",", 1)[1], photo),
            ("http", server.url("/img.png"), server.files["/img.png"]), ("http_big", server.url("/big.png"), big),
            ("file_url", f"file://{tmp}/img.png", small), ("path", f"{tmp}/img.png", small),
            ("path_no_extension", f"{tmp}/img.bin", small),
            ("bad_base64", "data:image/png;base64,@@@", None), ("not_an_image", data_url(b"hello", "text/plain"), None),
            ("truncated", data_url(broken), None), ("http_404", server.url("/missing.png"), None),
            ("refused", f"http://127.0.0.1:{_closed_port()}/x.png", None), ("missing_file", f"file://{tmp}/no.png", None),
            ("relative_missing", "no-such-image.png", None), ("data_no_comma", "data:image/png;base64", None),
        ]
        return [(name, {"url": url}, data) for name, url, data in urls] + [
            ("bad_base64_with_fields", {"url": "@@@", "detail": "low", "content_hash": HASH, "max_dynamic_patch": 2},
             None)]

    def image_data(self, body: dict) -> Any:
        """The ImageData the version's chat route makes of the body's first part: its ChatCompletionRequest
        parses the request, parser/jinja_template_utils.py fills ImageData from the dumped image_url."""
        obj = self.p.ChatCompletionRequest.model_validate(body).messages[0].model_dump()["content"][0]["image_url"]
        values = {"url": obj["url"], "detail": obj.get("detail") or "auto",
                  "max_dynamic_patch": obj.get("max_dynamic_patch"), "content_hash": obj.get("content_hash"),
                  "max_long_side_pixel": obj.get("max_long_side_pixel")}
        return self.loaders.ImageData(**{k: v for k, v in values.items() if k in self.loaders.ImageData.__dataclass_fields__})

    def wheel_load(self, image_data: Any) -> tuple[Any, Exception | None, Any]:
        """(image size, the error, what _load_single_item shows of the data) as the version's own loaders read it."""
        loaders = self.loaders
        if loaders.read_media_bytes is not None:  # 0.5.23: Kimi reads the bytes first, outside the wrapping try
            try:
                data = loaders.read_media_bytes(image_data.url)
            except Exception as error:  # noqa: BLE001
                return None, error, None
            shown = data
            source = data
        else:
            shown = source = image_data
        try:
            image, _ = loaders.load_image(source)
            image = image.convert("RGB") if image.mode != "RGB" else image
            image.load()
        except Exception as error:  # noqa: BLE001
            return None, error, shown
        return image.size, None, shown

    def template(self, relative: str, phrase: str, fields: int) -> str:
        """The one f-string of a wheel file starting with `phrase` that has `fields` fields."""
        [found] = {t for t in templates_with(self.root, (relative,), phrase)
                   if t.startswith(phrase) and t.count("\x00") == fields}
        return found

    def expected_error(self, error: Exception, shown: Any) -> tuple[int, str]:
        """The status and text the version answers for `error`, by its wrapping (templates read out of the wheel)."""
        loading = self.template(wheel_code.BASE_PROCESSOR, "Error while loading data ", 2)
        occurred = self.template(wheel_code.BASE_PROCESSOR, "An exception occurred while loading ", 3)
        internal = self.template(BASE, "Internal server error: ", 1)
        if shown is None:  # raised outside _load_single_item's try
            inner, value_error = str(error), isinstance(error, ValueError)
        else:
            text = str(shown)
            inner = _fill(loading, text[:100] + "..." if len(text) > 100 else text, str(error))
            value_error = isinstance(error, wheel_code.client_errors(self.root, self.loaders))
        message = _fill(occurred, "IMAGE", "0", inner)
        if value_error and wheel_code.fast_load_keeps_value_error(self.root):
            return 400, message
        return 500, _fill(internal, message)

    def image_loads(self, server: ImageServer, tmp: Path) -> None:
        problems = []
        cases = self.cases(server, tmp)
        for name, image_url, data in cases:
            body = image_chat({"type": "image_url", "image_url": image_url}, "What is in it?")
            size, error, shown = self.wheel_load(self.image_data(body))
            status, answer = self._chat(body)
            if error is None:
                seen = SeenImage(hashlib.sha256(data).hexdigest(), *size)
                content = answer["choices"][0]["message"]["content"] if status == 200 else ""
                if status != 200 or not content.startswith(mention([seen])):
                    problems.append(f"{name}: the wheel reads a {size} image, the emulator answers {status} "
                                    f"{str(answer)[:300]}")
                else:
                    problems += [f"{name}: {p}" for p in self.prompt_pads(answer, *size)]
                continue
            want_status, want = self.expected_error(error, shown)
            got = answer.get("message", "")
            if status != want_status or _masked(got) != _masked(want):
                problems.append(f"{name}: the wheel's loader raises {type(error).__name__}: {error}; the version "
                                f"answers {want_status} {want!r}, the emulator {status} {got!r}")
        self.report("image_loads", problems, len(cases))

    # --- the parts, as the version's models parse them ---------------------------------------------------------
    def image_parts(self) -> None:
        from pydantic import ValidationError

        url = data_url(png(8, 8))
        variants = [
            image_part(url), image_part(url, detail="high"), image_part(url, detail="default"),
            image_part(url, detail="medium"), image_part(url, content_hash=HASH),
            image_part(url, content_hash=HASH.lower().replace("sha256:", "")),
            image_part(url, content_hash="sha256:abcd"), image_part(url, content_hash="sha256:" + "zz" * 32),
            image_part(url, content_hash=42), {"type": "image_url", "image_url": url},
            {"type": "image_url", "image_url": {"detail": "low"}}, {"type": "image", "image": url},
        ]
        problems = []
        for part in variants:
            body = image_chat(part, "What is it?")
            status, answer = self._chat(body)
            try:
                self.p.ChatCompletionRequest.model_validate(body)
                theirs = None
            except ValidationError as exc:  # what the image part's own model says (not the other union members)
                theirs = [e["msg"] for e in exc.errors() if part.get("type") == "image_url" and
                          "ChatCompletionMessageContentImagePart" in e["loc"] and e["loc"][-1] != "type"]
            label = json.dumps(part)[:120]
            if theirs is None and status != 200:
                problems.append(f"{label}: the version parses it, the emulator answers {status} {answer}")
            elif theirs is not None and (status != 400 or answer.get("type") != "Bad Request"):
                problems.append(f"{label}: the version refuses it, the emulator answers {status} {answer}")
            elif theirs and not any(m in answer["message"] for m in theirs):
                problems.append(f"{label}: the emulator says {answer['message']!r}, pydantic {theirs}")
        self.report("image_parts", problems, len(variants))

    # --- /model_info ----------------------------------------------------------------------------------------------
    def model_info(self) -> None:
        http_server = self.root / "sglang/srt/entrypoints/http_server.py"
        keys = function_dict_keys(http_server, "model_info") - {"embedding"}  # only for an embedding model
        _, raw = self._http("GET", "/model_info")
        info = json.loads(raw)
        problems = [f"/model_info keys {sorted(info)}, the wheel's {sorted(keys)}"] if set(info) != keys else []
        source = (self.root / "sglang/srt/configs/model_config.py").read_text()
        archs = source[source.index("multimodal_model_archs = ["):]
        vision = '"KimiK25ForConditionalGeneration"' in archs[:archs.index("]")] and \
            getattr(self.k25, "vision_config", None) is not None
        audio = hasattr(self.k25, "audio_config")
        if (info.get("has_image_understanding"), info.get("has_audio_understanding")) != (vision, audio):
            problems.append(f"has_image/audio_understanding {info.get('has_image_understanding')}, "
                            f"{info.get('has_audio_understanding')}; the wheel's ModelConfig: {vision}, {audio}")
        self.report("model_info", problems, 2)
