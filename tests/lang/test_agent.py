"""Agents in the language: gen with tools reads the calls into `<name>_calls`, a tool_choice naming a tool
makes the default model call it with schema-valid arguments (in-process and over HTTP), gen with
reasoning keeps the think block out of the answer variable, and bad arguments are refused up front."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import radixgen as rg
from radixgen.lang.agent import ToolCall, function_spec, split_output, tools_prompt
from radixgen.lang.backend_http import RuntimeEndpoint

CITY = {"name": "get_weather", "description": "The weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                     "days": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["city", "days"], "additionalProperties": False}}


def add(a: int, b: int = 0) -> int:
    """Adds two integers."""
    return a + b


def test_function_spec_from_dicts_and_functions():
    assert function_spec({"type": "function", "function": CITY}) is CITY
    spec = function_spec(add)
    assert spec["name"] == "add" and spec["description"] == "Adds two integers."
    assert spec["parameters"]["properties"] == {"a": {"type": "integer"}, "b": {"type": "integer"}}
    assert spec["parameters"]["required"] == ["a"]
    with pytest.raises(ValueError, match="needs a str, int"):
        function_spec(lambda x: x)
    assert "get_weather" in tools_prompt([CITY]) and "<tool_call>" in tools_prompt([CITY])


def test_split_output_parts():
    text = '<think>hmm</think>\n\nSure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    out = split_output(text, [function_spec(add)], "hermes", "qwen3")
    assert out.content == "Sure." and out.reasoning == "hmm"
    assert [(c.name, c.arguments) for c in out.calls] == [("add", {"a": 1})]
    assert split_output("plain", None, "hermes", None) == ("plain", None, [])


def test_gen_arguments_are_checked():
    with pytest.raises(ValueError, match="need a variable name"):
        rg.gen(tools=[add])
    with pytest.raises(ValueError, match="tool_choice other than auto"):
        rg.gen("x", tools=[add], tool_choice="required", regex="a")
    with pytest.raises(ValueError, match="n=1"):
        rg.gen("x", reasoning=True, n=2)


@rg.function
def ask(s, tool_choice):
    s += rg.system("You are a weather assistant.\n\n" + tools_prompt([CITY]))
    s += rg.user("What is the weather in Oslo for two days?")
    s += rg.assistant(rg.gen("turn", tools=[CITY], tool_choice=tool_choice, parallel_tool_calls=False,
                             max_tokens=60))


def _check_call(state):
    (call,) = state["turn_calls"]
    assert isinstance(call, ToolCall) and call.name == "get_weather"
    jsonschema.validate(call.arguments, CITY["parameters"])
    assert "<tool_call>" in state.text()  # the whole output stays in the text (the next turn's cache)
    assert "<tool_call>" not in state["turn"]


def test_forced_call_in_process(engine):
    for _ in range(3):  # sampled: the grammar keeps every call valid
        _check_call(ask.run(tool_choice="get_weather", backend=engine, temperature=1.0))
    _check_call(ask.run(tool_choice="required", backend=engine, temperature=0))


def test_forced_call_over_http(server_url):
    _check_call(ask.run(tool_choice="get_weather", backend=RuntimeEndpoint(server_url), temperature=0))


def test_reasoning_variable(engine):
    """The prompt opened the block; the budget closes it and the regex holds for the answer after it."""
    @rg.function
    def think(s):
        s += "Question: 2 + 2?\nAnswer: <think>"
        s += rg.gen("a", reasoning="thought", regex=r"[0-9]", max_thinking_tokens=6, max_tokens=20)

    state = think.run(backend=engine, temperature=0)
    assert state["thought"] and "</think>" not in state["a"] and state["a"].isdigit()


# ---------------------------------------------------------------- a constraint after thinking (tiny Qwen3)

VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
           "additionalProperties": False}


@pytest.fixture(scope="module")
def qwen3_engine(tmp_path_factory):
    from qwen3_chat import qwen3_chat_model

    from radixgen import Engine

    with Engine(model=str(qwen3_chat_model(tmp_path_factory.mktemp("qwen3"))), dtype="float32",
                max_total_tokens=4096) as eng:
        yield eng


@rg.function
def judge(s, gen_kw):
    s += rg.user("Is the sky blue?")
    s += rg.assistant(rg.gen("answer", reasoning=True, max_tokens=40, **gen_kw))


@pytest.mark.parametrize("constraint, check", [
    ({"json_schema": VERDICT}, lambda a: jsonschema.validate(json.loads(a), VERDICT)),
    ({"regex": r"(yes|no), [a-z]{2,8}"}, lambda a: re.fullmatch(r"(yes|no), [a-z]{2,8}", a) or pytest.fail(a)),
    ({"choices": ["blue", "grey"]}, lambda a: a in ("blue", "grey") or pytest.fail(a)),
])
def test_constraint_after_thinking_in_one_request(qwen3_engine, constraint, check):
    """The random model thinks (the budget closes its block after 5 tokens), then the constraint holds: one
    request, one grammar (the server's compose path), at temperature 1."""
    for _ in range(2):
        state = judge.run({"max_thinking_tokens": 5, **constraint}, backend=qwen3_engine, temperature=1.0)
        assert state["answer_reasoning"], state.text()
        assert "<think>" not in state["answer"] and "</think>" not in state["answer"]
        check(state["answer"])
        meta = state.get_meta_info("answer")
        assert meta["finish_reason"]["type"] == "stop", meta
        assert "</think>" in state.text()  # the whole output stays in the text (the next turn's cache)


@pytest.mark.parametrize("fmt", ["pythonic", "qwen3_coder"])
def test_forced_call_in_the_flattened_formats(qwen3_engine, fmt):
    """tool_choice "required" in a program makes the random model call in `fmt` (its grammar), with valid
    arguments, sampled at temperature 1 (the random model writes the markers in short tokens: a long output)."""
    @rg.function
    def call(s):
        s += rg.user("What is the weather in Oslo?")
        s += rg.assistant(rg.gen("turn", tools=[CITY], tool_choice="required", tool_call_parser=fmt,
                                 parallel_tool_calls=False, max_tokens=200))  # random tokens: short ones

    for _ in range(1):  # many samples of each format's grammar: tests/server/test_tool_grammars.py
        state = call.run(backend=qwen3_engine, temperature=1.0)
        assert state.get_meta_info("turn")["finish_reason"]["type"] == "stop"
        (made,) = state["turn_calls"]
        assert made.name == "get_weather" and state["turn"] == ""
        jsonschema.validate(made.arguments, CITY["parameters"])


def test_reasoning_gen_arguments_are_checked():
    with pytest.raises(ValueError, match="max_thinking_tokens"):
        rg.gen("a", max_thinking_tokens=3)
    with pytest.raises(ValueError, match="max_thinking_tokens: must be an integer >= 0"):
        rg.gen("a", reasoning=True, max_thinking_tokens=-1)
    with pytest.raises(ValueError, match="sampled, not scored"):
        rg.gen("a", reasoning=True, choices=["x"], choices_method="token_length_normalized")


def test_agent_example_loop_reuses_the_cache(engine):
    """examples/agent.py on the default model: each tool step calls its tool with valid arguments, and each
    turn's prompt finds the whole previous prompt in the radix cache."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    try:
        import agent as example
    finally:
        sys.path.pop(0)
    steps = example.agent.run(question="How cold is Oslo in Fahrenheit?", backend=engine, temperature=0).ret_value
    assert len(steps) == len(example.PLAN) + 1 and steps[-1]["answer"]
    for step, tool in zip(steps, example.PLAN, strict=False):
        (line,) = step["calls"]
        assert line.startswith(f"{tool}(")
    for before, after in zip(steps, steps[1:], strict=False):
        assert after["cached"] >= before["prompt"], steps
