"""Strict tools in every tool-call format (grammar/tool_formats.py): a sampler that picks any token the
grammar allows (a character-level vocabulary with the formats' markers as tokens, at random over many seeds)
always writes calls that the format's own parser reads back with schema-valid arguments; what the grammar
cannot enforce in a format is a ConstraintError naming the keyword."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
import xgrammar as xgr

from radixgen.common.grammar.compose import constraint_grammar
from radixgen.common.grammar.schema import ConstraintError
from radixgen.common.grammar.tool_formats import ToolSpec, auto_calls, calls_or_answer, only_calls
from radixgen.common.parsers import TOOL_PARSERS, collect, reasoning_format, tool_parser_class

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 5},
    "unit": {"type": "string", "enum": ["C", "F"]},
    "alerts": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    "note": {"type": ["string", "null"], "maxLength": 6},
}, "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "[A-Z]{3}"}}, "required": ["zone"]}
TOOLS = [ToolSpec("get_weather", WEATHER), ToolSpec("get_time", TIME)]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
FORMATS = ["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"]
MARKERS = ["<tool_call>", "</tool_call>", "<function=get_weather>", "<function=get_time>", "</function>",
           "<parameter=", "</parameter>", "[TOOL_CALLS]", "get_weather", "get_time", "True", "False", "None",
           "true", "false", "null", '{"name": ', '"arguments": ', '"parameters": ']
VOCAB = [chr(i) for i in range(32, 127)] + ["\n"] + MARKERS + ["<eos>"]
INFO = xgr.TokenizerInfo(VOCAB, stop_token_ids=[len(VOCAB) - 1])
COMPILER = xgr.GrammarCompiler(INFO)


def sample(grammar: xgr.Grammar, seed: int, steps: int = 600) -> str | None:
    """The text of one random walk through the grammar (None when it did not end within `steps`). Tokens
    that end a string or a value are drawn more often, as a model's would, so most walks end."""
    rng = random.Random(seed)
    matcher = xgr.GrammarMatcher(COMPILER.compile_grammar(grammar))
    mask = xgr.allocate_token_bitmask(1, INFO.vocab_size)
    out = []
    for _ in range(steps):
        matcher.fill_next_token_bitmask(mask)
        bits = torch.tensor([(int(w) >> b) & 1 for w in mask[0].tolist() for b in range(32)][:len(VOCAB)])
        allowed = bits.nonzero().flatten().tolist()
        closing = [t for t in allowed if not VOCAB[t].isalnum() or len(VOCAB[t]) > 1]
        t = rng.choice(closing if closing and rng.random() < 0.5 else allowed)
        assert matcher.accept_token(t)
        if t == len(VOCAB) - 1:
            return "".join(out)
        out.append(VOCAB[t])
    return None


def calls_of(fmt: str, text: str):
    parser = tool_parser_class(fmt)(SCHEMAS)
    return collect(parser.feed(text) + parser.finish())


@pytest.mark.parametrize("fmt", FORMATS)
def test_forced_calls_always_validate(fmt):
    """Calls only, in the format (the DSL's tool_choice "required"): every walk is calls with valid arguments."""
    grammar = only_calls(fmt, TOOLS, parallel=True)
    ended = 0
    for seed in range(30):
        text = sample(grammar, seed)
        if text is None:
            continue
        ended += 1
        parsed = calls_of(fmt, text)
        assert parsed.calls and not parsed.content, (text, parsed)
        for call in parsed.calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert ended >= 20


@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_strict_and_call_or_answer(fmt):
    """tool_choice auto with strict tools: whatever is written, a call the parser reads validates (and both
    text and calls happen); with a response_format: a valid call or a valid answer."""
    auto, either = auto_calls(fmt, TOOLS), calls_or_answer(fmt, constraint_grammar("regex", "[a-z]{1,6}"), TOOLS)
    kinds = set()
    for seed in range(40):
        for grammar in (auto, either):
            text = sample(grammar, seed)
            if text is None:
                continue
            parsed = calls_of(fmt, text)
            for call in parsed.calls:
                jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
            if grammar is either:
                assert bool(parsed.calls) != bool(parsed.content and parsed.content.isalpha()), text
                kinds.add(bool(parsed.calls))
    assert kinds == {True, False}


@pytest.mark.parametrize("fmt", ["pythonic", "qwen3_coder"])
def test_flattened_formats_name_what_they_cannot_enforce(fmt):
    one_of = {"type": "object", "anyOf": [{"properties": {"a": {"type": "integer"}}}]}
    with pytest.raises(ConstraintError, match=r"tools\[0\]\.function\.parameters: .*/anyOf"):
        auto_calls(fmt, [ToolSpec("f", one_of, where="tools[0].function.parameters")])
    with pytest.raises(ConstraintError, match="minProperties"):
        only_calls(fmt, [ToolSpec("f", {"type": "object", "minProperties": 1})])
    with pytest.raises(ConstraintError, match="uniqueItems"):
        only_calls(fmt, [ToolSpec("f", {"type": "object", "properties": {"x": {"type": "array",
                                                                               "uniqueItems": True}}})])
    with pytest.raises(ConstraintError, match="'b' is not among the properties"):
        only_calls(fmt, [ToolSpec("f", {"type": "object", "properties": {"a": {}}, "required": ["b"]})])
    with pytest.warns(UserWarning, match="anyOf"):  # a tool that is not strict: enforced as far as it goes
        only_calls(fmt, [ToolSpec("f", one_of, strict=False)])


def test_raw_string_keywords_qwen3_coder():
    """A raw-text parameter takes what its grammar can spell: a pattern (a date-time is one), lengths, enums."""
    with pytest.raises(ConstraintError, match="/format: not expressible for a raw-text parameter"):
        only_calls("qwen3_coder", [ToolSpec("f", {"type": "object", "properties": {
            "to": {"type": "string", "format": "email"}}})])
    when = {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}}, "required": ["when"]}
    for seed in range(5):
        text = sample(only_calls("qwen3_coder", [ToolSpec("f", when)], parallel=False), seed, steps=2000)
        if text is not None:
            parser = tool_parser_class("qwen3_coder")({"f": when})
            (call,) = collect(parser.feed(text) + parser.finish()).calls
            jsonschema.validate(json.loads(call["function"]["arguments"]), when,
                                format_checker=jsonschema.FormatChecker())
    # harmony (gpt-oss): a forced call only (test_harmony_forced_call_validates), its other constraints refused
    assert set(FORMATS) == set(TOOL_PARSERS) - {"qwen25", "harmony"}


HARMONY_VOCAB = [chr(i) for i in range(32, 127)] + ["\n", "<|channel|>", "<|message|>", "<|constrain|>", "<|start|>",
                                                    "<|end|>", "analysis", "commentary", " to=functions.", "json",
                                                    "get_weather", "get_time", "<|call|>"]
HARMONY_INFO = xgr.TokenizerInfo(HARMONY_VOCAB, stop_token_ids=[len(HARMONY_VOCAB) - 1])


def test_harmony_forced_call_validates():
    """gpt-oss's harmony format, tool_choice required (both tools) and named (one): every walk is the thinking if
    written, then one call the harmony parsers read back (the call's end, <|call|>, is the stop token) with
    schema-valid arguments; a named tool is the one called."""
    from radixgen.common.grammar.tool_formats import harmony_calls
    from radixgen.runtime.server.chat_output import ChatOutput
    from radixgen.runtime.server.protocol import Tool
    from radixgen.runtime.server.tools import tool_parser

    global VOCAB, INFO, COMPILER
    saved = VOCAB, INFO, COMPILER
    VOCAB, INFO, COMPILER = HARMONY_VOCAB, HARMONY_INFO, xgr.GrammarCompiler(HARMONY_INFO)
    tools = [Tool.model_validate({"type": "function", "function": {"name": t.name, "parameters": t.parameters}})
             for t in TOOLS]
    try:
        ended = 0
        for named in (None, "get_time"):
            grammar = harmony_calls([t for t in TOOLS if named in (None, t.name)])
            for seed in range(25):
                text = sample(grammar, seed)
                if text is None:
                    continue
                ended += 1
                fmt = reasoning_format("harmony")
                parser = tool_parser(tools, "required", tool_parser_class("harmony"), forced_in_format=True)
                out = ChatOutput(lambda fmt=fmt: fmt.parser(""), parser, False, True)
                msg = out.choice().message(text + "<|call|>")
                assert "tool_calls" in msg, (text, msg)
                (call,) = msg["tool_calls"]
                assert named in (None, call["function"]["name"]) and not msg["content"], text
                jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    finally:
        VOCAB, INFO, COMPILER = saved
    assert ended >= 8  # (a random walk through the thinking's free text seldom ends: checked by text below)
    both = harmony_calls(TOOLS)
    thinking = ('<|channel|>analysis<|message|>Need the time.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_time <|constrain|>json<|message|>{"zone":"UTC"}')
    for text, ok in ((thinking, True), (thinking.replace("UTC", "utc"), False),
                     (thinking.replace("get_time", "get_date"), False), (thinking[:48], False),
                     ('<|channel|>final<|message|>{"zone":"UTC"}', False)):
        matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(HARMONY_INFO).compile_grammar(both))
        assert (matcher.accept_string(text) and matcher.is_terminated() is False
                and matcher.accept_token(len(HARMONY_VOCAB) - 1)) == ok, text
