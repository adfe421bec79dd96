"""The run identity in run.json: what a resume compares, and how a run.json written by older code is read.

run.json holds two identity documents, built by `RunConfig.generation_identity()` (what shapes each record) and
`RunConfig.prompt_identity()` (what selects the prompt set). A resume compares the stored documents with the
config's:
- a key the stored document lacks is not compared: older code did not record it. The resume then records the
  config's value, and compares it from then on (`identity_upgrades` in run.json says when and what);
- a key in INFORMATIONAL is recorded for people but never compared and not fingerprinted (none is, today);
- a SECTION is compared key by key; any other value (a list, a user's dict such as chat_template_kwargs) whole.

Adding a key to the identity is one line in `generation_identity()` or `prompt_identity()` (a new field of
`Sampling` is in it already). Runs started before it resume. Add it as a key of a section, e.g.
`prompts.source_files: [...]` beside `prompts.sources`: a field added inside a value (each item of the `sources`
list) changes that whole value, which is drift for every older run. Removing a key, or changing what a stored
value means, needs IDENTITY_VERSION bumped and a step in UPGRADES that rewrites the older run.json.

What an older version did but did not record is never taken from today's config: a step of UPGRADES fills in
the fixed behaviour of that code where it had one, or what the run's committed records show; a key still
unknown then refuses the resume (UNRECORDED names it, and --new-run starts a new run). A run with no committed
record was shaped by nothing: the config's values are recorded for it as for any missing key.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import orjson

# 1: run.json without `identity_version` (regen up to c15f75f).
# 2: records return_token_ids and stream; hidden_states.layers_note is no longer compared.
IDENTITY_VERSION = 2
SECTIONS = frozenset({"generation", "generation.sampling", "prompts"})
INFORMATIONAL: frozenset[str] = frozenset()
# Keys written into the identity only when they differ from their default (so that the runs made before them keep
# their fingerprint): a document without one means the default, and a resume compares it as such.
OMITTED_AT_DEFAULT: dict[str, object] = {"generation.tool_choice": "auto",
                                         "generation.tool_reasoning_history": "current_turn",
                                         "generation.tool_result_match": "name",
                                         "generation.samples_per_prompt": 1,
                                         "prompts.images": {}}  # config_sections.Images.identity
SAMPLES_KEY = "generation.samples_per_prompt"
ADD_SAMPLES_FLAG = "--add-samples"

# Features a run may have been made with that this regen no longer has: a stored value other than None refuses
# the resume with the reason (the config can only say None: core/config.py refuses the key).
RETIRED = {
    "generation.hidden_states": "this run captured hidden states through the generating request (SGLang /generate "
                                "with hidden states), which regen no longer does: its records reference hidden "
                                "parts this regen does not write, so it cannot continue as it was made. Finish it "
                                "with the regen that made it, or start a new run with this config (--new-run); "
                                "then capture with `regen capture RUN --config capture.yaml`",
}


@dataclass(frozen=True)
class StoredRecords:
    """What a run's committed data records show of how they were made (the store reads it: store/rundir.py)."""

    count: int = 0
    with_token_ids: int = 0  # records carrying output token ids


# Keys version 1 code used but did not record: why a resume cannot take them from the config.
UNRECORDED = {
    "generation.explicit_sampling": "regen before identity version 2 sent no top_k, min_p or repetition_penalty "
                                    "(the server filled them from the model's generation_config); regen now sends "
                                    "them on every request",
    "generation.return_token_ids": "not recorded by this run (identity version 1), and its records carry no token "
                                   "ids, so whether it asked for them cannot be told",
    "generation.stream": "not recorded by this run (identity version 1), and its records carry no token ids, so "
                         "whether it streamed cannot be told",
}


def _upgrade_1(manifest: dict[str, Any], records: StoredRecords) -> dict[str, Any]:
    if not records.count or "generation" not in manifest:
        return manifest  # nothing was made with the old values: the config's are recorded
    generation = {"explicit_sampling": None, **manifest["generation"]}  # None: not sent
    if records.with_token_ids:  # a streamed answer carries no token ids (the client reads them unstreamed)
        generation = {"return_token_ids": True, "stream": False, **generation}
    return {**manifest, "generation": generation}


# version n -> a function rewriting a version-n run.json (and what its records show) into version n + 1.
UPGRADES: dict[int, Callable[[dict[str, Any], StoredRecords], dict[str, Any]]] = {1: _upgrade_1}


@dataclass
class IdentityCheck:
    """The outcome of comparing a stored run.json with the config."""

    drift: list[str] = field(default_factory=list)  # "key: stored -> config" lines: the resume is refused
    adopted: dict[str, Any] = field(default_factory=dict)  # keys the stored run.json lacked -> the config's value
    records: StoredRecords = field(default_factory=StoredRecords)  # what the run's records showed
    raised_samples: tuple[int, int] | None = None  # samples_per_prompt (stored, config), raised by --add-samples
    # samples_per_prompt (run.json's, samples the ledger holds, config): a raise no committed sample carries,
    # lowered again (a raise binds when its first new sample commits)
    unbound_samples: tuple[int, int, int] | None = None

    @property
    def resumable(self) -> bool:
        return not self.drift


def _json(value: Any) -> Any:
    """The value as it reads back from run.json (tuples become lists, and so on)."""
    return orjson.loads(orjson.dumps(value, option=orjson.OPT_SORT_KEYS))


def _compare(stored: Any, current: Any, path: str, check: IdentityCheck) -> None:
    if path in INFORMATIONAL:
        return
    if path in SECTIONS and isinstance(stored, dict) and isinstance(current, dict):
        for key in sorted(set(current) | set(stored)):
            sub = f"{path}.{key}"
            if sub in OMITTED_AT_DEFAULT and (key in stored or key in current):
                default = OMITTED_AT_DEFAULT[sub]
                _compare(stored.get(key, default), current.get(key, default), sub, check)
            elif key not in current:
                continue  # a key only the stored document has is not compared
            elif key in stored:
                _compare(stored[key], current[key], sub, check)
            elif sub not in INFORMATIONAL:
                check.adopted[sub] = current[key]
    elif isinstance(stored, dict) and isinstance(current, dict):  # compared whole, shown key by key
        check.drift += flat_diff(stored, current, f"{path}.")
    elif stored != current:
        check.drift.append(f"{path}: {stored!r} -> {current!r}")


def current_identity(generation: dict[str, Any], prompts: dict[str, Any]) -> dict[str, Any]:
    return {"generation": _json(generation), "prompts": _json(prompts)}


def upgraded(manifest: dict[str, Any], records: StoredRecords) -> dict[str, Any]:
    """A stored run.json in the form of IDENTITY_VERSION (a newer version is read as it is)."""
    version = manifest.get("identity_version", 1)
    while version < IDENTITY_VERSION:
        step = UPGRADES.get(version)
        manifest = step(manifest, records) if step else manifest
        version += 1
    return manifest


def check_identity(manifest: dict[str, Any], identity: dict[str, Any], *, refresh_prompts: bool,
                   records: StoredRecords = StoredRecords(), add_samples: bool = False,
                   stored_samples: int | None = None) -> IdentityCheck:
    """Compare a stored run.json with the config's identity. With --refresh-prompts the prompt set may change.
    `records`: what the run's committed records show (read for a run.json older than IDENTITY_VERSION).
    `add_samples` (--add-samples): a config that raises samples_per_prompt may resume the run (lowering never
    below what is stored). `stored_samples`: how many samples of a prompt the ledger holds (1 + its highest
    sample index), read by the store when the config lowers k; None: not read (taken as run.json's k)."""
    stored = upgraded(manifest, records)
    check = IdentityCheck(records=records)
    version = stored.get("identity_version", 1)
    if version > IDENTITY_VERSION:
        check.drift.append(f"identity_version: {version} (run.json was written by a newer regen, which compares "
                           f"keys this one, at {IDENTITY_VERSION}, does not know: resume with that regen)")
        return check
    if isinstance(stored.get("prompts"), dict) and not refresh_prompts:
        stored = {**stored, "prompts": with_spec_keys(stored["prompts"], spec_renames(stored["prompts"],
                                                                                     identity["prompts"]))}
    for section in ("generation", "prompts"):
        if section == "prompts" and refresh_prompts:
            continue
        if section not in stored:
            check.adopted[section] = identity[section]
        else:
            _compare(stored[section], identity[section], section, check)
    if version == 1 and records.count:
        _refuse_unrecorded(stored, identity, check)
    _refuse_retired(stored, check)
    _samples_change(stored, identity, check, add_samples, stored_samples)
    return check


def samples_per_prompt(generation: dict[str, Any] | None) -> int:
    """k of a generation identity (absent: 1)."""
    return int((generation or {}).get("samples_per_prompt", OMITTED_AT_DEFAULT[SAMPLES_KEY]))


def new_samples(old: int, new: int) -> str:
    """The samples raising k from `old` to `new` adds, in words: "sample 2", "samples 2 to 3"."""
    return f"sample {old}" if new - old == 1 else f"samples {old} to {new - 1}"


def _samples_change(stored: dict[str, Any], identity: dict[str, Any], check: IdentityCheck, add: bool,
                    held: int | None) -> None:
    """samples_per_prompt differs: raising it adds only the new samples, with --add-samples; lowering it is refused
    when the ledger holds records of the samples past the new k (a run never drops records). What is stored
    decides, not run.json: a raise whose first new sample never committed (a kill, a failed start) binds nothing,
    so going back to a k that covers every stored sample resumes (`held`: the samples stored; None: run.json's k)."""
    old, new = samples_per_prompt(stored.get("generation")), samples_per_prompt(identity["generation"])
    if old == new or not isinstance(stored.get("generation"), dict):
        return
    check.drift = [line for line in check.drift if not line.startswith(f"{SAMPLES_KEY}:")]
    held = old if held is None else held
    if new < old and held <= new:
        check.unbound_samples = (old, held, new)
    elif new < old:
        keep = f"Keep samples_per_prompt: {old}" if held == old else f"Set samples_per_prompt to {held} or more"
        check.drift.append(f"{SAMPLES_KEY}: {old} -> {new}: lowering it is refused, even with {ADD_SAMPLES_FLAG}: "
                           f"this run has records of {new_samples(new, held)}, which a run of {new} would not make. "
                           f"{keep} (export what you need), or start a new run (--new-run)")
    elif not add:
        check.drift.append(f"{SAMPLES_KEY}: {old} -> {new}: raising it adds {new_samples(old, new)} of every "
                           f"prompt to this run; pass {ADD_SAMPLES_FLAG} to do so (only the new samples are sent), "
                           "or --new-run to start a new run")
    else:
        check.raised_samples = (old, new)


def spec_renames(stored: dict[str, Any], current: dict[str, Any]) -> dict[str, str]:
    """The stored spec paths -> the config's, source by source (the same position in `sources`): a spec is compared
    by its content and its files' digests, not by the text of its path, which changes with the path rule of
    core/paths.py (today's config names `../prompts_sources/x.yaml` or an absolute path where an older run
    recorded `prompts_sources/x.yaml`). A run.json that did not record the specs' content renames a spec only if
    its old path, taken from the working directory as the code that wrote it did, is the same file."""
    old = [ref.get("spec") for ref in stored.get("sources") or [] if isinstance(ref, dict)]
    new = [ref.get("spec") for ref in current.get("sources") or [] if isinstance(ref, dict)]
    if len(old) != len(new) or len(set(old)) != len(old):
        return {}
    with_content = isinstance(stored.get("specs"), dict)
    return {before: after for before, after in zip(old, new)
            if isinstance(before, str) and isinstance(after, str) and before != after
            and (with_content and before in stored["specs"] or _same_file(before, after))}


def with_spec_keys(prompts: dict[str, Any], renames: dict[str, str]) -> dict[str, Any]:
    """A stored prompt identity with its spec paths renamed (spec_renames)."""
    if not renames:
        return prompts
    renamed = dict(prompts)
    renamed["sources"] = [{**ref, "spec": renames.get(ref.get("spec"), ref.get("spec"))} if isinstance(ref, dict)
                          else ref for ref in prompts.get("sources") or []]
    if isinstance(prompts.get("specs"), dict):
        renamed["specs"] = {renames.get(key, key): value for key, value in prompts["specs"].items()}
    return renamed


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _refuse_retired(stored: dict[str, Any], check: IdentityCheck) -> None:
    for key, why in RETIRED.items():
        section, name = key.split(".", 1)
        if (stored.get(section) or {}).get(name) is not None:
            check.drift = [line for line in check.drift if not line.startswith(f"{key}:")]
            check.drift.append(f"{key}: {why}")


def _refuse_unrecorded(stored: dict[str, Any], identity: dict[str, Any], check: IdentityCheck) -> None:
    """A key version 1 used without recording it: still unknown, or its fixed behaviour (None: not sent) is not
    what this regen does. (A value the records showed is compared as usual.)"""
    generation = stored.get("generation", {})
    for key, why in UNRECORDED.items():
        name = key.split(".", 1)[1]
        current = identity["generation"].get(name)
        if name in generation and (generation[name] is not None or current is None):
            continue
        check.adopted.pop(key, None)
        check.drift = [line for line in check.drift if not line.startswith(f"{key}:")]
        check.drift.append(f"{key}: {why}; this config has {current!r}. Resume with the regen that made the run, "
                           "or start a new run with this config (--new-run)")


def resumed_manifest(manifest: dict[str, Any], identity: dict[str, Any], check: IdentityCheck) -> dict[str, Any]:
    """run.json after a resume the check allowed: at IDENTITY_VERSION, with the config's identity (equal to the
    stored one wherever both have a key), and a note of what this resume adopted. The fingerprint is the run's,
    fixed when it was created: every record of a run carries the same one."""
    old_version = manifest.get("identity_version", 1)
    manifest = upgraded(manifest, check.records)
    updated = {**manifest, "identity_version": IDENTITY_VERSION}
    for section, document in identity.items():
        updated[section] = _merged(manifest.get(section), document, section)
    if check.adopted or old_version < IDENTITY_VERSION:
        note = {"at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "from_version": old_version,
                "adopted": check.adopted}
        updated["identity_upgrades"] = [*manifest.get("identity_upgrades", []), note]
    return updated


def identity_fingerprint(generation: dict[str, Any]) -> str:
    """A short hash of the compared part of the generation identity."""
    compared = _without_informational(_json(generation), "generation")
    return hashlib.sha256(orjson.dumps(compared, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def _without_informational(value: Any, path: str) -> Any:
    if not isinstance(value, dict) or path not in SECTIONS:
        return value
    return {key: _without_informational(item, f"{path}.{key}") for key, item in value.items()
            if f"{path}.{key}" not in INFORMATIONAL}


def _merged(stored: Any, current: Any, path: str) -> Any:
    """The config's identity, keeping keys only the stored run.json has (they are not compared)."""
    if path in SECTIONS and isinstance(stored, dict) and isinstance(current, dict):
        return {**stored, **{key: _merged(stored.get(key), item, f"{path}.{key}") for key, item in current.items()}}
    return current


def flat_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Readable `key: old -> new` lines between two nested dicts."""
    lines = []
    for key in sorted(set(old) | set(new)):
        name = f"{prefix}{key}"
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            lines += flat_diff(a, b, name + ".")
        elif a != b:
            lines.append(f"{name}: {a!r} -> {b!r}")
    return lines
