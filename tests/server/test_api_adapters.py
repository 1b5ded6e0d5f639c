"""The Anthropic / Ollama / KServe v2 adapters' pure parts, without a server: Anthropic blocks -> chat messages
(images, tool results in order, earlier thinking dropped) and chat deltas -> content blocks and events; Ollama's
options and format onto the request contract; v2 tensors in JSON and binary form (hostile nesting and
truncated data are 400s); error bodies rewritten into each API's shape."""

from __future__ import annotations

import json
import struct

import orjson
import pytest

from radixgen.common.http_errors import APIError, error_body
from radixgen.runtime.server.anthropic_api import ContentBlocks, anthropic_error
from radixgen.runtime.server.anthropic_protocol import CountTokensRequest, MessagesRequest, chat_messages, to_chat
from radixgen.runtime.server.api_errors import ErrorShape, reshape
from radixgen.runtime.server.kserve_tensors import HEADER_LENGTH, read_request, write_response
from radixgen.runtime.server.ollama_api import Reply, _fold
from radixgen.runtime.server.ollama_protocol import Options, response_format


def test_anthropic_blocks_become_chat_messages():
    req = CountTokensRequest.model_validate({
        "model": "m", "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "iVBORw0KGgo="}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                              {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                          "content": [{"type": "text", "text": "boom"}]},
                                         {"type": "text", "text": "Try again."}]}]})
    msgs = chat_messages(req)
    assert msgs[0] == {"role": "system", "content": "Be brief."}
    assert msgs[1]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    assert msgs[2] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    assert msgs[3] == {"role": "tool", "tool_call_id": "t1", "content": "Error: boom"}  # before the turn's text
    assert msgs[4] == {"role": "user", "content": "Try again."}


def test_anthropic_request_maps_onto_the_chat_request():
    chat = to_chat(MessagesRequest.model_validate({
        "model": "m", "max_tokens": 50, "stop_sequences": ["END"], "top_k": 5, "temperature": 0.5,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 10},
        "output_config": {"effort": "max"}}))
    assert (chat.max_tokens, chat.stop, chat.top_k, chat.temperature) == (50, ["END"], 5, 0.5)
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.max_thinking_tokens == 10 and chat.reasoning_effort == "high"
    assert chat.continue_final_message  # an assistant prefill is continued
    with pytest.raises(APIError, match="budget_tokens"):
        to_chat(MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": "hi"}], "thinking": {"type": "enabled", "budget_tokens": 5}}))
    with pytest.raises(APIError, match="media_type"):
        chat_messages(CountTokensRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": "x"}}]}]}))


def test_content_blocks_and_their_events():
    blocks = ContentBlocks()
    events = blocks.feed([{"reasoning_content": "think"}, {"content": "Hi"}, {"content": "!"},
                          {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": ""}}]},
                          {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]},
                          {"tool_calls": [{"index": 0, "function": {"arguments": ": 2}"}}]}]) + blocks.close()
    kinds = [(e["type"], e["index"]) for e in events]
    assert kinds == [("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
                     ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1),
                     ("content_block_stop", 1), ("content_block_start", 2), ("content_block_delta", 2),
                     ("content_block_delta", 2), ("content_block_stop", 2)]
    assert blocks.blocks == [{"type": "thinking", "thinking": "think", "signature": ""},
                             {"type": "text", "text": "Hi!"},
                             {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 2}}]
    assert blocks.calls == 1


def test_ollama_options_and_format():
    opts = Options({"num_predict": -1, "repeat_penalty": 1.1, "temperature": 0, "stop": ["x"], "num_ctx": 64}, 2048)
    assert opts.fields == {"repetition_penalty": 1.1, "temperature": 0, "stop": ["x"]} and opts.num_ctx == 64
    assert Options({"num_predict": 5}, 2048).fields == {"max_tokens": 5}
    for bad, match in [({"mirostat": 2}, "mirostat"), ({"use_mmap": True}, "load-time"), ({"num_ctx": 4096}, "num_ctx"),
                       ({"nonsense": 1}, "unknown option")]:
        with pytest.raises(APIError, match=match):
            Options(bad, 2048)
    assert response_format("json") == {"type": "json_object"}
    assert response_format({"type": "object"})["json_schema"]["schema"] == {"type": "object"}
    assert response_format("") is None


def test_ollama_reply_sends_calls_whole_and_folds_a_stream():
    reply = Reply()
    assert reply.feed([{"reasoning_content": "hm"}, {"content": "Ok"}]) == ("Ok", "hm")
    assert reply.feed([{"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": '{"a":'}}]},
                       {"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}]) == ("", "")
    assert reply.tool_calls() == [{"function": {"index": 0, "name": "f", "arguments": {"a": 1}}}]
    lines = [{"model": "m", "message": {"role": "assistant", "content": "O", "thinking": "h"}, "done": False},
             {"model": "m", "message": {"role": "assistant", "content": "k"}, "done": False},
             {"model": "m", "message": {"role": "assistant", "content": "", "tool_calls": reply.calls}, "done": False},
             {"model": "m", "message": {"role": "assistant", "content": ""}, "done": True, "eval_count": 3}]
    whole: dict = {}
    for line in lines:
        whole = _fold(whole, line, "chat")
    assert whole["message"] == {"role": "assistant", "content": "Ok", "thinking": "h", "tool_calls": reply.calls}
    assert whole["done"] and whole["eval_count"] == 3


def _bytes(*values: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def test_v2_tensors_json_and_binary():
    header = orjson.dumps({"inputs": [
        {"name": "text_input", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": 16}},
        {"name": "max_tokens", "datatype": "INT32", "shape": [1], "parameters": {"binary_data_size": 4}},
        {"name": "temperature", "datatype": "FP32", "shape": [1, 1], "data": [[0.5]]}]})
    body = header + _bytes(b"hello", b"h\xc3\xa9") + struct.pack("<i", 7)
    _, inputs = read_request(body, str(len(header)))
    assert inputs == {"text_input": ([2], ["hello", "hé"]), "max_tokens": ([1], [7]), "temperature": ([1, 1], [0.5])}
    content, headers = write_response({"model_name": "m"}, [("text_output", "BYTES", [2], ["a", "hé"]),
                                                            ("num_output_tokens", "UINT32", [2], [1, 2])],
                                      {"text_output"})
    n = int(headers[HEADER_LENGTH])
    head = json.loads(content[:n])
    assert head["outputs"][0]["parameters"]["binary_data_size"] == len(content) - n == 4 + 1 + 4 + 3
    assert head["outputs"][1]["data"] == [1, 2] and content[n:] == _bytes(b"a", "hé".encode())


@pytest.mark.parametrize("body, header, match", [
    (orjson.dumps({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                               "parameters": {"binary_data_size": 8}}]}) + b"\x09\x00\x00\x00abcd", True,
     "runs past"),
    (orjson.dumps({"inputs": [{"name": "t", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 3}}]})
     + b"abc", True, "whole number"),
    (b'{"inputs": [{"name": "t", "datatype": "BYTES", "shape": [1], "data": ' + b"[" * 900 + b"]" * 900 + b"}]}",
     False, "elements"),
    (b"{" * 5000, False, "not valid JSON"),
])
def test_v2_hostile_tensors_are_400(body, header, match):
    length = None
    if header:
        length = str(body.index(b"}]}") + 3)
    with pytest.raises(APIError, match=match) as e:
        read_request(body, length)
    assert e.value.status == 400


def test_v2_flatten_is_iterative():
    from radixgen.runtime.server.kserve_tensors import _flat

    deep: list = ["x"]
    for _ in range(20_000):  # far past the recursion limit
        deep = [deep]
    assert _flat(deep, "input") == ["x"]


def test_errors_are_rewritten_into_each_apis_shape():
    body = orjson.dumps(error_body(404, "no such model", "model", "model_not_found"))
    assert orjson.loads(reshape(body, 404, anthropic_error)) == {
        "type": "error", "error": {"type": "not_found_error", "message": "no such model"}}
    assert orjson.loads(reshape(body, 404, lambda s, m, c: {"error": m})) == {"error": "no such model"}
    assert reshape(b'{"models": []}', 404, anthropic_error) is None
    shape = ErrorShape("/v2", anthropic_error)
    assert shape.covers("/v2") and shape.covers("/v2/models/m") and not shape.covers("/v2x")
