"""Reasoning models in the runtime: the thinking budget forces the think block closed in the sampler, and a
constraint composed with grammar/compose.py starts after the block, in the same request, on the tiny Llama
(random weights: what it thinks is noise, so the structure is what the budget and grammar make)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import xgrammar as xgr
from tiny_models import tiny_model_dir
from xgrammar.testing import _is_grammar_accept_string as accepts

from radixgen import Engine
from radixgen.common.grammar.compose import (
    CallTag,
    after_thinking,
    calls_or,
    constraint_grammar,
    ebnf_of,
    json_ebnf,
    triggered_calls,
)
from radixgen.common.grammar.schema import ConstraintError
from radixgen.common.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
CALL = CallTag("<tool_call>", '<tool_call>\n{"name": "f", "arguments": ', "}\n</tool_call>", SCHEMA)


@pytest.fixture(scope="module")
def engine():
    with Engine(model=str(tiny_model_dir("llama")), dtype="float32", max_total_tokens=4096) as eng:
        yield eng


def test_budget_closes_the_block_at_its_budget(engine):
    for budget in (0, 3, 9):
        out = engine.generate(input_ids=[1, 5, 9, 13], sampling_params={
            "max_new_tokens": budget + 12, "temperature": 0, "ignore_eos": True,
            "max_thinking_tokens": budget, "think_end": "</think>"})
        ids = out["output_ids"]
        end = engine.tokenizer.encode("</think>", add_special_tokens=False)
        assert ids[budget:budget + len(end)] == end, (budget, out["text"])
        assert out["text"].count("</think>") >= 1
        assert "</think>" not in engine.tokenizer.decode(ids[:budget])  # not closed earlier by the noise


def test_json_after_thinking_in_one_request(engine):
    ebnf = ebnf_of(after_thinking(constraint_grammar("json_schema", json.dumps(SCHEMA)), "<think>", "</think>",
                                  opened=True))
    for seed in range(6):
        out = engine.generate(input_ids=[1, 7, 3], sampling_params={
            "max_new_tokens": 40, "temperature": 1.0, "seed": seed, "ebnf": ebnf,
            "max_thinking_tokens": 6, "think_end": "</think>"})
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        thought, answer = out["text"].split("</think>", 1)
        jsonschema.validate(json.loads(answer.strip()), SCHEMA)


def test_composed_grammars_accept_what_they_should():
    js = constraint_grammar("json_schema", json.dumps(SCHEMA))
    optional = after_thinking(js, "<think>", "</think>", opened=False)
    assert accepts(optional, '<think>a < b </thin k</think>\n\n{"n":1,"ok":true}')
    assert accepts(optional, '{"n":2,"ok":false}')
    assert not accepts(optional, '<think>x</think>{"m":1}')
    free = triggered_calls([CALL])
    assert accepts(free, 'Sure. <tool_call>\n{"name": "f", "arguments": {"n":3,"ok":true}}\n</tool_call>')
    assert accepts(free, "hi")
    assert not accepts(free, '<tool_call>\n{"name": "f", "arguments": {"x":3}}\n</tool_call>')
    either = calls_or(js, [CALL])
    assert accepts(either, '<tool_call>\n{"name": "f", "arguments": {"n":3,"ok":true}}\n</tool_call>')
    assert accepts(either, '{"n":1,"ok":false}') and not accepts(either, "plain text")
    assert xgr.Grammar.from_ebnf(ebnf_of(either))  # travels as EBNF text


def test_unenforceable_strict_schema_names_the_keyword():
    with pytest.raises(ConstraintError, match="uniqueItems"):
        json_ebnf({"type": "array", "uniqueItems": True}, "tools[0].function.parameters", strict=True)


@pytest.mark.parametrize("bad,match", [
    ({"max_thinking_tokens": -1, "think_end": "</think>"}, "max_thinking_tokens: must be an integer >= 0"),
    ({"max_thinking_tokens": 4}, "think_end"),
    ({"think_end": "</think>"}, "only used with max_thinking_tokens"),
])
def test_budget_params_checked(bad, match):
    with pytest.raises(ValueError, match=re.escape(match) if ":" in match else match):
        SamplingParams(**bad)
