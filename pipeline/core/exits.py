"""The exit codes of every `regen` command: the one table the CLI returns from and the docs print."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError, DriftError, QualityGateStopped, RegenError, RunLocked


@dataclass(frozen=True)
class ExitCode:
    code: int
    name: str
    meaning: str
    error: type[RegenError] | None = None  # the typed error the CLI maps to this code, if any


OK = ExitCode(0, "ok", "the command did what it was asked (a run: complete, every prompt committed or failed for good)")
FAILED = ExitCode(1, "failed", "an error not listed below; the message on stderr says what (a capture with failed "
                               "samples ends here too)")
CONFIG = ExitCode(2, "config", "bad input: the config, a source, a missing API-key variable, a capture model or "
                               "route that cannot be used (an endpoint that refuses regen's requests is 1)",
                  ConfigError)
DRIFT = ExitCode(3, "drift", "the config no longer matches the run it would resume (the diff is printed)",
                 DriftError)
LOCKED = ExitCode(4, "locked", "another regen holds the run's lock", RunLocked)
QUALITY_GATE = ExitCode(5, "quality_gate", "`quality_gate: stop` stopped the run: its first records crossed a quality "
                                           "threshold (cut at max_tokens, cut in the thinking, empty, repeating); "
                                           "committed work is kept and the run resumes", QualityGateStopped)
INTERRUPTED = ExitCode(130, "interrupted", "stopped by Ctrl-C (or, for generate and capture, SIGTERM); committed work "
                                           "is kept and the same command resumes")

TABLE: tuple[ExitCode, ...] = (OK, FAILED, CONFIG, DRIFT, LOCKED, QUALITY_GATE, INTERRUPTED)


def for_error(exc: RegenError) -> int:
    """The exit code of a typed error (the most specific class in TABLE wins; FAILED otherwise)."""
    matches = [e for e in TABLE if e.error is not None and isinstance(exc, e.error)]
    if not matches:
        return FAILED.code
    return max(matches, key=lambda e: len(e.error.__mro__)).code  # the most specific class
