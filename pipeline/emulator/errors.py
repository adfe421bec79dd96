"""The refusal every layer of the emulator raises: a request answered with an error before it is generated."""
from __future__ import annotations


class RequestInvalid(Exception):
    """A request the server refuses before generating: status + SGLang's message. `bare`: the body is
    {"error": "<message>"} (0.5.23's /generate contract gate). `err_type`: the OpenAI error's type when it is
    not the status's usual one (FastAPI's validation handler says "Bad Request")."""

    def __init__(self, message: str, status: int = 400, bare: bool = False, err_type: str | None = None):
        super().__init__(message)
        self.message, self.status, self.bare, self.err_type = message, status, bare, err_type
