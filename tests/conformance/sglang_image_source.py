"""SGLang's own image code, compiled out of one version's wheel so that it runs on CPU here: the modules that hold
it import the GPU stack (triton), so the functions are taken from the source with `ast` and run with the libraries
they name (Pillow, pybase64, requests). Used by the version's subprocess (sglang_image_checks.py).

- kimi_k25.py:navit_resize_config, Kimi-K2.5's placeholder count for an image size;
- configs/kimi_k25.py:KimiK25Config (loaded by path), its media_placeholder_token_id and vision_config;
- utils/common.py's loaders (load_image, get_image_bytes, download_remote_media, ...), and on 0.5.23
  multimodal/cache/identity.py:_read_media_bytes, the bytes Kimi's loader reads first;
- the structure that decides the answer: which exceptions are client errors (CLIENT_MEDIA_EXCEPTIONS), whether
  fast_load_mm_data keeps a ValueError, whether Kimi's loader reads the bytes before the wrapping try.
"""
from __future__ import annotations

import __future__
import ast
import dataclasses
import importlib.util
import ipaddress
import logging
import math
import os
import threading
import time
import typing
from functools import lru_cache
from io import BytesIO
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable
from urllib.parse import unquote, urljoin, urlparse

K25 = "sglang/srt/multimodal/processors/kimi_k25.py"
KIMI_COMMON = "sglang/srt/multimodal/processors/kimi_common.py"
BASE_PROCESSOR = "sglang/srt/multimodal/processors/base_processor.py"
COMMON = "sglang/srt/utils/common.py"
IDENTITY = "sglang/srt/multimodal/cache/identity.py"
LOADER_NAMES = {
    "ImageData", "image_extension_names", "CLIENT_MEDIA_EXCEPTIONS", "GPUImageDecodeMode", "is_jpeg_with_cuda",
    "_warn_fancy_jpeg_fallback", "_load_image", "_fully_load_pil_image", "load_image", "get_image_bytes",
    "_mm_http_session", "get_mm_http_session", "_DEFAULT_MEDIA_URL_MAX_FILE_SIZE_MB", "_MAX_MEDIA_URL_REDIRECTS",
    "_MEDIA_URL_REDIRECT_STATUS_CODES", "_allowed_media_domains", "_media_url_max_file_size_bytes",
    "_normalize_media_domain", "_assert_media_url_allowed", "download_remote_media",
}


def _defines(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def compile_names(path: Path, names: set[str], scope: dict) -> dict:
    """Run the top-level statements of `path` that define `names` in `scope` (annotations left unevaluated)."""
    tree = ast.parse(path.read_text())
    body = [node for node in tree.body if _defines(node) & names]
    code = compile(ast.Module(body=body, type_ignores=[]), str(path), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, scope)
    return scope


def navit_resize_config(root: Path) -> Callable[..., dict]:
    return compile_names(root / K25, {"navit_resize_config"}, {"math": math})["navit_resize_config"]


def kimi_k25_config(root: Path) -> Any:
    """configs/kimi_k25.py:KimiK25Config() with its defaults (loaded by path: the package imports the GPU stack)."""
    spec = importlib.util.spec_from_file_location("sglang_kimi_k25_config", root / "sglang/srt/configs/kimi_k25.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.KimiK25Config()


def loaders(root: Path) -> SimpleNamespace:
    """The version's image loaders, on CPU (is_cuda() is False: Pillow decodes, as for every non-JPEG)."""
    import pybase64
    import requests
    from PIL import Image, ImageOps, UnidentifiedImageError

    scope: dict[str, Any] = {
        "os": os, "time": time, "threading": threading, "ipaddress": ipaddress, "requests": requests,
        "pybase64": pybase64, "BytesIO": BytesIO, "Image": Image, "ImageOps": ImageOps,
        "UnidentifiedImageError": UnidentifiedImageError, "urlparse": urlparse, "unquote": unquote,
        "urljoin": urljoin, "lru_cache": lru_cache, "dataclass": dataclasses.dataclass,
        "logger": logging.getLogger("sglang-loaders"), "is_cuda": lambda: False, "torch": None,
        **{name: getattr(typing, name) for name in ("Any", "Dict", "List", "Literal", "Optional", "Sequence",
                                                    "Tuple", "Union")},
    }
    compile_names(root / COMMON, LOADER_NAMES, scope)
    read_media_bytes = None
    if snapshot_first(root):
        read_media_bytes = _read_media_bytes(root, scope)
    return SimpleNamespace(read_media_bytes=read_media_bytes, **{k: scope[k] for k in LOADER_NAMES if k in scope})


def _read_media_bytes(root: Path, loaders_scope: dict) -> Callable[[str], bytes]:
    """identity.py:_read_media_bytes with its in-function import of the loaders replaced by the compiled ones."""
    tree = ast.parse((root / IDENTITY).read_text())
    [node] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_read_media_bytes"]
    node.body = [stmt for stmt in node.body if not isinstance(stmt, ast.ImportFrom)]
    scope = {"Path": Path, "unquote": unquote, "urlparse": urlparse,
             "get_image_bytes": loaders_scope["get_image_bytes"],
             "image_extension_names": loaders_scope["image_extension_names"]}
    code = compile(ast.Module(body=[node], type_ignores=[]), str(root / IDENTITY), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, scope)
    return scope["_read_media_bytes"]


# --- the structure that decides the answer ------------------------------------------------------------------------
def _function(root: Path, relative: str, name: str, owner: str | None = None) -> ast.FunctionDef | None:
    for node in ast.walk(ast.parse((root / relative).read_text())):
        if owner and isinstance(node, ast.ClassDef) and node.name == owner:
            return next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == name), None)
        if not owner and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    return None


def snapshot_first(root: Path) -> bool:
    """Kimi's own _load_single_item (kimi_common.py) reads the bytes with snapshot_media before the base one."""
    method = _function(root, KIMI_COMMON, "_load_single_item", owner="KimiGridMMDataMixin")
    return method is not None and any(isinstance(n, ast.Name) and n.id == "snapshot_media" for n in ast.walk(method))


def fast_load_keeps_value_error(root: Path) -> bool:
    """fast_load_mm_data re-raises a loader's ValueError as a ValueError (400) rather than a RuntimeError."""
    method = _function(root, BASE_PROCESSOR, "fast_load_mm_data")
    return any(isinstance(n, ast.ExceptHandler) and isinstance(n.type, ast.Name) and n.type.id == "ValueError"
               for n in ast.walk(method))


def client_errors(root: Path, loaded: SimpleNamespace) -> tuple[type, ...]:
    """The exceptions the base _load_single_item re-raises as ValueError ('Error while loading data ...'): its
    handler whose body raises ValueError (CLIENT_MEDIA_EXCEPTIONS from 0.5.17, ValueError before)."""
    method = _function(root, BASE_PROCESSOR, "_load_single_item", owner="BaseMultimodalProcessor")
    for handler in (n for n in ast.walk(method) if isinstance(n, ast.ExceptHandler)):
        raises = [n for n in ast.walk(handler) if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call)]
        if any(isinstance(r.exc.func, ast.Name) and r.exc.func.id == "ValueError" for r in raises):
            name = handler.type.id
            found = getattr(loaded, name, None) or {"ValueError": ValueError}[name]
            return found if isinstance(found, tuple) else (found,)
    raise LookupError("no ValueError handler in _load_single_item")
