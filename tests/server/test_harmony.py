"""The harmony format of gpt-oss: the prompt as the format's public description writes it, and the output's
channels read into reasoning_content, content and tool_calls, streamed in any split and whole."""

from __future__ import annotations

import json

import pytest

from radixgen.common.harmony_prompt import render_harmony
from radixgen.common.parsers import (
    HarmonyFormat,
    collect,
    detect_reasoning_format,
    detect_tool_parser,
    reasoning_format,
    tool_parser_class,
)
from radixgen.common.parsers.harmony import HarmonyReader, parse_header
from radixgen.runtime.server.chat_output import ChatOutput
from radixgen.runtime.server.protocol import Tool
from radixgen.runtime.server.tools import tool_parser

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_current_weather", "description": "Gets the current weather in the provided location.",
    "parameters": {"type": "object", "required": ["location"], "properties": {
        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
        "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}}}}})
LOCATION = Tool.model_validate({"type": "function", "function": {
    "name": "get_location", "description": "Gets the location of the user."}})

# the example prompt of the format's description (system, developer instructions with two tools, one user turn)
SPEC_PROMPT = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: high\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
    "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
    "<|start|>developer<|message|># Instructions\n\nAlways respond in riddles\n\n"
    "# Tools\n\n## functions\n\nnamespace functions {\n\n"
    "// Gets the location of the user.\ntype get_location = () => any;\n\n"
    "// Gets the current weather in the provided location.\ntype get_current_weather = (_: {\n"
    "// The city and state, e.g. San Francisco, CA\nlocation: string,\n"
    'format?: "celsius" | "fahrenheit", // default: celsius\n}) => any;\n\n'
    "} // namespace functions<|end|>"
    "<|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant")

CALL_OUTPUT = ("<|channel|>analysis<|message|>Need to use function get_current_weather.<|end|>"
               "<|start|>assistant<|channel|>commentary to=functions.get_current_weather <|constrain|>json"
               '<|message|>{"location":"San Francisco"}<|call|>')
ANSWER_OUTPUT = ("<|channel|>analysis<|message|>User asks a riddle.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>It is sunny, and 20 degrees.<|return|>")


def _tools():
    return [t.model_dump(exclude_none=True) for t in (LOCATION, WEATHER)]


def test_prompt_is_the_formats_example():
    msgs = [{"role": "system", "content": "Always respond in riddles"},
            {"role": "user", "content": "What is the weather like in SF?"}]
    assert render_harmony(msgs, _tools(), "high", current_date="2025-06-28") == SPEC_PROMPT


def test_prompt_of_a_tool_round_trip_and_efforts():
    msgs = [{"role": "user", "content": "Weather in SF?"},
            {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_current_weather", "arguments": {"location": "SF"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"sunny": true}'}]
    text = render_harmony(msgs, _tools(), "low")
    assert "Reasoning: low" in text and "# Instructions" not in text  # no client instructions: no section
    # the open turn keeps its thinking; the call, then its result from the function to the assistant
    assert text.endswith("<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
                         "<|start|>assistant<|channel|>commentary to=functions.get_current_weather <|constrain|>json"
                         '<|message|>{"location": "SF"}<|call|>'
                         "<|start|>functions.get_current_weather to=assistant<|channel|>commentary"
                         '<|message|>{"sunny": true}<|end|><|start|>assistant')
    done = msgs + [{"role": "assistant", "content": "Sunny.", "reasoning_content": "Answer now."},
                   {"role": "user", "content": "Thanks"}]
    closed = render_harmony(done, None, "minimal")  # a finished turn's thinking is dropped
    assert "Need the tool." not in closed and "Answer now." not in closed and "Reasoning: low" in closed
    assert "<|channel|>final<|message|>Sunny.<|end|>" in closed and "Calls to these tools" not in closed
    with pytest.raises(ValueError, match="reasoning_effort"):
        render_harmony(msgs, None, "extreme")
    with pytest.raises(ValueError, match="answering no earlier call"):
        render_harmony([{"role": "tool", "content": "x"}])


def test_headers():
    assert parse_header("<|channel|>commentary to=functions.f <|constrain|>json", "assistant") == (
        "assistant", "commentary", "functions.f", "json")
    assert parse_header("assistant to=functions.f<|channel|>commentary json", "") == (
        "assistant", "commentary", "functions.f", "json")
    assert parse_header("<|channel|>final", "assistant") == ("assistant", "final", None, None)


@pytest.mark.parametrize("split", [1, 2, 5, 1000])
def test_reader_events_do_not_depend_on_the_split(split):
    reader = HarmonyReader()
    text = CALL_OUTPUT + "<|start|>assistant<|channel|>final<|message|>ok<|return|>"
    events = [e for i in range(0, len(text), split) for e in reader.feed(text[i:i + split])]
    events += reader.feed("", final=True)
    merged: list = []
    for e in events:  # adjacent bodies joined
        if merged and e[0] == "body" and merged[-1][0] == "body":
            merged[-1] = ("body", merged[-1][1] + e[1])
        else:
            merged.append(e)
    assert [e[0] for e in merged] == ["open", "body", "close"] * 3
    assert merged[3][1].recipient == "functions.get_current_weather" and merged[5] == ("close", "<|call|>")
    assert merged[7] == ("body", "ok")


def _stream(spec: ChatOutput, text: str, split: int) -> list[dict]:
    out = spec.choice()
    return [d for i in range(0, len(text), split) for d in out.feed(text[i:i + split])] + out.finish()


def _spec(tools=True, stream_reasoning=True):
    fmt = reasoning_format("harmony")
    parser = tool_parser([LOCATION, WEATHER], "auto", tool_parser_class("harmony")) if tools else None
    return ChatOutput(lambda: fmt.parser(""), parser, False, stream_reasoning)


@pytest.mark.parametrize("split", [1, 3, 7, 10_000])
def test_call_streamed_and_whole(split):
    deltas = _stream(_spec(), CALL_OUTPUT, split)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need to use function get_current_weather."
    assert "".join(d.get("content", "") for d in deltas) == ""
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"] == {"name": "get_current_weather", "arguments": ""}
    assert json.loads("".join(c["function"].get("arguments", "") for c in calls)) == {"location": "San Francisco"}
    out = _spec().choice()
    whole = out.message(CALL_OUTPUT)
    assert whole["content"] is None and whole["reasoning_content"] == "Need to use function get_current_weather."
    assert whole["tool_calls"][0]["function"] == {"name": "get_current_weather",
                                                  "arguments": '{"location":"San Francisco"}'}
    assert out.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("split", [1, 4, 10_000])
def test_answer_streamed_and_whole(split):
    for spec in (_spec(), _spec(tools=False), _spec(stream_reasoning=False)):
        deltas = _stream(spec, ANSWER_OUTPUT, split)
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "User asks a riddle."
        assert "".join(d.get("content", "") for d in deltas) == "It is sunny, and 20 degrees."
        assert not any("tool_calls" in d for d in deltas)
    held = [d for d in _stream(_spec(stream_reasoning=False), ANSWER_OUTPUT, split) if "reasoning_content" in d]
    assert len(held) == 1  # the thinking in one delta once the analysis message ended
    whole = _spec().choice().message(ANSWER_OUTPUT)
    assert (whole["content"], whole["reasoning_content"]) == ("It is sunny, and 20 degrees.", "User asks a riddle.")


def test_odd_outputs():
    # text with no harmony markers at all is the answer; an unknown function and a built-in tool stay content
    assert _spec().choice().message("plain words") == {"content": "plain words", "reasoning_content": None,
                                                       "reasoning": None}
    msg = _spec().choice().message("<|channel|>commentary to=functions.launch <|constrain|>json<|message|>{}<|call|>")
    assert "tool_calls" not in msg and msg["content"] == "{}"
    # the recipient before the channel; the output cut inside the arguments (length): the call so far
    cut = _spec().choice().message(' to=functions.get_location<|channel|>commentary json<|message|>{"a"')
    assert cut["tool_calls"][0]["function"] == {"name": "get_location", "arguments": '{"a"'}
    # two calls in one output, ids distinct
    two = CALL_OUTPUT + "<|start|>assistant<|channel|>commentary to=functions.get_location<|message|><|call|>"
    calls = collect(_feed_all(two)).calls
    assert [c["function"]["name"] for c in calls] == ["get_current_weather", "get_location"]
    assert calls[0]["id"] != calls[1]["id"] and calls[1]["function"]["arguments"] == "{}"
    # a prompt that opened the analysis message: the output starts inside it
    fmt = HarmonyFormat()
    parser = fmt.parser("...<|start|>assistant<|channel|>analysis<|message|>")
    split = parser.feed("thinking<|end|><|start|>assistant<|channel|>final<|message|>hi")
    rest = parser.finish()
    assert (split.reasoning + rest.reasoning, split.content + rest.content) == ("thinking", "hi")


def _feed_all(text: str):
    p = tool_parser_class("harmony")({})
    return p.feed(text) + p.finish()


def test_detected_from_the_template():
    template = "{{- '<|start|>assistant<|channel|>final<|message|>' }}"
    assert detect_reasoning_format(template).name == "harmony"
    assert detect_tool_parser(template) == "harmony"


def test_language_gen_reads_harmony_and_refuses_its_constraints():
    from radixgen.lang.agent import split_output, thinking_params

    spec = {"name": "get_current_weather", "parameters": WEATHER.function.parameters}
    out = split_output(CALL_OUTPUT, [spec], "harmony", "harmony", prompt="<|start|>assistant")
    assert out.reasoning == "Need to use function get_current_weather." and out.content is None
    assert [(c.name, c.arguments) for c in out.calls] == [("get_current_weather", {"location": "San Francisco"})]
    with pytest.raises(ValueError, match="harmony"):
        thinking_params({"regex": "[0-9]+"}, None, "harmony", "<|start|>assistant", None)
    assert thinking_params({}, None, "harmony", "<|start|>assistant", None) == {}
