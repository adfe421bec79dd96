"""A chat request's tool schemas checked as SGLang checks them (0.5.14 to 0.5.23, identical in each:
`serving_chat.py` `_validate_request`, `function_call/utils.py` `normalize_json_schema_types`).

SGLang rewrites non-standard `type` values (DB/ORM aliases such as `varchar`, `str`, `dict[...]`; BFCL's `dict`,
`float`, `tuple`) in place, then refuses a `parameters` schema that JSON Schema's 2020-12 metaschema rejects with a
400 "Tool {i} function has invalid 'parameters' schema: {error}". An alias it does not know (BFCL's `any`) stays,
and is refused; so is xlam's argument named `type` (`{"type": {"type": "str", ...}}`: a `type` that is an object).
The emulator checks a copy: what it renders is the request as sent.
"""
from __future__ import annotations

import copy
from typing import Any

from .errors import RequestInvalid

_STANDARD = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})
_ALIASES = {"str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
            "uuid": "string", "date": "string", "datetime": "string", "time": "string", "timestamp": "string",
            "binary": "string", "blob": "string", "bytea": "string", "bytes": "string", "varbinary": "string",
            "bool": "boolean", "bigint": "integer", "smallint": "integer", "tinyint": "integer",
            "double": "number", "decimal": "number", "real": "number", "numeric": "number", "arr": "array",
            "tuple": "array", "set": "array", "map": "object"}
_PREFIX_RULES = ((("int", "uint", "long", "short", "unsigned"), "integer"), (("num", "float"), "number"),
                 (("list",), "array"), (("dict",), "object"))
_BOUNDARY = frozenset("0123456789[<( \t")


def _prefixed(base: str, prefixes: tuple[str, ...]) -> bool:
    return any(base == p or (len(base) > len(p) and base.startswith(p) and base[len(p)] in _BOUNDARY)
               for p in prefixes)


def _single(raw: Any) -> Any:
    if not isinstance(raw, str) or raw in _STANDARD:
        return raw
    base = raw.split("(", 1)[0].strip().lower()
    if base in _STANDARD:
        return base
    if base in _ALIASES:
        return _ALIASES[base]
    for prefixes, target in _PREFIX_RULES:
        if _prefixed(base, prefixes):
            return target
    return raw


def normalise_types(schema: Any) -> None:
    """SGLang's `normalize_json_schema_types`: the `type`s of a schema rewritten in place, through its
    subschemas."""
    if isinstance(schema, list):
        for item in schema:
            normalise_types(item)
        return
    if not isinstance(schema, dict):
        return
    if "type" in schema:
        kind = schema["type"]
        if isinstance(kind, str):
            schema["type"] = _single(kind)
        elif isinstance(kind, list):
            out: list[Any] = []
            for item in kind:
                item = _single(item)
                if item not in out:
                    out.append(item)
            schema["type"] = out
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        nested = schema.get(key)
        if isinstance(nested, dict):
            for value in nested.values():
                normalise_types(value)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        nested = schema.get(key)
        if isinstance(nested, list):
            for value in nested:
                normalise_types(value)
    for key in ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                "unevaluatedItems", "unevaluatedProperties"):
        if key in schema:
            normalise_types(schema[key])


def check_tools(tools: Any) -> None:
    """SGLang's 400 for the first tool whose `parameters` the metaschema refuses after the type rewrite."""
    if not isinstance(tools, list):
        return
    from jsonschema import Draft202012Validator, SchemaError  # a dependency of ray

    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        parameters = function.get("parameters") if isinstance(function, dict) else None
        if parameters is None:
            continue
        schema = copy.deepcopy(parameters)
        try:
            normalise_types(schema)
            Draft202012Validator.check_schema(schema)
        except SchemaError as e:
            raise RequestInvalid(f"Tool {i} function has invalid 'parameters' schema: {e}") from None
        except RecursionError:
            raise RequestInvalid(f"Tool {i} function 'parameters' schema is too deeply nested or contains a "
                                 "cycle.") from None
