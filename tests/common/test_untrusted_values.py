"""Property tests over untrusted values (issue 46): whatever JSON a client sends, the walkers of it end with a
clear error or a result, never another exception or a recursion (the schema analysis, the nesting measures, the
router's routing text, the public form of an error message)."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import radixgen
from radixgen.common.constraint import constraint_text
from radixgen.common.grammar.schema import ConstraintError, analyze_schema, parse_schema
from radixgen.common.http_errors import public_message
from radixgen.common.nesting import MAX_SCHEMA_DEPTH, NestingError, text_depth, value_depth
from radixgen.router.proxy import prompt_text

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(alphabet=st.sampled_from('ab"\\[]{}#/$:'), max_size=8)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=40)

KEYWORDS = ["type", "properties", "required", "items", "prefixItems", "anyOf", "oneOf", "allOf", "$ref", "$defs",
            "enum", "const", "format", "pattern", "minLength", "maxLength", "minimum", "additionalProperties",
            "propertyNames", "unevaluatedItems", "exclusiveMinimum", "multipleOf", "not", "if", "nullable"]
REFS = st.sampled_from(["#", "#/$defs/a", "#/$defs/b", "#/properties/x", "#/items", "#/nope", "other.json#/a",
                        "#/$defs/a/properties/x", "#/anyOf/0"])
schema_values = st.recursive(
    scalars | REFS | st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(KEYWORDS) | st.sampled_from(["a", "b", "x"]), inner, max_size=5),
    max_leaves=30)


@SETTINGS
@given(json_values)
def test_the_depth_of_a_text_is_the_depth_of_its_value(value):
    assert text_depth(json.dumps(value)) == value_depth(value)
    assert text_depth(json.dumps(value).encode()) == value_depth(value)


@SETTINGS
@given(schema_values)
def test_schema_analysis_ends_with_a_result_or_a_constraint_error(schema):
    for given_schema in (schema, {"$defs": {"a": schema, "b": {"$ref": "#/$defs/a"}}, "anyOf": [schema]}):
        try:
            analyze_schema(given_schema)
        except ConstraintError:
            pass
        try:
            parse_schema(json.dumps(given_schema))
        except ConstraintError:
            pass


def _nest(levels: int) -> dict:
    node: dict = {"type": "string"}
    for _ in range(levels):
        node = {"type": "array", "items": node}
    return node


@pytest.mark.parametrize("levels", [MAX_SCHEMA_DEPTH, 5000])
def test_deep_schemas_are_refused_by_name_wherever_they_enter(levels):
    deep = _nest(levels)
    with pytest.raises(ConstraintError, match=f"deeper than the limit of {MAX_SCHEMA_DEPTH}"):
        analyze_schema(deep)
    text = '{"items": ' * levels + "{}" + "}" * levels
    with pytest.raises(ConstraintError, match=f"deeper than the limit of {MAX_SCHEMA_DEPTH}"):
        parse_schema(text)
    with pytest.raises(NestingError, match=f"deeper than the limit of {MAX_SCHEMA_DEPTH}"):
        constraint_text("json_schema", deep)  # the DSL's and the Engine's dict schemas
    chain = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(levels)}, "$ref": "#/$defs/d0"}
    chain["$defs"][f"d{levels}"] = {"type": "string"}
    with pytest.raises(ConstraintError, match=f"limit of {MAX_SCHEMA_DEPTH} levels"):
        analyze_schema(chain)


@SETTINGS
@given(st.dictionaries(st.sampled_from(["text", "prompt", "input_ids", "messages", "image_data", "lora_path",
                                        "model"]), json_values, max_size=4))
def test_the_routers_routing_text_takes_any_payload(payload):
    assert isinstance(prompt_text(payload), str)


def test_the_routers_routing_text_takes_deep_nesting():
    deep = json.loads("[" * 900 + "]" * 900)
    for payload in ({"prompt": deep}, {"text": "x", "image_data": deep}, {"text": ["a"], "image_data": [deep]},
                    {"messages": [{"content": [{"type": "image_url", "image_url": {"url": deep}}]}]}):
        assert isinstance(prompt_text(payload), str)


@SETTINGS
@given(st.text(max_size=40), st.sampled_from([400, 404, 422, 500, 503]))
def test_an_error_message_never_shows_a_path_of_the_server(tail, status):
    own = os.path.dirname(radixgen.__file__)
    for message in (f"{tail} {own}/runtime/x.py:12 {tail}", f"[12:00:01] /project/cpp/parser.cc:82: {tail}",
                    f"{tail}: {os.getcwd()}/secret/config.json"):
        public = public_message(message, status)
        assert own not in public and "/project/cpp" not in public and os.getcwd() + "/" not in public
