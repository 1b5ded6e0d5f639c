"""Reasoning and tool calls end to end: a real `radixgen serve` of the tiny random Qwen3 with a Qwen3-style
chat template written here (it renders tools and a <think> block, so both formats are detected from it),
through the `openai` client. The random model's text is steered into a think block or a call by a regex
(SGLang's extra-body constraint), so every assertion is about what the server makes of real output."""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import openai
import pytest
from server_proc import start_server, stop_server
from tiny_models import tiny_model_dir

from radixgen.runtime.server.launch import ServerConfig

QWEN3_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}{% if m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}{% for tc in m.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                         "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}
THINK = r"<think>[a-z ]{5,30}</think>\n\n[A-Z][a-z]{2,10}\."
CALL = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,12}", '
        r'"days": [1-9]\}\}\n</tool_call>')
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    model = tmp_path_factory.mktemp("qwen3-chat") / "model"
    shutil.copytree(tiny_model_dir("qwen3"), model)
    (model / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
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
    kw = dict(model="m", messages=USER, max_tokens=60, temperature=0)
    msg = oai.chat.completions.create(**kw, extra_body={"regex": THINK}).choices[0].message
    assert re.fullmatch(r"[a-z ]{5,30}", _extra(msg, "reasoning_content")), msg
    assert _extra(msg, "reasoning") == _extra(msg, "reasoning_content")  # vLLM's name too
    assert re.fullmatch(r"[A-Z][a-z]{2,10}\.", msg.content)
    reasoning, content = [], []
    for chunk in oai.chat.completions.create(**kw, stream=True, extra_body={"regex": THINK}):
        for c in chunk.choices:
            reasoning.append(_extra(c.delta, "reasoning_content") or "")
            content.append(c.delta.content or "")
    assert "".join(reasoning) == _extra(msg, "reasoning_content") and "".join(content) == msg.content
    assert sum(1 for r in reasoning if r) > 1  # streamed as it comes

    held = oai.chat.completions.create(**kw, stream=True, extra_body={"regex": THINK, "stream_reasoning": False})
    pieces = [_extra(c.delta, "reasoning_content") for ch in held for c in ch.choices]
    assert [p for p in pieces if p] == [_extra(msg, "reasoning_content")]  # one delta once the block ends

    kept = oai.chat.completions.create(**kw, extra_body={"regex": THINK, "separate_reasoning": False})
    assert kept.choices[0].message.content.startswith("<think>")


def test_enable_thinking_false_closes_the_block_in_the_prompt(oai):
    out = oai.chat.completions.create(model="m", messages=USER, max_tokens=8, temperature=0,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    msg = out.choices[0].message
    assert _extra(msg, "reasoning_content") is None and msg.content  # an answer, no thinking


def test_tool_call_streamed_as_deltas_and_whole(oai):
    kw = dict(model="m", messages=USER, tools=[WEATHER], max_tokens=80, temperature=0, extra_body={"regex": CALL})
    whole = oai.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    (call,) = whole.message.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    deltas = [(c.delta, c.finish_reason) for ch in oai.chat.completions.create(**kw, stream=True) for c in ch.choices]
    calls = [tc for d, _ in deltas for tc in d.tool_calls or []]
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].type == "function"
    assert all(tc.index == 0 and tc.function.name is None for tc in calls[1:])
    assert len(calls) > 3  # the arguments stream while they are generated
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == args
    assert "".join(d.content or "" for d, _ in deltas) == "Let me check."
    assert deltas[-1][1] == "tool_calls"


def test_required_tool_arguments_validate_at_temperature_one(oai):
    out = oai.chat.completions.create(model="m", messages=USER, tools=[WEATHER], tool_choice="required",
                                      max_tokens=120, temperature=1.0, seed=11, n=8)
    made = 0
    for choice in out.choices:
        if choice.finish_reason != "tool_calls":
            assert choice.finish_reason == "length"  # cut by max_tokens: nothing to validate
            continue
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
            made += 1
    assert made >= 4


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
    for value, match in ((-1, "max_thinking_tokens"), (16, "thinking budget is not supported")):
        with pytest.raises(openai.BadRequestError, match=match):
            oai.chat.completions.create(model="m", messages=USER, max_tokens=4,
                                        extra_body={"max_thinking_tokens": value})
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServerConfig(tool_call_parser="nope")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ServerConfig(reasoning_parser="r2")
    assert ServerConfig(reasoning_parser="none", tool_call_parser="qwen3_coder").tool_call_parser == "qwen3_coder"
