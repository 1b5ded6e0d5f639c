"""One sampling-parameter declaration (radixgen.common.sampling_params), and every front end checked against it:
a parameter added to the declaration and neither exposed by an API (under its name map) nor listed here as
deliberately not exposed fails these tests. No model needed."""

import inspect
from dataclasses import fields

import pytest

import radixgen.lang.api as lang_api
from radixgen.common.sampling_params import (
    CONSTRAINT_FIELDS,
    SamplingParams,
    default_of,
    sampling_fields,
)
from radixgen.lang.interpreter.core import SamplingDefaults
from radixgen.lang.ir import GEN_NAMES, SAMPLING_FIELDS, Gen
from radixgen.lang.program import Function
from radixgen.offline.params import OFFLINE_NAMES, OFFLINE_NOT_EXPOSED
from radixgen.offline.params import SamplingParams as OfflineParams
from radixgen.runtime.server.native_protocol import NativeSamplingParams
from radixgen.runtime.server.openai_api import (
    OPENAI_NAMES,
    OPENAI_NOT_EXPOSED,
    SET_BY_CHAT,
    SET_ELSEWHERE,
    OpenAIServing,
)
from radixgen.runtime.server.protocol import ChatCompletionRequest, CompletionRequest

DECLARED = [f.name for f in sampling_fields()]

# A valid value different from the default, for every declared parameter (one to add with each new parameter).
SAMPLE = {
    "max_new_tokens": 7,
    "min_new_tokens": 2,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.1,
    "frequency_penalty": 0.5,
    "presence_penalty": -0.5,
    "repetition_penalty": 1.2,
    "stop": ["END"],
    "stop_token_ids": [3],
    "stop_regex": "[0-9]{3}",
    "ignore_eos": True,
    "skip_special_tokens": False,
    "no_stop_trim": True,
    "seed": 42,
    "n": 3,
    "regex": "[a-z]+",
    "json_schema": '{"type": "object"}',
    "ebnf": 'root ::= "a"',
    "choices": ["yes", "no"],
    "logit_bias": {"5": 1.5},
    "max_thinking_tokens": 16,
    "think_end": "</reasoning>",
}
# Parameters that are only valid together (a thinking budget needs the block's closing text, and the other way
# round): a sample of one comes with this value of the other.
COMPANIONS = {"max_thinking_tokens": {"think_end": "</think>"}, "think_end": {"max_thinking_tokens": 64}}
NON_CONSTRAINT = [name for name in DECLARED if name not in CONSTRAINT_FIELDS]

# Deliberately not a keyword of the language's gen(...) (SGLang's gen has none of them; a run's requests keep
# the declared defaults). `choices` is gen's too, but makes a select.
LANG_NOT_EXPOSED = {"repetition_penalty", "skip_special_tokens", "no_stop_trim", "seed", "ebnf", "logit_bias",
                    # the think block's closing text: gen(reasoning=True) sets it from the model's reasoning format
                    "think_end"}


def native(name: str, value):
    """`value` as the declared parameter holds it after construction (e.g. logit_bias keys as ints)."""
    return getattr(SamplingParams(**{**COMPANIONS.get(name, {}), name: value}), name)


def test_every_declared_parameter_has_a_sample_and_help():
    assert sorted(SAMPLE) == sorted(DECLARED)
    for f in sampling_fields():
        assert f.metadata["help"], f.name
        assert native(f.name, SAMPLE[f.name]) != default_of(f.name), f.name


@pytest.mark.parametrize("f", [f for f in sampling_fields() if f.metadata["kind"] in (int, float)],
                         ids=lambda f: f.name)
def test_declared_ranges_are_what_validation_checks(f):
    lo, hi, kind = f.metadata["lo"], f.metadata["hi"], f.metadata["kind"]
    step = 1 if kind is int else 1e-3
    below = lo if f.metadata["lo_open"] else lo - step
    SamplingParams(**{f.name: lo + step})  # inside
    with pytest.raises(ValueError, match=f"^sampling_params.{f.name}: "):
        SamplingParams(**{f.name: below})
    if hi is not None:
        SamplingParams(**{f.name: hi})
        with pytest.raises(ValueError, match=f"^sampling_params.{f.name}: "):
            SamplingParams(**{f.name: hi + step})
    if kind is int:
        with pytest.raises(ValueError, match=f"^sampling_params.{f.name}: must be an integer"):
            SamplingParams(**{f.name: True})


# ---------------------------------------------------------------- the language


def test_gen_keywords_cover_the_declaration():
    keywords = {GEN_NAMES.get(k, k) for k in inspect.signature(lang_api.gen).parameters}
    exposed = set(DECLARED) - LANG_NOT_EXPOSED
    assert exposed <= keywords, f"declared but not gen(...) keywords: {sorted(exposed - keywords)}"
    assert LANG_NOT_EXPOSED.isdisjoint(keywords), "exposed now: drop it from LANG_NOT_EXPOSED"
    # max_thinking_tokens: a gen keyword of the reasoning mode (it goes with the think block's closing text)
    assert set(SAMPLING_FIELDS) | {"n", "regex", "json_schema", "choices", "max_thinking_tokens"} == exposed
    for typed in (lang_api.gen_int, lang_api.gen_string):
        assert set(inspect.signature(typed).parameters) <= set(inspect.signature(lang_api.gen).parameters)


def test_gen_passes_every_keyword_to_its_node():
    kwargs = {next((k for k, v in GEN_NAMES.items() if v == name), name): SAMPLE[name] for name in SAMPLING_FIELDS}
    node = lang_api.gen("x", n=3, **kwargs)
    assert isinstance(node, Gen) and node.n == 3
    overrides = node.sampling_overrides()
    for name in SAMPLING_FIELDS:
        value = overrides[name]
        assert native(name, list(value) if isinstance(value, tuple) else value) == native(name, SAMPLE[name])
    for name in ("regex", "json_schema"):
        assert getattr(lang_api.gen("x", **{name: SAMPLE[name]}), name) == SAMPLE[name]


def test_run_defaults_are_the_declared_defaults():
    run_defaults = {f.name: f.default for f in fields(SamplingDefaults) if f.name in DECLARED}
    assert set(SAMPLING_FIELDS) | {"n"} <= set(run_defaults)
    for name, default in run_defaults.items():
        assert native(name, list(default) if isinstance(default, tuple) else default) == default_of(name), name
    for method in (Function.run, Function.arun, Function.run_batch):
        params = inspect.signature(method).parameters
        for name in set(SAMPLING_FIELDS) - {"min_new_tokens"} | {"n"}:
            default = params[name].default
            assert native(name, default) == default_of(name), (method.__name__, name)


# ---------------------------------------------------------------- the native protocol


def test_native_protocol_takes_every_declared_parameter():
    missing = set(DECLARED) - set(NativeSamplingParams.model_fields)
    assert not missing, f"declared but not in the native protocol: {sorted(missing)}"


@pytest.mark.parametrize("constraint", CONSTRAINT_FIELDS)
def test_native_protocol_maps_every_parameter(constraint):
    body = {name: SAMPLE[name] for name in [*NON_CONSTRAINT, constraint]}
    out = SamplingParams.from_dict(NativeSamplingParams.model_validate(body).to_engine(None, 100))
    for name in body:
        assert getattr(out, name) == native(name, SAMPLE[name]), name


# ---------------------------------------------------------------- the OpenAI API


def test_openai_protocol_covers_the_declaration():
    for model in (CompletionRequest, ChatCompletionRequest):
        for name in DECLARED:
            if name in OPENAI_NOT_EXPOSED:
                assert OPENAI_NAMES.get(name, name) not in model.model_fields, f"{name} is exposed now"
            elif name in SET_BY_CHAT:  # the budget is a chat field; its closing text comes from the parser
                assert ("max_thinking_tokens" in ChatCompletionRequest.model_fields
                        and name not in CompletionRequest.model_fields), name
            elif name != "max_new_tokens":  # max_tokens / max_completion_tokens: the budget
                assert OPENAI_NAMES.get(name, name) in model.model_fields, (model.__name__, name)


@pytest.mark.parametrize("constraint", ["regex", "json_schema", "ebnf"])
def test_openai_mapping_carries_every_parameter(constraint):
    wire = {OPENAI_NAMES.get(name, name): SAMPLE[name] for name in NON_CONSTRAINT if name not in OPENAI_NOT_EXPOSED
            and name not in SET_BY_CHAT and name != "max_new_tokens"}
    wire[constraint] = SAMPLE[constraint]
    req = CompletionRequest(prompt="hi", **wire)
    sp = OpenAIServing.sampling(req, 7, OpenAIServing.constraint(req))
    out = SamplingParams.from_dict(sp)
    assert out.max_new_tokens == 7 and out.constraint == (constraint, SAMPLE[constraint])
    for name in set(DECLARED) - OPENAI_NOT_EXPOSED - SET_ELSEWHERE:
        assert getattr(out, name) == native(name, SAMPLE[name]), name
    assert "n" not in sp and "seed" not in sp  # set per job: one per choice, choice k seeded with seed + k


# ---------------------------------------------------------------- the offline (vLLM-shaped) API


def test_offline_params_map_every_parameter():
    offline_fields = {f.name for f in fields(OfflineParams)}
    kwargs = {}
    for name in DECLARED:
        if name in CONSTRAINT_FIELDS:
            continue  # guided_decoding / structured_outputs (tests/e2e/test_offline_params.py)
        vllm = OFFLINE_NAMES.get(name, name)
        if name in OFFLINE_NOT_EXPOSED:
            assert vllm not in offline_fields, f"{name} is exposed now"
        else:
            assert vllm in offline_fields, f"declared but not in the offline SamplingParams: {name}"
            kwargs[vllm] = SAMPLE[name]
    out = SamplingParams.from_dict(OfflineParams(**kwargs).native(prompt_len=1, context_length=100))
    for name in NON_CONSTRAINT:
        if name not in OFFLINE_NOT_EXPOSED:
            assert getattr(out, name) == native(name, SAMPLE[name]), name
