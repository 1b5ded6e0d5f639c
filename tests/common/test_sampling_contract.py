"""One sampling-parameter declaration (radixgen.common.sampling_params), and every front end built from it: each
surface's field set is the declaration's less that surface's documented exclusion list (under its name map), and
a field added to the declaration (in a subprocess, before anything imports it) shows up on every surface: the
language's gen / typed gens / run and the request a gen sends (also to an OpenAI-compatible server), the native
body, the OpenAI body, the offline SamplingParams. No model needed."""

import inspect
import subprocess
import sys
import textwrap
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
from radixgen.lang.ir import GEN_NAMES, LANG_NOT_EXPOSED, SAMPLING_FIELDS, Gen
from radixgen.lang.program import RUN_NOT_EXPOSED, Function
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



def native(name: str, value):
    """`value` as the declared parameter holds it after construction (e.g. logit_bias keys as ints)."""
    return getattr(SamplingParams(**{**COMPANIONS.get(name, {}), name: value}), name)


def declared_with(name: str, value) -> SamplingParams:
    return SamplingParams(**{**COMPANIONS.get(name, {}), name: value})


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
    declared_with(f.name, lo + step)  # inside
    with pytest.raises(ValueError, match=f"^sampling_params.{f.name}: "):
        declared_with(f.name, below)
    if hi is not None:
        declared_with(f.name, hi)
        with pytest.raises(ValueError, match=f"^sampling_params.{f.name}: "):
            declared_with(f.name, hi + step)
    if kind is int:
        with pytest.raises(ValueError, match=f"^sampling_params.{f.name}: must be an integer"):
            declared_with(f.name, True)


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
        run_keywords = set(SAMPLING_FIELDS) - RUN_NOT_EXPOSED | {"n"}
        assert run_keywords == {name for name in params if name in DECLARED}, method.__name__
        for name in run_keywords:
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


# ---------------------------------------------------------------- each surface: the declaration less its exclusions


def test_each_surface_is_the_declaration_less_its_documented_exclusions():
    lang = set(DECLARED) - LANG_NOT_EXPOSED
    gen_keywords = {GEN_NAMES.get(k, k) for k in inspect.signature(lang_api.gen).parameters}
    assert gen_keywords & set(DECLARED) == lang
    assert {f.name for f in fields(Gen)} & set(DECLARED) == lang
    assert {f.name for f in fields(SamplingDefaults)} & set(DECLARED) == set(SAMPLING_FIELDS) | {"n"}
    assert {f.name for f in fields(Gen)} & {f.name for f in fields(SamplingDefaults)} >= set(SAMPLING_FIELDS)
    assert set(NativeSamplingParams.model_fields) & set(DECLARED) == set(DECLARED)
    openai = {OPENAI_NAMES.get(n, n) for n in set(DECLARED) - OPENAI_NOT_EXPOSED - SET_BY_CHAT - {"max_new_tokens"}}
    for model in (CompletionRequest, ChatCompletionRequest):
        assert set(model.declared_names) == openai, model.__name__  # the body's spelling -> the declared name
        assert openai <= set(model.model_fields)
    offline = {OFFLINE_NAMES.get(n, n) for n in set(DECLARED) - set(CONSTRAINT_FIELDS) - OFFLINE_NOT_EXPOSED}
    vllm_own = {"logprobs", "prompt_logprobs", "spaces_between_special_tokens", "truncate_prompt_tokens",
                "guided_decoding", "structured_outputs", "best_of", "allowed_token_ids", "bad_words",
                "logits_processors", "detokenize", "extra_args"}
    assert {f.name for f in fields(OfflineParams)} == offline | vllm_own


def test_each_body_checks_a_value_with_the_declared_range():
    """The declaration's one range check runs on every body, per field, so the 400 names the field."""
    from radixgen.runtime.server.native_protocol import parse_sampling_params

    with pytest.raises(ValueError, match=r"^sampling_params.n: must be an integer in \[1, 128\]"):
        parse_sampling_params({"n": 2000})
    with pytest.raises(ValueError, match=r"^sampling_params.max_thinking_tokens: must be an integer >= 0"):
        parse_sampling_params({"max_thinking_tokens": -1, "think_end": "</think>"})
    with pytest.raises(ValueError, match=r"min_tokens\n.*must be an integer >= 0"):
        CompletionRequest(prompt="x", min_tokens=-1)
    with pytest.raises(ValueError, match=r"max_thinking_tokens\n.*must be an integer >= 0"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_thinking_tokens=-1)
    with pytest.raises(ValueError, match="gen.max_thinking_tokens: must be an integer >= 0"):
        lang_api.gen("a", reasoning=True, max_thinking_tokens=-1)


def test_a_json_schema_is_serialised_the_same_on_every_surface():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    from radixgen.common.constraint import constraint_text
    from radixgen.offline.params import GuidedDecodingParams

    text = constraint_text("json_schema", schema)
    assert SamplingParams(json_schema=schema).json_schema == text
    assert lang_api.gen("x", json_schema=schema).json_schema == text
    assert GuidedDecodingParams(json=schema).native() == {"json_schema": text}
    req = CompletionRequest(prompt="x", json_schema=schema)
    assert OpenAIServing.constraint(req) == {"json_schema": text}


# ---------------------------------------------------------------- a new field is one declaration

# Run in a fresh interpreter: an import hook adds `typical_p` to the declaration as the module is first imported,
# before any surface is built from it; then every surface is asked to take it.
_NEW_FIELD = textwrap.dedent('''
    import dataclasses, importlib.abc, importlib.util, inspect, sys

    NAME = "radixgen.common.sampling_params"

    class AddField(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != NAME:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)

                @dataclasses.dataclass
                class SamplingParams(module.SamplingParams):
                    typical_p: float = module.param(1.0, kind=float, lo=0.0, hi=1.0, lo_open=True,
                                                    help="locally typical sampling mass")

                SamplingParams.__module__ = NAME
                module.SamplingParams = SamplingParams

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, AddField())

    import radixgen as rg
    from radixgen.common.sampling_params import SamplingParams
    from radixgen.lang.backend_base import BaseBackend
    from radixgen.offline.params import SamplingParams as OfflineParams
    from radixgen.runtime.server.native_protocol import parse_sampling_params
    from radixgen.runtime.server.openai_api import OpenAIServing
    from radixgen.runtime.server.protocol import ChatCompletionRequest, CompletionRequest

    def refused(fn, *words):
        try:
            fn()
        except ValueError as e:
            assert all(w in str(e) for w in words), e
            return
        raise AssertionError("accepted an out-of-range typical_p")

    assert SamplingParams(typical_p=0.5).typical_p == 0.5
    refused(lambda: SamplingParams(typical_p=0.0), "sampling_params.typical_p")

    # the language: a gen keyword (and the typed gens'), a run keyword with the declared default, in the request
    assert inspect.signature(rg.gen).parameters["typical_p"].default is None
    assert rg.gen_int("n", typical_p=0.25).typical_p == 0.25
    assert inspect.signature(rg.Function.run).parameters["typical_p"].default == 1.0

    class Recording(BaseBackend):
        model_info = {}
        sent = []

        def _generate_group(self, requests):
            self.sent += [r.sampling_params for r in requests]
            return [{"text": "ok", "meta_info": {}} for _ in requests]

    @rg.function
    def prog(s):
        s += "Q: " + rg.gen("a", max_tokens=2, typical_p=0.7) + rg.gen("b", max_tokens=2)

    backend = Recording()
    prog.run(backend=backend, typical_p=0.3)
    assert [p["typical_p"] for p in backend.sent] == [0.7, 0.3], backend.sent
    assert SamplingParams.from_dict(backend.sent[0]).typical_p == 0.7
    from radixgen.lang.backend_base import GenRequest
    from radixgen.lang.backend_openai import OpenAI

    oai = OpenAI("m", is_chat_model=False, base_url="http://127.0.0.1:9/v1")  # no request is sent
    assert oai._kwargs(GenRequest("Q:", None, backend.sent[0]), False)["extra_body"]["typical_p"] == 0.7

    # the native body
    engine_dict = parse_sampling_params({"typical_p": 0.5}).to_engine(None, 100)
    assert SamplingParams.from_dict(engine_dict).typical_p == 0.5
    refused(lambda: parse_sampling_params({"typical_p": 2.0}), "sampling_params.typical_p")

    # the OpenAI bodies (as an extra-body field)
    for req in (CompletionRequest(prompt="x", typical_p=0.5),
                ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], typical_p=0.5)):
        assert SamplingParams.from_dict(OpenAIServing.sampling(req, 7, {})).typical_p == 0.5
    refused(lambda: CompletionRequest(prompt="x", typical_p=0), "typical_p")

    # the offline (vLLM-shaped) SamplingParams
    assert OfflineParams().typical_p == 1.0
    assert SamplingParams.from_dict(OfflineParams(typical_p=0.5).native(1, 100)).typical_p == 0.5
    print("every surface takes typical_p")
''')


def test_a_field_added_to_the_declaration_reaches_every_surface():
    out = subprocess.run([sys.executable, "-c", _NEW_FIELD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "every surface takes typical_p" in out.stdout
