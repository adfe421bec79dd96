"""The capture's errors. Each derives from the taxonomy class (core/errors.py) that decides what is done with it:
the capture pool and the CLI act on that class, never on the text."""
from __future__ import annotations

from ..core.errors import RegenError, StorageError, TerminalForPrompt


class HiddenStateError(RegenError):
    """Base of the hidden-state errors."""


class CaptureSampleError(TerminalForPrompt, HiddenStateError):
    """The capture route cannot take one sample (an id past the model's vocabulary, a sequence past its context):
    names the prompt and sample; only that prompt fails."""


class StoredLayoutMismatch(HiddenStateError):
    """A stored sample does not have capture.json's layout (a capture that mixed two models): names the sample."""


class InsufficientStorage(StorageError):
    """The estimated hidden-state bytes do not fit in the free space (unless forced)."""
