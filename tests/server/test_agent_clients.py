"""Agent frameworks against a real server: langchain-openai's ChatOpenAI with bind_tools (a tool-calling
turn, its ToolMessage sent back, streamed and not) and litellm's completion (tools streamed and not,
reasoning_content), on the tiny random Qwen3 (tests/qwen3_chat.py) served with the pythonic tool-call
format, whose strict tools are checked here at the server level too."""

from __future__ import annotations

import json
import os
from typing import Literal

import jsonschema
import openai
import pytest
from qwen3_chat import qwen3_chat_model
from server_proc import start_server, stop_server

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of litellm's price list

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "enum": [1, 2, 3]}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                            "parameters": PARAMS, "strict": True}}
VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
           "additionalProperties": False}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = qwen3_chat_model(tmp_path_factory.mktemp("qwen3-clients"))
    srv = start_server("--model", str(model), "--dtype", "float32", "--tool-call-parser", "pythonic", api_key=None)
    yield srv
    assert stop_server(srv) == 0, srv.log_tail()


def test_langchain_tool_turn_and_tool_message(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Oslo", "Rome"], days: Literal[1, 2, 3]) -> str:
        """The weather of a city."""
        return f"sunny in {city} for {days} days"

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="m", temperature=1.0, max_tokens=60,
                     seed=3, max_retries=0, extra_body=NO_THINKING)
    bound = llm.bind_tools([get_weather], tool_choice="any", strict=True, parallel_tool_calls=False)
    question = [HumanMessage("What is the weather in Paris?")]
    msg = bound.invoke(question)
    (call,) = msg.tool_calls or pytest.fail(repr(msg))
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], get_weather.tool_call_schema.model_json_schema())
    chunks = list(bound.stream(question))
    assert sum(1 for c in chunks if c.tool_call_chunks) > 2  # the arguments arrive in pieces
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(call["name"], call["args"])]  # seeded
    result = get_weather.invoke(call)
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
    answer = llm.bind(max_tokens=8, temperature=0).invoke([*question, msg, result])
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls


def test_litellm_tools_and_reasoning(server):
    import litellm

    kw = dict(model="openai/m", api_base=server.url + "/v1", api_key="none", messages=USER, max_tokens=60,
              temperature=1.0, seed=5)
    tools = dict(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, extra_body=NO_THINKING)
    whole = litellm.completion(**kw, **tools)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and whole.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)
    pieces = [tc for chunk in litellm.completion(**kw, **tools, stream=True) for tc in
              chunk.choices[0].delta.tool_calls or []]
    assert len(pieces) > 2 and "".join(tc.function.arguments or "" for tc in pieces) == call.function.arguments
    thought = litellm.completion(**kw, extra_body={"max_thinking_tokens": 5, "regex": r"[A-Z][a-z]{2,8}\."})
    msg = thought.choices[0].message
    assert msg.reasoning_content and "</think>" not in msg.content and msg.content.endswith(".")
    streamed = litellm.completion(**kw, stream=True, extra_body={"max_thinking_tokens": 5,
                                                                 "regex": r"[A-Z][a-z]{2,8}\."})
    deltas = [c.choices[0].delta for c in streamed]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg.reasoning_content
    assert "".join(d.content or "" for d in deltas) == msg.content


def test_strict_pythonic_call_or_answer_at_temperature_one(server):
    """tool_choice auto with a response_format in the pythonic format: a valid call list or a valid answer."""
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        out = client.chat.completions.create(model="m", messages=USER, tools=[WEATHER], response_format=fmt,
                                             max_tokens=80, temperature=1.0, seed=2, n=10, extra_body=NO_THINKING)
    kinds = set()
    for choice in out.choices:
        kinds.add(choice.finish_reason)
        if choice.finish_reason == "tool_calls":
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), PARAMS)
        else:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), VERDICT)
    assert kinds == {"stop", "tool_calls"}, kinds
