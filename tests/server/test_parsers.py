"""Reasoning and tool-call parsers over outputs in each model family's own format: the unchunked parse is
what the format means, and any split of the same text into streamed deltas gives the same result."""

from __future__ import annotations

import json
import random
import zlib

import pytest

from radixgen.common.parsers import (
    REASONING_FORMATS,
    TOOL_PARSERS,
    CallArgs,
    ForcedParser,
    NamedParser,
    collect,
    detect_reasoning_format,
    detect_tool_parser,
    reasoning_format,
    tool_parser_class,
)

TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}},
}
W = '{"city": "Paris", "days": 3}'

# parser -> [(model output, content, [(name, arguments)])]
CASES = {
    "hermes": [
        ("The weather?\n<tool_call>\n" '{"name": "get_weather", "arguments": ' + W + "}\n</tool_call>",
         "The weather?", [("get_weather", {"city": "Paris", "days": 3})]),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "a\\"}b"}}\n</tool_call>\n<tool_call>\n'
         '{"name": "get_time", "arguments": {}}\n</tool_call>', None,
         [("get_weather", {"city": 'a"}b'}), ("get_time", {})]),
        ('<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>', None,
         [("get_time", {"zone": "UTC"})]),
        ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', '<tool_call>{"name": "nope", "arguments": {}}'
         "</tool_call>", []),
        ("Just text with a < sign and <tool no call.", "Just text with a < sign and <tool no call.", []),
        ('<tool_call>{"name": "get_time", "arguments": {"zone": "U', None, [("get_time", '{"zone": "U')]),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": ' + W + "}", None, [("get_weather", {"city": "Paris", "days": 3})]),
        ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}; {"name": "get_weather", '
         '"parameters": {"city": "Rome"}}', None, [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Rome"})]),
        ("It is sunny {not json}.", "It is sunny {not json}.", []),
        ('{"a": 1}', '{"a": 1}', []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": ' + W + '}, {"name": "get_time", "arguments": '
         '{"zone": "UTC"}}]', None, [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"})]),
        ("Sure. [TOOL_CALLS]get_time[ARGS]{\"zone\": \"PST\"}", "Sure.", [("get_time", {"zone": "PST"})]),
        ("No calls [TOOLS] here.", "No calls [TOOLS] here.", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=3), get_time(zone=\'UTC\')]', None,
         [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"})]),
        ('<|python_start|>[get_time(zone="a)b")]<|python_end|>', None, [("get_time", {"zone": "a)b"})]),
        ("[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
        ("The answer is 4.", "The answer is 4.", []),
    ],
    "qwen3_coder": [
        ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
         "<parameter=days>\n5\n</parameter>\n</function>\n</tool_call>", "Let me check.",
         [("get_weather", {"city": "New York", "days": 5})]),
        ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
         "<parameter=city>\n 12 \n</parameter>\n</function>\n</tool_call>", None,
         [("get_time", {}), ("get_weather", {"city": " 12 "})]),
        ("<tool_call>\n<function=unknown>\n</function>\n</tool_call>",
         "<tool_call>\n<function=unknown>\n</function>\n</tool_call>", []),
    ],
}


def _splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _run(make, pieces: list[str]):
    parser = make()
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    return collect(events), events


def _norm(parsed):
    return parsed.content, [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.calls]


def _args(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text  # a call cut off by the end of the output keeps its partial arguments


@pytest.mark.parametrize("name,case", [(n, c) for n, cs in CASES.items() for c in cs])
def test_tool_parser_formats_and_chunking(name, case):
    text, content, calls = case
    make = lambda: tool_parser_class(name)(TOOLS)  # noqa: E731
    whole, _ = _run(make, [text])
    assert whole.content == content
    assert [(c["function"]["name"], _args(c["function"]["arguments"])) for c in whole.calls] == calls
    rng = random.Random(zlib.crc32(text.encode()))
    for _ in range(40):
        assert _norm(_run(make, _splits(text, rng))[0]) == _norm(whole)
    assert _norm(_run(make, list(text))[0]) == _norm(whole)  # one character at a time


def test_arguments_stream_as_generated():
    """Fed a character at a time, a JSON call's arguments arrive in many pieces, before the call ends."""
    for name, text in [("hermes", CASES["hermes"][0][0]), ("llama3_json", CASES["llama3_json"][0][0]),
                       ("mistral", CASES["mistral"][1][0])]:
        _, events = _run(lambda n=name: tool_parser_class(n)(TOOLS), list(text))
        pieces = [e for e in events if isinstance(e, CallArgs)]
        assert len(pieces) > 10, name


def test_forced_and_named_outputs():
    out = '[{"name": "get_weather", "arguments": ' + W + '}, {"name": "get_time", "arguments": {}}]'
    rng = random.Random(7)
    whole, _ = _run(lambda: ForcedParser(TOOLS), [out])
    assert [c["function"]["name"] for c in whole.calls] == ["get_weather", "get_time"]
    assert json.loads(whole.calls[0]["function"]["arguments"]) == json.loads(W)
    assert whole.content is None
    for _ in range(20):
        assert _norm(_run(lambda: ForcedParser(TOOLS), _splits(out, rng))[0]) == _norm(whole)
    one, _ = _run(lambda: ForcedParser(TOOLS), ['{"name": "get_time", "arguments": {"zone": "UTC"}}'])
    assert [c["function"]["name"] for c in one.calls] == ["get_time"]
    named, _ = _run(lambda: NamedParser(TOOLS, "get_weather"), _splits(W, rng))
    assert named.calls[0]["function"] == {"name": "get_weather", "arguments": W}


def test_call_ids():
    whole, _ = _run(lambda: tool_parser_class("mistral")(TOOLS), [CASES["mistral"][0][0]])
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in whole.calls)  # Mistral's templates check it
    whole, _ = _run(lambda: tool_parser_class("hermes")(TOOLS), [CASES["hermes"][1][0]])
    assert len({c["id"] for c in whole.calls}) == 2


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_format_call_parses_back(name):
    """What the server writes into the history for a call is read back as that call by the same format."""
    cls = tool_parser_class(name)
    text = cls.format_call("get_weather", {"city": "Paris", "days": 3})
    whole, _ = _run(lambda: cls(TOOLS), [text])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.calls] == [
        ("get_weather", {"city": "Paris", "days": 3})]


REASONING_CASES = [
    # (format, rendered prompt tail, output, reasoning, content)
    ("qwen3", "<|im_start|>assistant\n", "<think>\nLet me add 2 and 2.\n</think>\n\nIt is 4.",
     "\nLet me add 2 and 2.\n", "It is 4."),
    ("qwen3", "<|im_start|>assistant\n", "It is 4.", "", "It is 4."),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "It is 4.", "", "It is 4."),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Hmm.</think>4", "Hmm.", "4"),
    ("qwen3", "", "<think>never closed", "never closed", ""),
    ("deepseek-r1", "<｜Assistant｜><think>\n", "2+2 is 4.\n</think>\n\nFour.", "2+2 is 4.\n", "Four."),
    ("deepseek-r1", "<｜Assistant｜>", "<think>x</think>y", "x", "y"),
    ("deepseek-r1", "<｜Assistant｜><think>\n\n</think>", "Four.", "", "Four."),
]


@pytest.mark.parametrize("case", REASONING_CASES)
def test_reasoning_parsers(case):
    name, prompt, text, reasoning, content = case
    fmt = reasoning_format(name)

    def run(pieces):
        p = fmt.parser(prompt)
        splits = [p.feed(x) for x in pieces] + [p.finish()]
        return "".join(s.reasoning for s in splits), "".join(s.content for s in splits)

    assert run([text]) == (reasoning, content)
    rng = random.Random(len(text))
    for _ in range(40):
        assert run(_splits(text, rng)) == (reasoning, content)
    assert run(list(text)) == (reasoning, content)


def test_unknown_names_and_detection():
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'.*hermes"):
        tool_parser_class("nope")
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'.*deepseek-r1"):
        reasoning_format("r2")
    assert detect_reasoning_format("{{ '<think>' }}...{{ '</think>' }}<|im_start|>") is REASONING_FORMATS["qwen3"]
    assert detect_reasoning_format("<｜Assistant｜><think>\n</think>").name == "deepseek-r1"
    assert detect_reasoning_format("<|im_start|>assistant") is None
    assert detect_tool_parser("<tool_call>\n<function=x>\n<parameter=y>") == "qwen3_coder"
    assert detect_tool_parser("<tool_call>{{ tool | tojson }}</tool_call>") == "hermes"
    assert detect_tool_parser("[TOOL_CALLS] ...") == "mistral"
    assert detect_tool_parser("[func_name1(params_name1=params_value1)]") == "pythonic"
    assert detect_tool_parser('<|start_header_id|> {"name": ..., "parameters": ...}') == "llama3_json"
    assert detect_tool_parser("<|im_start|>") == "hermes"
