"""A stand-in server for the image tests: on 127.0.0.1, shaped as SGLang, vLLM or llama.cpp answer regen's
information requests and chats, recording every chat body (images included) until the emulator takes images.

What it says about images is set per server: SGLang's /model_info `has_image_understanding` (or no such field),
the 400 a text-only model answers image parts with (the engine's own text, read from its code by the tests), or an
answer that drops the image (its prompt counts no placeholder). An answer's prompt ids are one id per word of the
request's texts and PLACEHOLDERS ids of IMAGE_ID per image, as a multimodal processor expands them.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pipeline.endpoints.engines import SGLangAdapter

MODEL = "moonshotai/Kimi-K2.5"
IMAGE_ID, PLACEHOLDERS = 163605, 6  # Kimi's <|media_pad|>, and a small expansion


def image_urls(body: dict) -> list[dict]:
    """The `image_url` objects of a chat body, in order."""
    return [part["image_url"] for m in body.get("messages", []) if isinstance(m.get("content"), list)
            for part in m["content"] if part.get("type") == "image_url"]


def data_url_bytes(url: str) -> bytes:
    head, _, payload = url.partition(",")
    assert head.startswith("data:") and head.endswith(";base64"), head
    return base64.b64decode(payload)


@dataclass
class StandIn:
    engine: str = "sglang"  # sglang | vllm | llamacpp
    version: str = "0.5.23"
    has_image_understanding: bool | None = True  # SGLang's /model_info field; None: the field is absent
    refuse_images: str | None = None  # the 400 text a text-only model answers image parts with
    drop_images: bool = False  # answers image parts as if they were not there
    bodies: list[dict] = field(default_factory=list)
    url: str = ""
    _runner: Any = None

    async def start(self) -> "StandIn":
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        if self.engine == "sglang":
            app.router.add_get("/model_info", self._model_info)
            app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/version", self._version)
        app.router.add_get("/props", self._props)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()

    @property
    def label(self) -> str:
        return self.url.split("://", 1)[1]

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": self.engine,
                                                              "max_model_len": 65536}]})

    async def _version(self, request: web.Request) -> web.Response:  # vLLM's
        return web.json_response({"version": self.version})

    async def _props(self, request: web.Request) -> web.Response:  # llama.cpp's (xllamacpp's /props says so)
        return web.json_response({"build_info": "b0-unknown", "modalities": {"vision": False}})

    async def _model_info(self, request: web.Request) -> web.Response:
        info: dict[str, Any] = {"model_path": MODEL, "weight_version": "default", "reasoning_parser": "kimi_k2"}
        if self.has_image_understanding is not None:
            info["has_image_understanding"] = self.has_image_understanding
        return web.json_response(info)

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": MODEL, "tp_size": 1, "version": self.version,
                                  "reasoning_parser": "kimi_k2", "tool_call_parser": "kimi_k2",
                                  "context_length": 65536})

    def _error(self, message: str) -> web.Response:
        if self.engine == "vllm":  # vLLM's ErrorResponse
            body: dict = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
        else:  # SGLang's ORJSONResponse of an ErrorResponse
            body = {"object": "error", "message": message, "type": "BadRequest", "param": None, "code": 400}
        return web.json_response(body, status=400)

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        images = image_urls(body)
        if images and self.refuse_images:
            return self._error(self.refuse_images)
        words = sum(len((m["content"] if isinstance(m.get("content"), str) else " ".join(
            p.get("text", "") for p in m.get("content") or [])).split()) for m in body["messages"])
        prompt = [1] * words + ([] if self.drop_images else [IMAGE_ID] * PLACEHOLDERS * len(images))
        output = [7, 2]
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "A picture.",
                                                          "reasoning_content": None}, "finish_reason": "stop"}
        answer: dict[str, Any] = {"id": "x", "object": "chat.completion", "model": MODEL, "choices": [choice],
                                  "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(output),
                                            "total_tokens": len(prompt) + len(output)}}
        if self.engine == "vllm":
            choice["token_ids"], answer["prompt_token_ids"] = output, prompt
        elif self.engine == "sglang":
            choice[SGLangAdapter(version=self.version).output_ids_field or "token_ids"] = output
            choice["prompt_token_ids"] = prompt
            answer["metadata"] = {"weight_version": "default"}
        return web.json_response(answer)
