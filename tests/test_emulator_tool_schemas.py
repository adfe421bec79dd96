"""The emulator checks a request's tool schemas as SGLang does (walk of issue 30): SGLang 0.5.14 to 0.5.23
(`serving_chat.py` `_validate_request`) rewrite known type aliases in place (`normalize_json_schema_types`), then
answer 400 "Tool {i} function has invalid 'parameters' schema: ..." for a schema JSON Schema's metaschema refuses.
The emulator took every schema, so xlam's `{"type": {"type": "str", ...}}` (an argument named `type`) ran in
`regen simulate` and in emulated runs, and failed on every real SGLang server."""
from __future__ import annotations

import json

import pytest
from jsonschema import Draft202012Validator, SchemaError

from pipeline.emulator import start_emulator
from tests.helpers import post_json

XLAM_TYPE = {"type": {"description": "The type of giveaways to retrieve (e.g., game, loot, beta).", "type": "str",
                      "default": "game"}}


def tool(parameters, name="f"):
    return {"type": "function", "function": {"name": name, "description": "d", "parameters": parameters}}


@pytest.fixture(scope="module")
def emulator():
    p = start_emulator(preset="kimi")
    yield p
    p.stop()


def post(url: str, tools: list) -> tuple[int, dict]:
    body = {"model": "moonshotai/Kimi-K2.5", "messages": [{"role": "user", "content": "giveaways?"}],
            "max_tokens": 8, "tools": tools}
    return post_json(url + "/v1/chat/completions", body)


def test_a_schema_sglang_refuses_is_a_400_with_its_message_and_one_it_rewrites_passes(emulator):
    with pytest.raises(SchemaError) as refused:
        Draft202012Validator.check_schema(json.loads(json.dumps(XLAM_TYPE)))
    status, body = post(emulator.url, [tool({"type": "object", "properties": {}}), tool(XLAM_TYPE, "g")])
    assert status == 400 and body["code"] == 400 and body["type"] == "BadRequestError"
    assert body["message"] == f"Tool 1 function has invalid 'parameters' schema: {refused.value}"
    # BFCL's and ORM aliases SGLang rewrites before its check: accepted
    bfcl = {"type": "dict", "properties": {"n": {"type": "integer"}, "x": {"type": "float"},
                                           "t": {"type": "tuple", "items": {"type": "str"}},
                                           "m": {"type": "varchar(255)"}, "l": {"type": "List[int]"}},
            "required": ["n"], "optional": ["x"]}
    assert post(emulator.url, [tool(bfcl)])[0] == 200
    # xlam's arguments without `properties` whose names are no keyword: JSON Schema ignores unknown keys
    assert post(emulator.url, [tool({"symbol": {"type": "str", "description": "ticker"}})])[0] == 200
    # a type SGLang has no alias for
    status, body = post(emulator.url, [tool({"type": "object", "properties": {"a": {"type": "any"}}})])
    assert status == 400 and body["message"].startswith("Tool 0 function has invalid 'parameters' schema: 'any'")


@pytest.mark.parametrize("version", ["0.5.14", "0.5.17", "0.5.18", "0.5.23"])
def test_the_type_rewrite_is_sglangs_own_on_random_schemas(version):
    """The emulator's `normalise_types` against each version's `normalize_json_schema_types`, taken from its
    wheel's source (`make sglang-wheels`), on 2,000 random schemas of aliases, nested types and type lists."""
    import copy
    import random

    from tests.test_sglang_conformance import wheel

    from pipeline.emulator.tool_schemas import normalise_types

    src = (wheel(version) / "sglang/srt/function_call/utils.py").read_text()
    start = src.index("_STANDARD_JSON_SCHEMA_TYPES")
    end = src.index("\ndef ", src.index("def normalize_json_schema_types") + 10)
    ns: dict = {}
    exec("from typing import *\n" + src[start:end], ns)
    types = ["str", "int", "List[int]", "float, optional", "dict", "tuple", "any", "varchar(255)", "Dict[str, int]",
             "integer", "bool", "unsigned int", "long", "numeric(10,2)", "list_price", "internal", "object",
             "HashMap", "String", "Array", "Int32", "uint8", "set", "map"]
    rng = random.Random(30)

    def schema(depth=0):
        s: dict = {"type": rng.choice(types) if rng.random() < .8 else [rng.choice(types), rng.choice(types)]}
        for key, share in (("properties", .5), ("items", .3), ("anyOf", .2), ("additionalProperties", .1)):
            if depth < 2 and rng.random() < share:
                s[key] = ({f"p{i}": schema(depth + 1) for i in range(2)} if key == "properties" else
                          [schema(depth + 1)] if key == "anyOf" else schema(depth + 1))
        return s

    for _ in range(2000):
        s = schema()
        theirs, ours = copy.deepcopy(s), copy.deepcopy(s)
        ns["normalize_json_schema_types"](theirs)
        normalise_types(ours)
        assert ours == theirs, s
