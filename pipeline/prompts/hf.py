"""kind: hf: a Hugging Face dataset on the hub, a `save_to_disk` folder, or local data files and folders.

- a hub name is loaded with `datasets.load_dataset(name, subset, split, data_files=...)` (downloaded and cached);
- a `save_to_disk` folder with `datasets.load_from_disk`;
- a local file, or the `data_files` of a local folder, by regen's own streaming readers, chosen by extension
  (.jsonl, .json: JSON Lines or one array, .parquet, .arrow);
- any other local folder (a hub repository downloaded as it is) with `datasets.load_dataset(folder, split,
  streaming=True)`, which finds its splits as the hub does.
A failure is one SourceError naming the source and the cause (hub unreachable, missing, permission...).
"""
from __future__ import annotations

import contextlib
import glob as globlib
import logging
from pathlib import Path
from typing import Any, Iterator

from .errors import SourceError, read_error
from .records import RawRecord, Reject
from .jsonarray import json_lines
from .localfiles import read_file
from .reading import ReadStats
from .spec import SourceSpec

DATA_EXTENSIONS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def read_hf(spec: SourceSpec, stats: ReadStats, stream_hub: bool = False) -> Iterator[RawRecord | Reject]:
    """`stream_hub`: read a hub dataset as a stream instead of downloading it whole (to look at its first
    records)."""
    local = spec.local_path()
    if local.is_file():
        yield from _read_local_files(spec, [local], stats)
    elif local.is_dir() and _saved_to_disk(local):
        yield from _read_saved(spec, local, stats)
    elif local.is_dir() and spec.data_files:
        yield from _read_local_files(spec, _matching(spec, local), stats)
    elif local.is_dir():
        yield from _read_dataset(spec, str(local), stats, streaming=True)
    elif local.exists() or _looks_local(spec.path):
        raise SourceError(spec.name, f"path {spec.path!r} is neither a file nor a folder (looked for {local})",
                          "check `path`; a relative path is read from the spec file's folder")
    else:
        yield from _read_dataset(spec, spec.path, stats, streaming=stream_hub)


def local_data_files(spec: SourceSpec) -> list[Path]:
    """The local files a kind-hf source reads (its identity): the file, the matching data files, or every file
    of the folder that is not hidden. A hub name has none."""
    local = spec.local_path()
    if local.is_file():
        return [local]
    if not local.is_dir():
        return []
    if spec.data_files and not _saved_to_disk(local):
        return _matching(spec, local)
    return sorted(p for p in local.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(local).parts))


def is_hub_dataset(spec: SourceSpec) -> bool:
    """A kind-hf source naming a dataset on the hub (not a local file or folder)."""
    return spec.kind == "hf" and not spec.local_path().exists() and not _looks_local(spec.path)


def own_reader_files(spec: SourceSpec) -> list[Path]:
    """The local files of a kind-hf source that regen's own readers read (the others go through `datasets`)."""
    local = spec.local_path()
    if local.is_file():
        return [local]
    if local.is_dir() and spec.data_files and not _saved_to_disk(local):
        try:
            return _matching(spec, local)
        except SourceError:
            return []
    return []


HUB_CONNECT_TIMEOUT_S = 3.0


def hub_unreachable(timeout_s: float = HUB_CONNECT_TIMEOUT_S) -> str | None:
    """Why the Hugging Face hub cannot be reached now; None: a TCP connect to it succeeded within `timeout_s`.
    HF_HUB_OFFLINE counts as unreachable without trying. (The hub client retries for most of a minute before it
    says so itself.) Read from the environment, as the hub client will read it once imported."""
    import os
    import socket
    from urllib.parse import urlsplit

    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    parts = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{host}:{port} did not answer within {timeout_s:.0f} s: {exc.strerror or type(exc).__name__}"


def hub_cache_only() -> None:
    """Read hub datasets from the local cache only, in this process: no retries against a hub that does not answer.
    Takes effect where `datasets` is imported after it (the validate command imports it later)."""
    import os
    import sys

    os.environ["HF_HUB_OFFLINE"] = "1"
    if "datasets" in sys.modules:
        import datasets.config

        datasets.config.HF_HUB_OFFLINE = True


def _looks_local(path: str) -> bool:
    """A hub name is `owner/name`; anything with a leading ./, ~ or /, or a file extension, means a local path."""
    return path.startswith((".", "/", "~")) or Path(path).suffix.lower() in DATA_EXTENSIONS or path.count("/") > 1


def _saved_to_disk(folder: Path) -> bool:
    return (folder / "dataset_info.json").exists() or (folder / "dataset_dict.json").exists()


def _matching(spec: SourceSpec, folder: Path) -> list[Path]:
    files: list[Path] = []
    for pattern in spec.data_files:
        matched = sorted(Path(p) for p in globlib.glob(str(folder / pattern), recursive=True) if Path(p).is_file())
        if not matched:
            raise SourceError(spec.name, f"data_files {pattern!r} matches no file in {folder}", "check `data_files`")
        files += [f for f in matched if f not in files]
    return files


def _read_local_files(spec: SourceSpec, files: list[Path], stats: ReadStats) -> Iterator[RawRecord | Reject]:
    for file in files:
        kind = DATA_EXTENSIONS.get(file.suffix.lower())
        if kind is None:
            raise SourceError(spec.name, f"{spec.shown(file)} is not a data file regen reads "
                                         f"({', '.join(DATA_EXTENSIONS)})", "select the data files with `data_files`")
        if kind == "json" and not spec.records_field and json_lines(file, spec.conversation_field):
            kind = "jsonl"  # a .json file of one object per line, as `datasets` also reads it
        yield from read_file(spec, file, kind, stats)


def _read_saved(spec: SourceSpec, folder: Path, stats: ReadStats) -> Iterator[RawRecord]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(folder))
    except Exception as exc:  # noqa: BLE001 - one line naming the source and the cause
        raise read_error(spec.name, exc, spec.path) from exc
    if isinstance(ds, datasets.DatasetDict):
        if spec.split not in ds:
            raise SourceError(spec.name, f"{spec.path!r} has no split {spec.split!r} (it has {', '.join(ds)})",
                              "set `split`")
        ds = ds[spec.split]
    label = f"{spec.path}[{spec.split}]"
    stats.containers[spec.path] = f"datasets save_to_disk folder, columns {', '.join(ds.column_names)}"
    stats.file = None
    for i, data in enumerate(media_undecoded(ds)):
        yield RawRecord(spec.name, f"{label}#{i}", data)


def _read_dataset(spec: SourceSpec, target: str, stats: ReadStats, streaming: bool) -> Iterator[RawRecord]:
    import datasets

    label = spec.path + (f"/{spec.subset}" if spec.subset else "") + f"[{spec.split}]"
    options: dict[str, Any] = {"name": spec.subset, "split": spec.split, "streaming": streaming}
    if spec.data_files:
        options["data_files"] = list(spec.data_files)
    if spec.records_field:
        options["field"] = spec.records_field
    with _quiet_hub():
        try:
            ds = datasets.load_dataset(target, **options)
            rows = iter(media_undecoded(ds))
            first = next(rows, None)
        except Exception as exc:  # noqa: BLE001 - datasets raises many types; one line naming the cause
            raise read_error(spec.name, exc, label) from exc
    stats.file = None
    stats.containers[label] = ("Hugging Face dataset" + (" (streamed)" if streaming else "")
                               + (f", columns {', '.join(ds.column_names)}" if ds.column_names else ""))
    if first is None:
        return
    yield RawRecord(spec.name, f"{label}#0", first)
    i = 1
    while True:
        try:
            data = next(rows)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - a read failing mid-stream (a file gone, the hub dropped)
            raise read_error(spec.name, exc, f"{label} after {i} records") from exc
        yield RawRecord(spec.name, f"{label}#{i}", data)
        i += 1


def media_undecoded(ds: Any) -> Any:
    """The dataset with its Image (Audio, Video) columns as stored, `{"bytes", "path"}`, never decoded: regen
    reads and checks an image's bytes itself (prompts/images.py), and a decoded image would be a Pillow object.
    A dataset without such columns is returned as it is."""
    import datasets

    features = getattr(ds, "features", None)
    if not features or not _has_media(features):
        return ds
    if isinstance(ds, datasets.Dataset):
        ds = ds.to_iterable_dataset()
    return ds.decode(False)


def _has_media(feature: Any) -> bool:
    import datasets

    if isinstance(feature, (datasets.Image, datasets.Audio, datasets.Video)):
        return True
    if isinstance(feature, dict):
        return any(_has_media(f) for f in feature.values())
    if isinstance(feature, (list, tuple)):
        return any(_has_media(f) for f in feature)
    inner = getattr(feature, "feature", None)  # List, LargeList, Sequence
    return inner is not None and _has_media(inner)


@contextlib.contextmanager
def _quiet_hub():
    """The hub client logs each retry of an unreachable hub as a warning: the one error line is enough."""
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
