"""An SGLang-faithful HTTP server for tests and dry runs: deterministic answers, prefix cache, speed model, faults.

Public API:
    EmulatorConfig, make_config          -- every option (config.py)
    build_app(cfg) -> aiohttp.web.Application
    main(argv) -> int                    -- `python -m pipeline.emulator`
    start_emulator(port, **options) -> EmulatorProcess   -- a subprocess for tests
    expected_chat(request_json, cfg) -> dict, expected_generate(request_json, cfg) -> dict
    encode(text), render_chat(messages, thinking)
"""
from .config import EmulatorConfig, make_config
from .model import EOS_ID, VOCAB_SIZE, encode, expected_chat, expected_generate, render_chat
from .process import EmulatorProcess, start_emulator
from .server import build_app, main

__all__ = ["EmulatorConfig", "make_config", "build_app", "main", "start_emulator", "EmulatorProcess",
           "expected_chat", "expected_generate", "encode", "render_chat",
           "EOS_ID", "VOCAB_SIZE"]
