"""Reasoning and tool calls end to end: a real `radixgen serve` of the tiny random Qwen3 with a Qwen3-style
chat template (tests/qwen3_chat.py: it renders tools and a <think> block, so both formats are detected from it),
through the `openai` client. The random model's text is steered into a think block or a call by a regex
(SGLang's extra-body constraint), so every assertion is about what the server makes of real output."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from qwen3_chat import qwen3_chat_model
from server_proc import start_server, stop_server

from radixgen.runtime.server.launch import ServerConfig

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "days": {"type": "integer", "enum": [1, 2, 3, 4, 5]}},
                   "required": ["city", "days"], "additionalProperties": False}}}
ANSWER = r"[A-Z][a-z]{2,10}\."
CALL = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city":"[A-Z][a-z]{2,12}",'
        r'"days":[1-5]\}\}\n</tool_call>')
VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
           "additionalProperties": False}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    model = qwen3_chat_model(tmp_path_factory.mktemp("qwen3-chat"))
    srv = start_server("--model", str(model), "--dtype", "float32", api_key=None)
    yield srv
    assert stop_server(srv) == 0, srv.log_tail()


@pytest.fixture
def oai(qwen3_server):
    with openai.OpenAI(base_url=qwen3_server.url + "/v1", api_key="none", max_retries=0) as client:
        yield client


def _extra(obj, name):
    return (obj.model_extra or {}).get(name)


def test_reasoning_separated_whole_and_streamed(oai):
    """The budget closes the random model's think block after 6 tokens; the answer's regex starts after it."""
    kw = dict(model="m", messages=USER, max_tokens=40, temperature=0)
    body = {"regex": ANSWER, "max_thinking_tokens": 6}
    msg = oai.chat.completions.create(**kw, extra_body=body).choices[0].message
    thought = _extra(msg, "reasoning_content")
    assert thought and "</think>" not in thought and "<think>" not in (msg.content or "")
    assert _extra(msg, "reasoning") == thought  # vLLM's name too
    assert re.fullmatch(ANSWER, msg.content)
    reasoning, content = [], []
    for chunk in oai.chat.completions.create(**kw, stream=True, extra_body=body):
        for c in chunk.choices:
            reasoning.append(_extra(c.delta, "reasoning_content") or "")
            content.append(c.delta.content or "")
    assert "".join(reasoning) == thought and "".join(content) == msg.content
    assert sum(1 for r in reasoning if r) > 1  # streamed as it comes

    held = oai.chat.completions.create(**kw, stream=True, extra_body={**body, "stream_reasoning": False})
    pieces = [_extra(c.delta, "reasoning_content") for ch in held for c in ch.choices]
    assert [p for p in pieces if p] == [thought]  # one delta once the block ends

    kept = oai.chat.completions.create(**kw, extra_body={**body, "separate_reasoning": False}).choices[0].message
    assert kept.content.startswith(thought) and "</think>" in kept.content
    assert _extra(kept, "reasoning_content") is None


def test_json_schema_after_thinking_at_temperature_one(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
    out = oai.chat.completions.create(model="m", messages=USER, max_tokens=40, temperature=1.0, seed=3, n=6,
                                      response_format=fmt, extra_body={"max_thinking_tokens": 5})
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        assert _extra(choice.message, "reasoning_content")
        jsonschema.validate(json.loads(choice.message.content), VERDICT)


def test_enable_thinking_false_closes_the_block_in_the_prompt(oai):
    out = oai.chat.completions.create(model="m", messages=USER, max_tokens=8, temperature=0, extra_body=NO_THINKING)
    msg = out.choices[0].message
    assert _extra(msg, "reasoning_content") is None and msg.content  # an answer, no thinking
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
    out = oai.chat.completions.create(model="m", messages=USER, max_tokens=20, temperature=0, response_format=fmt,
                                      extra_body=NO_THINKING)
    jsonschema.validate(json.loads(out.choices[0].message.content), VERDICT)  # JSON from the first token


def test_tool_call_streamed_as_deltas_and_whole(oai):
    kw = dict(model="m", messages=USER, tools=[{**WEATHER, "function": {**WEATHER["function"], "strict": False}}],
              max_tokens=80, temperature=0)
    body = {"regex": CALL, **NO_THINKING}
    whole = oai.chat.completions.create(**kw, extra_body=body).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    (call,) = whole.message.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    deltas = [(c.delta, c.finish_reason) for ch in oai.chat.completions.create(**kw, stream=True, extra_body=body)
              for c in ch.choices]
    calls = [tc for d, _ in deltas for tc in d.tool_calls or []]
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].type == "function"
    assert all(tc.index == 0 and tc.function.name is None for tc in calls[1:])
    assert len(calls) > 3  # the arguments stream while they are generated
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == args
    assert "".join(d.content or "" for d, _ in deltas) == (whole.message.content or "")
    assert deltas[-1][1] == "tool_calls"


def _valid_calls(choice) -> int:
    for call in choice.message.tool_calls or []:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    return len(choice.message.tool_calls or [])


def test_required_strict_tools_after_thinking_at_temperature_one(oai):
    out = oai.chat.completions.create(model="m", messages=USER, tools=[WEATHER], tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=11, n=8,
                                      extra_body={"max_thinking_tokens": 4})
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert _valid_calls(choice) == 1 and _extra(choice.message, "reasoning_content")


def test_auto_with_response_format_is_a_call_or_an_answer(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
    out = oai.chat.completions.create(model="m", messages=USER, tools=[WEATHER], response_format=fmt,
                                      parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=5, n=8,
                                      extra_body=NO_THINKING)
    kinds = set()
    for choice in out.choices:
        assert choice.finish_reason in ("stop", "tool_calls"), choice
        kinds.add(choice.finish_reason)
        if choice.finish_reason == "tool_calls":
            assert _valid_calls(choice) == 1 and not choice.message.content
        else:
            jsonschema.validate(json.loads(choice.message.content), VERDICT)
    assert kinds == {"stop", "tool_calls"}, kinds  # both branches are open to the sampler


def test_strict_tool_the_grammar_cannot_enforce_is_400(oai):
    tool = {"type": "function", "function": {"name": "tag", "strict": True, "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.function\.parameters.*uniqueItems"):
        oai.chat.completions.create(model="m", messages=USER, tools=[tool], max_tokens=4)
    out = oai.chat.completions.create(model="m", messages=USER, tools=[WEATHER], max_tokens=4, temperature=1.0,
                                      extra_body=NO_THINKING)  # strict, auto: the triggered grammar compiles
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_history_renders_and_bad_history_is_400(oai):
    history = USER + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    out = oai.chat.completions.create(model="m", messages=history, tools=[WEATHER], max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    bad = [*history[:1], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0],
                                                        "function": {"name": "get_weather", "arguments": "{city"}}]}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"):
        oai.chat.completions.create(model="m", messages=bad, tools=[WEATHER], max_tokens=4)
    orphan = [*USER, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\]\.tool_call_id"):
        oai.chat.completions.create(model="m", messages=orphan, tools=[WEATHER], max_tokens=4)


def test_thinking_budget_and_parser_names_are_checked(oai):
    with pytest.raises(openai.BadRequestError, match="max_thinking_tokens"):
        oai.chat.completions.create(model="m", messages=USER, max_tokens=4, extra_body={"max_thinking_tokens": -1})
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServerConfig(tool_call_parser="nope")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ServerConfig(reasoning_parser="r2")
    assert ServerConfig(reasoning_parser="none", tool_call_parser="qwen3_coder").tool_call_parser == "qwen3_coder"
