"""What a run directory may be named by: a local path, file://, or an object-store URI without credentials.

Checked when the config is validated, with no network and no pyarrow; store/storage.py opens the location.
"""
from __future__ import annotations

import urllib.parse

from .errors import ConfigError

OBJECT_STORES = ("s3", "gs", "gcs")  # pyarrow names their objects bucket/key


def check_uri(text: str) -> urllib.parse.SplitResult:
    """A local path, file://, or an object store we support, without credentials. No network."""
    parts = urllib.parse.urlsplit(text)
    if len(parts.scheme) > 1 and parts.scheme != "file":
        if parts.scheme not in OBJECT_STORES:
            raise ConfigError(f"{text}: a run directory is a local path, file://, or one of "
                              f"{', '.join(s + '://' for s in OBJECT_STORES)}")
        if parts.username or parts.password:
            raise ConfigError(f"{parts.scheme}://…@{parts.hostname}: credentials in a URI would be written to "
                              "run.json and the logs; set them in the environment (e.g. AWS_ACCESS_KEY_ID)")
        if not parts.netloc:
            raise ConfigError(f"{text}: no bucket named")
    return parts
