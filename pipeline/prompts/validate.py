"""`regen validate CONFIG`: what `regen generate` would refuse before it sends a prompt, found without running it.

It reads the config, reads the first records of each source, and exits as `generate` would: a source that cannot
be read, holds no valid prompt, or is a JSON file cut short without `salvage: true` (generate reads to the end of
it and refuses) is exit 2, and so is an `api_key_env` that is not set (`--no-secrets` skips that check, for a
cluster's config looked at on a laptop). It contacts no endpoint. A hub dataset is streamed for its first records;
when the hub does not answer a short connect (or HF_HUB_OFFLINE is set) it is looked for in the local cache only, at
once, rather than after the hub client's minute of retries; `--offline` contacts nothing and skips hub datasets with
a note.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from ..core import exits
from ..core.config import RunConfig, load_config
from .errors import SourceError
from .hf import hub_cache_only, hub_unreachable, is_hub_dataset
from .probe import probe_source
from .sources import SourceSpec, load_source_spec


@dataclass(frozen=True)
class ValidateOptions:
    config: str
    secrets: bool = True  # check that every api_key_env is set, as generate does
    offline: bool = False  # contact nothing: hub datasets are not probed


def validate(opts: ValidateOptions) -> int:
    cfg = load_config(opts.config)
    specs = [(ref, load_source_spec(ref.spec)) for ref in cfg.sources]
    hub_reason = None
    if not opts.offline and any(is_hub_dataset(spec) for _, spec in specs):
        hub_reason = hub_unreachable()
        if hub_reason:
            hub_cache_only()  # as fast as HF_HUB_OFFLINE: the cache answers, or says the dataset is not in it
    unreadable = 0
    for ref, spec in specs:
        print(f"source {spec.name}: {spec.kind} {spec.path} ({spec.format}), limit {ref.limit or spec.limit or 'none'}")
        if is_hub_dataset(spec) and opts.offline:
            print("  not probed: --offline contacts no hub (regen generate needs the hub, or the dataset in the local "
                  "cache)")
            continue
        if is_hub_dataset(spec) and hub_reason:
            print(f"  the hub is not contacted ({hub_reason}): looked for in the local cache only (--offline skips "
                  "hub datasets)")
        unreadable += _source_refused(spec, cfg)
    missing = _missing_secrets(cfg, opts.secrets)
    errors = []
    if unreadable:
        errors.append(f"{unreadable} of {len(cfg.sources)} sources cannot be read or hold no valid prompt")
    if missing:
        errors.append(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set (the api_key_env of "
                      "endpoints above; --no-secrets skips this check)")
    if errors:
        print(f"regen: error: {opts.config}: {'; '.join(errors)}", file=sys.stderr)
        return exits.CONFIG.code  # what `regen generate` exits with for each of them
    print(f"{opts.config} is valid: model {cfg.model}, fingerprint {cfg.fingerprint()}")
    return exits.OK.code


def _source_refused(spec: SourceSpec, cfg: RunConfig) -> bool:
    """Print what the source's first records are; True if `regen generate` would refuse the source."""
    try:
        probe = probe_source(spec, images=cfg.images)
    except SourceError as exc:  # one line per source; the others are still looked at
        print(f"  cannot read it: {exc.cause}" + (f"; {exc.hint}" if exc.hint else ""))
        return True
    print("\n".join(probe.lines()))
    if probe.read == 0:  # as `regen generate` refuses it (NoValidPrompts)
        print("  no records: regen generate refuses a source without a valid prompt")
        return True
    if probe.no_valid is not None:
        print(f"  {probe.no_valid}")
        return True
    if probe.truncated is not None:  # read to its end: the message generate gives
        print(f"  cannot read it: {probe.truncated.cause}; {probe.truncated.hint}")
        return True
    return False


def _missing_secrets(cfg: RunConfig, check: bool) -> list[str]:
    """Print each endpoint; the api_key_env variables that are not set (none when not checked)."""
    missing: list[str] = []
    for endpoint in cfg.all_endpoints():
        secret = ""
        if endpoint.api_key_env:
            if os.environ.get(endpoint.api_key_env):
                secret = f", key from ${endpoint.api_key_env} (set)"
            elif check:
                missing += [endpoint.api_key_env] if endpoint.api_key_env not in missing else []
                secret = f", key from ${endpoint.api_key_env} (NOT SET: regen generate refuses it)"
            else:
                secret = f", key from ${endpoint.api_key_env} (not set; not checked: --no-secrets)"
        concurrency = (f"not set: auto where the server reports its batch, else {endpoint.concurrency}"
                       if endpoint.auto_by_default else endpoint.concurrency)
        print(f"endpoint {endpoint.label}: {endpoint.url}, concurrency {concurrency}{secret}")
    return missing
