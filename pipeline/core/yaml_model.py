"""A YAML file read into a pydantic model: every problem is a ConfigError naming the file and the key (an unknown
key also names the keys its section allows, and the closest one). The run config and the capture config use it."""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Callable, TypeVar, get_args

import yaml
from pydantic import BaseModel, ValidationError

from .errors import ConfigError


def _section_model(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model class of the section at `loc` (keys and list indexes) under `model`; None if not one."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue  # an index into a list: the list's item type was taken with its field
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or part not in current.model_fields:
            return None
        current = _model_in(current.model_fields[part].annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _model_in(annotation: Any) -> Any:
    """The model class inside an annotation such as `Sampling`, `LocalFleet | None` or `list[Endpoint]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _unknown_key(model: type[BaseModel], loc: tuple) -> str:
    """` (allowed: ...; did you mean ...?)`: the keys of the section the unknown key is in."""
    section = _section_model(model, loc[:-1])
    if section is None:
        return ""
    allowed = [name for name, info in section.model_fields.items() if not info.exclude]
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    return f" (allowed: {', '.join(allowed)}" + (f"; did you mean {close[0]!r}?)" if close else ")")


def _describe(error: ValidationError, path: Path, model: type[BaseModel] | None = None) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key '{key}'" + (_unknown_key(model, item["loc"]) if model else ""))
        elif item["type"] == "missing":
            lines.append(f"{path}: missing key '{key}'")
        else:
            lines.append(f"{path}: key '{key}': {item['msg']}")
    return "\n".join(lines)


_M = TypeVar("_M", bound=BaseModel)


def load_yaml_model(path: str | Path, model: type[_M], what: str = "config",
                    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> _M:
    """A YAML file validated into `model`; every problem is a ConfigError naming the file (and the key).
    `prepare` rewrites the raw mapping first (a run config resolves its paths)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{what} file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the {what} must be a mapping of keys")
    if prepare is not None:
        raw = prepare(raw)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path, model)) from None
