"""/v1/responses end to end: a real `radixgen serve` of the tiny random Qwen3 (tests/qwen3_chat.py's template)
with the qwen3_coder tool-call format, through the `openai` client's `responses.create` (whole and
streamed). The answer of a response equals the chat completion of the same messages; reasoning is its own
output item; function calls stream their arguments and a later turn sends their outputs back; strict tools
in the qwen3_coder format and text.format hold at temperature 1; bad input is a 400 naming the problem."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from qwen3_chat import qwen3_chat_model
from server_proc import start_server, stop_server

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "days": {"type": "integer", "enum": [1, 2, 3]}},
                          "required": ["city", "days"], "additionalProperties": False}}
VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
           "additionalProperties": False}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}}
NO_THINKING = {"effort": "none"}  # the template closes the think block (enable_thinking false)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = qwen3_chat_model(tmp_path_factory.mktemp("qwen3-responses"))
    srv = start_server("--model", str(model), "--dtype", "float32", "--tool-call-parser", "qwen3_coder",
                       api_key=None)
    yield srv
    assert stop_server(srv) == 0, srv.log_tail()


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        yield client


def _events(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    return events


def test_text_answer_equals_the_chat_completion(oai):
    resp = oai.responses.create(model="m", input="What is the weather in Paris?", instructions="Be brief.",
                                max_output_tokens=8, temperature=0, reasoning=NO_THINKING)
    chat = oai.chat.completions.create(model="m", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert [i.type for i in resp.output] == ["message"]
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.output_tokens == chat.usage.completion_tokens <= 8
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    if chat.choices[0].finish_reason == "length":
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert oai.responses.retrieve(resp.id).output_text == resp.output_text  # stored (in memory)


def test_reasoning_item_then_json_whole_and_streamed(oai):
    kw = dict(model="m", input="Is the sky blue?", max_output_tokens=40, temperature=0, text=JSON_FORMAT,
              extra_body={"max_thinking_tokens": 5})
    resp = oai.responses.create(**kw)
    assert resp.status == "completed", resp
    thought, answer = resp.output
    assert thought.type == "reasoning" and thought.content[0].type == "reasoning_text" and thought.content[0].text
    jsonschema.validate(json.loads(answer.content[0].text), VERDICT)
    assert resp.usage.output_tokens_details.reasoning_tokens > 0
    events = _events(oai.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2:6] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta", "response.reasoning_text.delta"]
    assert kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought.content[0].text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer.content[0].text
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["reasoning", "message"]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1].response
    assert final.output_text == resp.output_text and final.usage.output_tokens == resp.usage.output_tokens


def test_function_calls_streamed_and_answered(oai):
    kw = dict(model="m", input="What is the weather in Oslo?", tools=[WEATHER], tool_choice="required",
              parallel_tool_calls=False, max_output_tokens=60, temperature=1.0, reasoning=NO_THINKING,
              extra_body={"seed": 4})
    resp = oai.responses.create(**kw)
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = _events(oai.responses.create(**kw, stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 2 and "".join(deltas) == args_done.arguments == call.arguments  # seeded: the same call
    # the next turn: the call and its output go back as input items (a reasoning item is accepted and not
    # rendered again), or through previous_response_id
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}
    thought = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "h"}]}
    follow = oai.responses.create(model="m", input=[{"role": "user", "content": "What is the weather in Oslo?"},
                                                    thought, *[i.model_dump(exclude_none=True) for i in resp.output],
                                                    result],
                                  tools=[WEATHER], tool_choice="none", max_output_tokens=6, temperature=0,
                                  reasoning=NO_THINKING)
    chained = oai.responses.create(model="m", previous_response_id=resp.id, input=[result], tools=[WEATHER],
                                   tool_choice="none", max_output_tokens=6, temperature=0, reasoning=NO_THINKING)
    assert follow.output_text and chained.output_text == follow.output_text
    assert chained.usage.input_tokens == follow.usage.input_tokens


def test_strict_qwen3_coder_call_or_json_answer_at_temperature_one(oai):
    """tool_choice auto with a text.format: each sample is a valid call in the qwen3_coder format (the
    server's grammar for that format) or a valid JSON answer, and both happen."""
    kinds = set()
    for seed in range(8):
        resp = oai.responses.create(model="m", input="Weather in Rome?", tools=[WEATHER], text=JSON_FORMAT,
                                    parallel_tool_calls=False, max_output_tokens=80, temperature=1.0,
                                    reasoning=NO_THINKING, extra_body={"seed": seed})
        assert resp.status == "completed", resp
        (item,) = resp.output
        kinds.add(item.type)
        if item.type == "function_call":
            jsonschema.validate(json.loads(item.arguments), WEATHER["parameters"])
        else:
            jsonschema.validate(json.loads(item.content[0].text), VERDICT)
    assert kinds == {"function_call", "message"}, kinds


@pytest.mark.parametrize("body, match", [
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, r"input\[0\]\.type: unknown input item type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, r"input\[0\]\.call_id: required"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     r"input\[0\]\.content\[0\]: only text parts"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, r"text\.format\.type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, r"text\.format\.schema: required"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, r"tools\[0\]\.type: only function tools"),
    ({"input": "hi", "tools": [{**WEATHER, "parameters": {"type": "object", "properties": {
        "x": {"type": "array", "uniqueItems": True}}}}]}, r"tools\[0\]\.function\.parameters.*uniqueItems"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {  # strict by default
        "type": "object", "anyOf": [{"properties": {"a": {"type": "integer"}}}]}}]},
     r"tools\[0\]\.function\.parameters.*/anyOf: not expressible in this tool-call format"),
    ({"input": "hi", "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice names function 'nope', not in tools"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "hi", "reasoning": {"effort": "max"}}, r"reasoning\.effort"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
])
def test_bad_input_is_400_naming_it(server, body, match):
    r = httpx.post(server.url + "/v1/responses", json={"model": "m", "max_output_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert re.search(match, r.json()["error"]["message"]), r.text


def test_unknown_previous_response_is_404_and_unstored_is_not_kept(oai):
    with pytest.raises(openai.NotFoundError, match="previous_response_id|not found"):
        oai.responses.create(model="m", input="hi", previous_response_id="resp_nope", max_output_tokens=2)
    resp = oai.responses.create(model="m", input="hi", max_output_tokens=2, store=False, reasoning=NO_THINKING)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(resp.id)
