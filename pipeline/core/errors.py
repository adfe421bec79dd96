"""The error taxonomy. Code decides what to do by the class of an exception, never by its text.

Only `classify` (endpoints/classify.py) looks at a server's status and message to pick the class.
"""
from __future__ import annotations


class RegenError(Exception):
    """Base of every error regen raises on purpose."""


# --- user input --------------------------------------------------------------------------------
class ConfigError(RegenError):
    """The config (or a source file) is invalid: names the file and the key."""


class SecretMissing(ConfigError):
    """An endpoint names an API-key environment variable that is not set."""


class ImageFetchFailed(RegenError):
    """An http(s) image could not be fetched while the sources were read (the prompts layer rejects the record as
    `remote_image` with this cause). `status`: the HTTP status, if the server answered."""

    def __init__(self, url: str, cause: str, status: int | None = None):
        self.url, self.cause, self.status = url, cause, status
        super().__init__(f"{url}: {cause}" + (f" (HTTP {status})" if status is not None else ""))


class DriftError(RegenError):
    """Resuming a run whose identity changed: generation config, prompt-set config or weight version."""

    GENERATE_ADVICE = ("Pass --new-run to start a new run directory with this config (or, if only the sources "
                       "changed, --refresh-prompts to add their new prompts to this run), or restore the old values "
                       "to resume.")

    def __init__(self, run_dir: str, diff: list[str], advice: str | None = None):
        self.run_dir, self.diff = run_dir, diff
        lines = "\n  ".join(diff)
        super().__init__(f"{run_dir} was started with another config:\n  {lines}\n{advice or self.GENERATE_ADVICE}")

    def __reduce__(self):  # crosses Ray's process boundary whole (the default would call cls(message))
        return type(self), (self.run_dir, self.diff, str(self).rsplit("\n", 1)[-1])


class RunLocked(RegenError):
    """Another live driver holds the run directory."""


class QualityGateStopped(RegenError):
    """`quality_gate: stop`: the first records of a session crossed a quality threshold (the message says which,
    the setting to change and its cost). Committed work is kept; the run resumes."""


class LeaseLost(RunLocked):
    """This driver's lease on its run (an object store's lock.json) was taken over or has expired: it must
    commit nothing more, since another driver may be committing the same prompts."""


# --- per request -------------------------------------------------------------------------------
# HTTP statuses worth a retry (the request may pass later), for any client of an HTTP service.
RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class RequestError(RegenError):
    """A request to one endpoint failed. `status` is the HTTP status if there was one."""

    def __init__(self, message: str, *, status: int | None = None, endpoint: str = ""):
        super().__init__(message)
        self.message, self.status, self.endpoint = message, status, endpoint


class Retryable(RequestError):
    """Transient: timeout, reset, no progress, 408/429/5xx, an `abort` finish. Retry, maybe elsewhere."""


class EndpointDown(Retryable):
    """The endpoint did not answer at all (refused, reset before a status). Not the prompt's fault:
    it does not count against the prompt's attempts, and it feeds the endpoint's circuit breaker."""


class ConnectionDropped(EndpointDown):
    """The connection was lost after the request was sent (reset mid-request, the server died on it). It may be
    the prompt's fault (a prompt that crashes the server): costs no attempt, but each prompt's drops are counted
    and past `max_connection_drops` the prompt is terminal."""


class Unexpected(Retryable):
    """An exception outside this taxonomy (a malformed answer, a bug): counted as an attempt and a failure of the
    endpoint, with the exception's type and message, and retried (elsewhere) like any transient error."""


class TerminalForPrompt(RequestError):
    """This prompt can never succeed (context overflow, invalid request): one failure row, no retry."""


class ImageUnsendable(TerminalForPrompt):
    """An image of the prompt is not the one the prompt set recorded, found when the endpoint worker reads it to send
    it: its bytes have another sha256, or they are gone. The prompt is never sent (it is not the prompt the set
    names); its failure row names the image and where it was read. Not the endpoint's fault."""


class EndpointFatal(RequestError):
    """The endpoint itself is wrong (model missing, wrong model, wrong hidden width): it leaves the fleet."""


class ContractError(EndpointFatal):
    """The endpoint refuses the shape of the requests regen sends it, so every one would fail the same way (a
    field its version does not know, one it refuses on a stream, the run's max_tokens above its context)."""


# --- whole run ---------------------------------------------------------------------------------
class RunFatal(RegenError):
    """The run cannot go on (no healthy endpoint by the deadline, output unwritable). Resumable."""


class PreflightError(RunFatal):
    """The fleet failed its preflight: names each endpoint and mismatch."""


class CaptureStopped(RunFatal):
    """The capture pass stopped because its route cannot go on (refused the contract, server down past the
    deadline, every prompt failing): names the route and the reason. Resumable: nothing was failed for it."""


class StorageError(RunFatal):
    """The run directory cannot be written (full disk, read-only, permissions). `maybe_committed`: the failure
    came after the rename (or the upload's completion), so the file may be committed: look before retrying."""

    maybe_committed: bool = False


class PartExists(StorageError):
    """A commit would replace an existing part: committed files are never replaced."""


# --- the prompt set's images ---------------------------------------------------------------------
class ImageChanged(ConfigError):
    """A local image's bytes are no longer those read when the prompt set was built (changed or gone before they
    were copied into the run): the prompt set is not committed. Names the file."""

    def __init__(self, path: str, expected: str, found: str | None):
        self.path, self.expected, self.found = path, expected, found
        now = "is gone" if found is None else f"now has sha256 {found}"
        super().__init__(f"image {path} changed while the prompt set was built (read with sha256 {expected}, it {now}):"
                         " the prompt set was not committed; rerun to read the sources again (images already copied "
                         "are kept: they are stored by their content)")
