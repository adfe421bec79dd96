"""Tool schemas that are not JSON Schema, counted, and mapped only when the source spec asks (`schema_dialect`).

Benchmarks and toolkits write tool schemas in their own dialects. BFCL (the `bfcl-eval` package's data) uses
`"type": "dict"` (and `float`, `tuple`, `any`, Java and JavaScript names), `"optional": true` on a property or
`"optional": [...]` beside `required`, and dotted function names (`math.factorial`). None of these is JSON Schema,
and an OpenAI function name must match `^[a-zA-Z0-9_-]{1,64}$`.

What regen does: every tool schema a source gives is checked, and what is not JSON Schema is counted in the source's
report under `tool calls` (`schemas_with_types_not_json_schema`, `schemas_with_optional_keys`,
`tool_names_not_openai`, `schemas_with_bare_properties`: xlam's `parameters` that name the arguments without an
object schema's `properties`): the schemas are sent as given. With `schema_dialect: bfcl` in the source spec, they are
mapped the way BFCL maps them for OpenAI-style models itself (`bfcl_eval/model_handler/utils.py` convert_to_tool):
each type through BFCL's GORILLA_TO_OPENAPI table (an unknown one becomes `string`, as there), `parameters` an
`object`, dots in names replaced by `_`; `optional` keys are dropped (JSON Schema says it with `required`, which
BFCL's schemas carry). Each mapped schema is counted (`schemas_mapped_from_bfcl`). A schema is never changed without
the spec asking, and never without a count (docs/sources-tool-calls.md, section Schema dialects).
"""
from __future__ import annotations

import re
from typing import Any

from .records import Tally

DIALECTS = ("bfcl",)
JSON_SCHEMA_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
OPENAI_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# BFCL's own table (bfcl_eval/constants/type_mappings.py GORILLA_TO_OPENAPI, bfcl-eval 2026.3.23)
BFCL_TYPES = {"integer": "integer", "number": "number", "float": "number", "string": "string", "boolean": "boolean",
              "bool": "boolean", "array": "array", "list": "array", "dict": "object", "object": "object",
              "tuple": "array", "any": "string", "byte": "integer", "short": "integer", "long": "integer",
              "double": "number", "char": "string", "ArrayList": "array", "Array": "array", "HashMap": "object",
              "Hashtable": "object", "Queue": "array", "Stack": "array", "Any": "string", "String": "string",
              "Bigint": "integer"}
SCHEMA_KINDS = frozenset({"schemas_with_types_not_json_schema", "schemas_with_optional_keys", "tool_names_not_openai",
                          "schemas_with_bare_properties", "schemas_mapped_from_bfcl"})  # the counts this module adds
# Keywords whose value is a subschema (an object) in a JSON Schema: a `parameters` object holding one is a schema
SUBSCHEMA_KEYWORDS = frozenset({"properties", "patternProperties", "additionalProperties", "items", "not", "if",
                                "then", "else", "$defs", "definitions", "dependentSchemas", "propertyNames",
                                "contains", "unevaluatedProperties", "unevaluatedItems"})
SCHEMA_KEYS = ("properties", "items", "additionalProperties", "anyOf", "oneOf", "allOf", "prefixItems")


def _walk(schema: Any, found: set[str]) -> None:
    """What in one (sub)schema is not JSON Schema: its `type`s and `optional` keys, through its subschemas."""
    if isinstance(schema, list):
        for item in schema:
            _walk(item, found)
        return
    if not isinstance(schema, dict):
        return
    kind = schema.get("type")
    types = kind if isinstance(kind, list) else [kind] if isinstance(kind, str) else []
    if any(t not in JSON_SCHEMA_TYPES for t in types):
        found.add("schemas_with_types_not_json_schema")
    if isinstance(schema.get("optional"), (bool, list)):
        found.add("schemas_with_optional_keys")
    for key in SCHEMA_KEYS:
        sub = schema.get(key)
        if key == "properties" and isinstance(sub, dict):
            for value in sub.values():
                _walk(value, found)
        elif isinstance(sub, (dict, list)):
            _walk(sub, found)


def findings(tool: dict[str, Any]) -> set[str]:
    """What about one OpenAI tool (`{"type": "function", "function": {...}}`) is not JSON Schema or OpenAI's."""
    function = tool.get("function") or {}
    found: set[str] = set()
    if not OPENAI_NAME.match(str(function.get("name", ""))):
        found.add("tool_names_not_openai")
    parameters = function.get("parameters")
    if bare_properties(parameters):
        found.add("schemas_with_bare_properties")
    else:
        _walk(parameters, found)
    return found


def bare_properties(parameters: Any) -> bool:
    """`parameters` that name the arguments themselves (xlam: `{"symbol": {"type": "str", ...}}`) instead of an
    object schema with `properties`: a non-empty object whose every value is an object, with no string or list
    `type` and no keyword whose value is a subschema."""
    if not isinstance(parameters, dict) or not parameters:
        return False
    if isinstance(parameters.get("type"), (str, list)) or SUBSCHEMA_KEYWORDS & parameters.keys():
        return False
    return all(isinstance(value, dict) for value in parameters.values())


def checked_tools(tools: list[dict[str, Any]], dialect: str | None, tally: Tally) -> list[dict[str, Any]]:
    """The tools as sent: counted (module docstring), mapped where the spec names their dialect."""
    out = []
    for tool in tools:
        found = findings(tool)
        if found and dialect == "bfcl":
            tool = from_bfcl(tool)
            tally.tool("schemas_mapped_from_bfcl")
        for kind in found:
            tally.tool(kind)
        out.append(tool)
    return out


def _bfcl_schema(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_bfcl_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "optional" and isinstance(value, (bool, list)):
            continue
        if key == "type" and isinstance(value, str):
            value = value if value in JSON_SCHEMA_TYPES else BFCL_TYPES.get(value, "string")
        elif key == "properties" and isinstance(value, dict):
            value = {name: _bfcl_schema(sub) for name, sub in value.items()}
        elif key in SCHEMA_KEYS:
            value = _bfcl_schema(value)
        out[key] = value
    return out


def from_bfcl(tool: dict[str, Any]) -> dict[str, Any]:
    """One tool mapped from BFCL's dialect (a new object; the record's is not changed)."""
    function = dict(tool["function"])
    function["name"] = re.sub(r"\.", "_", str(function["name"]))
    parameters = function.get("parameters")
    if isinstance(parameters, dict):
        function["parameters"] = {**_bfcl_schema(parameters), "type": "object"}
    return {**tool, "function": function}


def looks_like_tools(value: Any) -> bool:
    """A field that looks like tool schemas: a non-empty list (or a string holding a JSON one) whose every item is
    an object with a string `name` and an object `parameters`, or `{"type": "function", "function": <such an
    object>}`. Cheap first: a string is parsed only if it starts with `[` and holds `"parameters"`."""
    if isinstance(value, str):
        text = value.lstrip()
        if not text.startswith("[") or '"parameters"' not in text:
            return False
        import orjson

        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            return False
    if not isinstance(value, (list, tuple)) or not value:
        return False
    return all(_schema_like(item) for item in value)


def _schema_like(item: Any) -> bool:
    if isinstance(item, dict) and isinstance(item.get("function"), dict):
        item = item["function"]
    return isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("parameters"), dict)
