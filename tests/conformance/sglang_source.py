"""Reading one installed SGLang version without running its package __init__ (which needs a GPU stack):
the package root is registered as a bare namespace, so `sglang.srt.entrypoints.openai.protocol` and its CPU
dependencies import alone. What does not import on CPU (GenerateReqInput, ServerArgs) is read with `ast`.

Used by the per-version subprocess (sglang_checks.py) and, for the error texts, by the test itself.
"""
from __future__ import annotations

import ast
import re
import sys
import types
from pathlib import Path


def install_namespace(root: Path) -> None:
    """Make `import sglang.x` find the wheel's modules under `root` without executing sglang/__init__.py."""
    package = types.ModuleType("sglang")
    package.__path__ = [str(root / "sglang")]
    sys.modules["sglang"] = package


def _class_fields(tree: ast.Module, name: str, seen: set[str] | None = None) -> set[str]:
    """Annotated fields of a class in one module, with those of its bases defined in the same module."""
    seen = seen if seen is not None else set()
    fields: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name and name not in seen:
            seen.add(name)
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    fields.add(item.target.id)
            for base in node.bases:
                if isinstance(base, ast.Name):
                    fields |= _class_fields(tree, base.id, seen)
    return fields


def generate_request_fields(root: Path) -> set[str]:
    """GenerateReqInput's fields (managers/io_struct.py), the body of POST /generate."""
    tree = ast.parse((root / "sglang/srt/managers/io_struct.py").read_text())
    return _class_fields(tree, "GenerateReqInput")


def server_arg_fields(root: Path) -> set[str]:
    """Every ServerArgs field: server_args.py (up to 0.5.18) or the groups of arg_groups/fields/ (0.5.23)."""
    fields: set[str] = set()
    tree = ast.parse((root / "sglang/srt/server_args.py").read_text())
    fields |= _class_fields(tree, "ServerArgs")
    for path in sorted((root / "sglang/srt/arg_groups/fields").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                fields |= _class_fields(ast.Module(body=[node], type_ignores=[]), node.name)
    return fields


def function_dict_keys(path: Path, function: str) -> set[str]:
    """The string keys of the dict literals a function builds (e.g. /model_info's answer)."""
    keys: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            for inner in ast.walk(node):
                if isinstance(inner, ast.Dict):
                    keys |= {k.value for k in inner.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                if isinstance(inner, ast.Subscript) and isinstance(inner.ctx, ast.Store) and \
                        isinstance(inner.slice, ast.Constant) and isinstance(inner.slice.value, str):
                    keys.add(inner.slice.value)
    return keys


# --- message texts -------------------------------------------------------------------------------------------
def message_templates(path: Path) -> list[str]:
    """Every string literal of a source file, f-strings with each `{...}` as `\\x00`, implicit concatenation
    joined (so a message split over lines is one text)."""
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.JoinedStr):
            out.append("".join(v.value if isinstance(v, ast.Constant) else "\x00" for v in node.values))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(node.value)
    return out


def templates_with(root: Path, files: tuple[str, ...], phrase: str) -> list[str]:
    found = []
    for name in files:
        path = root / name
        if path.exists():
            found += [t for t in message_templates(path) if phrase.lower() in t.lower()]
    return found


def render(template: str, value: str = "4242") -> str:
    """A message as the server sends it: every placeholder filled."""
    return template.replace("\x00", value)


def as_pattern(template: str) -> re.Pattern:
    """A template as a regex matching any filling of its placeholders."""
    return re.compile("^" + ".+?".join(re.escape(p) for p in template.split("\x00")) + "$", re.S)
