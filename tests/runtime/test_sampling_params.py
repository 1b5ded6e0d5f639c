"""SamplingParams validation: strict types, finite ranges, seeds (per choice too), text that is not Unicode;
the front-end checks of request_validation against the model's limits."""

from __future__ import annotations

import math

import pytest

from radixgen.common.sampling_params import (
    DEFAULT_MAX_NEW_TOKENS,
    MAX_SEED,
    MIN_SAMPLING_TEMPERATURE,
    MIN_SEED,
    SamplingParams,
    choice_seeds,
)
from radixgen.runtime.engine.request_state import RequestError
from radixgen.runtime.engine.validation import ModelLimits, build_requests, kv_slots_needed, prompt_ids

EVERY_FIELD = dict(
    max_new_tokens=7, min_new_tokens=1, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, frequency_penalty=0.5,
    presence_penalty=-0.5, repetition_penalty=1.1, stop=["x"], stop_token_ids=[3], stop_regex="a+b",
    ignore_eos=True, skip_special_tokens=False, no_stop_trim=True, seed=3, n=2, regex="[a-z]+",
)


def test_every_field_is_still_accepted_and_defaults_come_from_one_constant():
    p = SamplingParams.from_dict(EVERY_FIELD)
    assert {k: getattr(p, k) for k in EVERY_FIELD} == EVERY_FIELD
    assert SamplingParams().max_new_tokens == DEFAULT_MAX_NEW_TOKENS == 128
    assert SamplingParams.from_dict({"json_schema": {"type": "object"}}).json_schema == '{"type": "object"}'
    assert SamplingParams.from_dict({"choices": ["a", "b"]}).constraint == ("choices", '["a", "b"]')
    assert SamplingParams.from_dict({"ebnf": 'root ::= "a"'}).constraint[0] == "ebnf"
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []


@pytest.mark.parametrize(("field", "value"), [
    ("max_new_tokens", "10"), ("max_new_tokens", True), ("max_new_tokens", 10.0), ("max_new_tokens", -1),
    ("min_new_tokens", False), ("top_k", True), ("top_k", "3"), ("top_k", -2), ("n", True), ("n", 0),
    ("n", 129), ("seed", True), ("seed", "1"), ("seed", 1.5), ("seed", MAX_SEED + 1), ("seed", MIN_SEED - 1),
    ("temperature", "0.5"), ("temperature", True), ("temperature", -0.1), ("temperature", math.nan),
    ("temperature", math.inf), ("temperature", 101), ("top_p", 0.0), ("top_p", math.nan), ("top_p", 1.5),
    ("min_p", -0.1), ("min_p", math.nan), ("frequency_penalty", math.inf), ("presence_penalty", math.nan),
    ("frequency_penalty", 2.5), ("repetition_penalty", 1e-300), ("repetition_penalty", 0.0),
    ("repetition_penalty", math.nan), ("repetition_penalty", math.inf), ("repetition_penalty", 2.5),
    ("ignore_eos", 1), ("ignore_eos", "true"), ("skip_special_tokens", None), ("no_stop_trim", 0),
    ("stop", [1]), ("stop", [""]), ("stop", 3), ("stop", ["ok", "\ud800"]), ("stop_token_ids", [True]),
    ("stop_token_ids", ["1"]), ("stop_token_ids", [-1]), ("stop_token_ids", 5), ("stop_regex", "("),
    ("stop_regex", 5), ("stop_regex", "a\udc00"), ("regex", ""), ("regex", 3), ("regex", "\ud800"),
    ("json_schema", "{not json"), ("choices", []), ("choices", ["a", 1]), ("choices", ["\ud800"]),
    ("logit_bias", {"a": 1.0}), ("logit_bias", {1.5: 1.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {3: 101}),
    ("logit_bias", {3: math.nan}), ("logit_bias", {3: "1"}), ("logit_bias", {3: True}), ("logit_bias", [3]),
])
def test_a_bad_value_is_a_value_error_naming_its_field(field, value):
    with pytest.raises(ValueError, match=rf"^sampling_params\.{field}: "):
        SamplingParams.from_dict({field: value})


def test_unknown_fields_and_wrong_containers_are_errors():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['max_tokens'\]"):
        SamplingParams.from_dict({"max_tokens": 5})
    with pytest.raises(ValueError, match="must be a dict"):
        SamplingParams.from_dict([("temperature", 1.0)])
    with pytest.raises(ValueError, match="at most one of"):
        SamplingParams.from_dict({"regex": "a", "ebnf": 'root ::= "a"'})


def test_a_temperature_below_the_smallest_safe_value_is_greedy():
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=MIN_SAMPLING_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=MIN_SAMPLING_TEMPERATURE).greedy
    assert SamplingParams(temperature=1.0, top_k=1).greedy


def test_choice_seeds_stay_in_the_64_bit_range():
    assert choice_seeds(None, 3) == [None, None, None]
    assert choice_seeds(5, 3) == [5, 6, 7]
    assert choice_seeds(MAX_SEED - 2, 3)[-1] == MAX_SEED
    assert choice_seeds(MIN_SEED, 1) == [MIN_SEED]
    with pytest.raises(ValueError, match=r"sampling_params\.seed: with n=3 .* past the largest seed"):
        choice_seeds(MAX_SEED - 1, 3)
    with pytest.raises(ValueError, match=r"sampling_params\.seed: with n=2"):
        SamplingParams(seed=MAX_SEED, n=2)
    assert SamplingParams(seed=MAX_SEED, n=1).seed == MAX_SEED


# --- the front-end checks, without an engine --------------------------------------------------------------

LIMITS = ModelLimits(vocab_size=100, context_length=64, num_kv_slots=40, supports_constraints=True,
                     strict_json=False)


def test_a_request_larger_than_the_kv_pool_is_rejected_naming_both_sizes():
    assert kv_slots_needed(30, 11) == 40 and kv_slots_needed(30, 0) == 30
    build_requests(False, [[1] * 30], {"max_new_tokens": 11}, LIMITS)  # exactly fits
    with pytest.raises(RequestError, match=r"needs 41 KV cache slots, more than the KV pool holds \(40 tokens\)"):
        build_requests(False, [[1] * 30], {"max_new_tokens": 12}, LIMITS)  # fits the context (42 <= 64)
    with pytest.raises(RequestError, match=r"prompt \(50 tokens\).*context length \(64 tokens\)"):
        build_requests(False, [[1] * 50], {"max_new_tokens": 20}, LIMITS)
    with pytest.raises(RequestError, match="empty"):
        build_requests(False, [[]], None, LIMITS)


def test_input_ids_are_strict_ints_in_the_vocabulary():
    assert prompt_ids([1, 2], 100) == (False, [[1, 2]])
    assert prompt_ids([[1], [2, 3]], 100) == (True, [[1], [2, 3]])
    for bad, message in (([True], "must be integers, got True"), ([1.0], "got 1.0"), (["1"], "got '1'"),
                         ([100], "out of the vocabulary"), ([-1], "out of the vocabulary"), ("12", "a list")):
        with pytest.raises(RequestError, match=rf"^input_ids: .*{message}"):
            prompt_ids(bad, 100)


def test_fan_out_seeds_each_choice_and_checks_stop_ids_and_arguments():
    prepared = build_requests(False, [[1, 2]], {"n": 3, "seed": 10, "max_new_tokens": 2}, LIMITS, rid="r")
    assert prepared.batched and prepared.base_rid == "r"
    assert [(r.rid, r.params.seed, r.params.n) for r in prepared.requests] == [
        ("r-0-0", 10, 1), ("r-0-1", 11, 1), ("r-0-2", 12, 1)]
    with pytest.raises(RequestError, match=r"stop_token_ids: token id 100 is out of the vocabulary"):
        build_requests(False, [[1]], {"stop_token_ids": [100], "max_new_tokens": 1}, LIMITS)
    with pytest.raises(RequestError, match=r"^sampling_params\.seed"):
        build_requests(False, [[1]], {"seed": MAX_SEED, "n": 2, "max_new_tokens": 1}, LIMITS)
    for kw, message in ((dict(return_logprob=1), "return_logprob"), (dict(top_logprobs_num=True), "top_logprobs"),
                        (dict(logprob_start_len=-2), "logprob_start_len"), (dict(cache_salt=b"x"), "cache_salt"),
                        (dict(cache_salt="\ud800"), "cache_salt"), (dict(rid=5), "rid")):
        with pytest.raises(RequestError, match=rf"^{message}"):
            build_requests(False, [[1]], {"max_new_tokens": 1}, LIMITS, **kw)
    with pytest.raises(RequestError, match="regex"):
        build_requests(False, [[1]], {"regex": "(", "max_new_tokens": 1}, LIMITS)
