"""Hostile input against the shared server subprocess, round 4 (issue 46 items 2, 3 and 7): schemas and
bodies nested past the limits are a 400 naming the limit on every surface (never the RecursionError's 503);
a recursive $ref schema works under every tool_choice mode; no error body shows a path of the server's own.
Afterwards the server still serves with its KV invariant holding."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from checks import assert_still_serves
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import radixgen

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Make a tree."}]
DEPTH = 300  # levels of nested properties: past any limit, short of nothing in Python's default recursion


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


def _deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"], "additionalProperties": False}
    return schema


def _tool(parameters: dict, strict: bool = True) -> dict:
    return {"type": "function", "function": {"name": "grow", "parameters": parameters, "strict": strict}}


def _limit_error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "deeper than the limit of" in err["message"], err
    return err


@pytest.mark.parametrize("surface", ["chat_tool", "chat_tool_required", "chat_response_format", "responses_tool",
                                     "generate_text", "generate_ebnf_text", "completions"])
def test_a_deep_schema_is_a_400_naming_the_limit(http, surface):
    deep = _deep_schema(DEPTH)
    if surface == "chat_tool":
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "tools": [_tool(deep)]})
    elif surface == "chat_tool_required":
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "tool_choice": "required",
                                                    "tools": [_tool(deep, strict=False)]})
    elif surface == "chat_response_format":
        fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": deep, "strict": True}}
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "response_format": fmt})
    elif surface == "responses_tool":
        r = http.post("/v1/responses", json={"input": "x", "max_output_tokens": 2, "tools": [
            {"type": "function", "name": "grow", "parameters": deep, "strict": True}]})
    elif surface == "generate_text":  # a schema as text: no body limit sees inside it
        r = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2,
                                                                           "json_schema": json.dumps(deep)}})
    elif surface == "generate_ebnf_text":
        chain = "\n".join(f'r{i} ::= "(" r{i + 1} ")"' for i in range(DEPTH)) + f'\nr{DEPTH} ::= "x"'
        r = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2,
                                                                           "ebnf": "root ::= r0\n" + chain}})
        assert r.status_code in (200, 400), r.text  # a long chain of rules is fine; it just must not fail 5xx
        return
    else:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "json_schema": json.dumps(deep)})
    _limit_error(r)


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/v1/completions", "/v1/responses",
                                  "/tokenize"])
def test_a_deeply_nested_body_is_a_400_on_every_route(http, path):
    nested = "[" * 5000 + "]" * 5000  # deep enough for any recursive parser; well under the byte limit
    r = http.post(path, content=b'{"text": "x", "prompt": "x", "input": "x", "extra": ' + nested.encode() + b"}")
    err = _limit_error(r)
    assert err["code"] == "too_deeply_nested"
    r = http.post("/generate", json={"text": "x", "image_data": json.loads("[" * 120 + "]" * 120),
                                     "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400, r.text  # within the body limit: refused for what it is, not by a recursion


def test_a_cycle_of_refs_does_not_hang_the_server(http):
    """oneOf over two refs that each point at themselves: the discriminator search used to loop forever."""
    schema = {"$defs": {"a": {"$ref": "#/$defs/a"}, "b": {"$ref": "#/$defs/b"}},
              "oneOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}]}
    r = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2, "json_schema": schema}},
                  timeout=60)
    assert r.status_code in (200, 400), r.text
    assert_still_serves(http)


TREE = {"$defs": {"node": {"type": "object", "properties": {
    "v": {"type": "integer", "enum": [1, 2]},
    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 1}},
    "required": ["v", "kids"], "additionalProperties": False}}, "$ref": "#/$defs/node"}
ROOT_TREE = {"type": "object", "properties": {"v": {"type": "integer", "enum": [1, 2]},
                                              "kid": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
             "required": ["v", "kid"], "additionalProperties": False}


@pytest.mark.parametrize("parameters", [TREE, ROOT_TREE], ids=["defs", "root"])
@pytest.mark.parametrize("choice", ["auto", "required", "named", "required_one"])
def test_a_recursive_ref_schema_works_under_every_tool_choice(http, parameters, choice):
    tools = [_tool(parameters), {"type": "function", "function": {"name": "other", "parameters": TREE}}]
    tool_choice = {"type": "function", "function": {"name": "grow"}} if choice == "named" else (
        "required" if choice.startswith("required") else "auto")
    body = {"messages": CHAT, "max_tokens": 8, "temperature": 0, "tools": tools, "tool_choice": tool_choice}
    if choice == "required_one":
        body["parallel_tool_calls"] = False
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


def _own_paths() -> list[str]:
    return [os.path.dirname(radixgen.__file__), os.getcwd(), "/project/", ".cc:", ".py"]


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, "regex": "(a"}}),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, "ebnf": "root ::= foo"}}),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, "json_schema": '{"type": "foo"}'}}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "regex": "(a"}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "ebnf": "root ::= foo"}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "foo"}}}}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "tools": [_tool({"type": "foo"})]}),
    ("/v1/responses", {"input": "x", "max_output_tokens": 2, "text": {"format": {
        "type": "json_schema", "name": "t", "schema": {"type": "object", "properties": {"a": {"type": "foo"}}}}}}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "regex": "(a"}),
])
def test_error_bodies_show_no_path_of_the_server(http, path, body):
    r = http.post(path, json=body)
    assert 400 <= r.status_code < 500, r.text
    for own in _own_paths():
        assert own not in r.text, (own, r.text)


@pytest.mark.parametrize("schema", [{"type": [[]]}, {"required": 1}, {"prefixItems": 1},
                                    {"type": "object", "properties": {"a": {"type": [["string"]]}}}])
def test_schema_keywords_of_the_wrong_type_are_400s(http, schema):
    """Found by the property test of the schema analysis (tests/common/test_untrusted_values.py): these were 500s."""
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    for r in (http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "response_format": fmt}),
              http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2,
                                                                             "json_schema": json.dumps(schema)}}),
              http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "tools": [
                  _tool({"type": "object", "properties": {"a": schema}})]})):
        assert r.status_code == 400, r.text


_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=12)
_FIELDS = {  # /generate and /v1/chat/completions: test_fuzz.py
    "/v1/completions": ["prompt", "model", "max_tokens", "echo", "logit_bias", "best_of", "suffix", "n", "stop"],
    "/v1/responses": ["input", "model", "instructions", "tools", "text", "previous_response_id", "max_output_tokens",
                      "reasoning", "store", "tool_choice"],
}
_SAFE = {"/v1/completions": {"prompt": "Hi", "max_tokens": 2}, "/v1/responses": {"input": "Hi", "max_output_tokens": 2}}


@pytest.mark.parametrize("path", list(_FIELDS))
def test_any_body_gets_an_answer_that_is_not_a_server_error(http, path):
    """Property test over request bodies: a valid small body with some fields replaced by arbitrary JSON values
    is answered with a 2xx or a 4xx in the API's error shape, never a 5xx (or a hang)."""

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.dictionaries(st.sampled_from(_FIELDS[path]), _values, min_size=1, max_size=3))
    def check(fields):
        body = {**_SAFE[path], **fields}
        for k in ("max_tokens", "max_output_tokens"):  # a length that is no number is the 400 under test; any
            if k in body and (body[k] is None or (type(body[k]) is int and body[k] > 2)):  # other: at most 2
                body[k] = 2
        body["stream"] = False
        r = http.post(path, content=json.dumps(body, allow_nan=True).encode())
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text

    check()


def test_still_serves_after_all(http):
    assert_still_serves(http)
