"""Fuzzing /generate and /v1/chat/completions (issue 12): bodies built from the protocol's own fields, with
plausible values, wrong types, NaN / infinities, huge numbers and nested junk. Every answer is 2xx or
4xx (never 5xx, never a hang past the client's deadline), the scheduler stays up, and no KV slot leaks.

Bounded: a fixed number of examples per endpoint (derandomized, so CI runs the same bodies), and the
generation lengths drawn stay small, so the whole module takes well under a minute of requests."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest
from checks import assert_still_serves
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixgen.common.sampling_params import SamplingParams
from radixgen.runtime.server.native_protocol import GenerateRequest
from radixgen.runtime.server.protocol import ChatCompletionRequest

pytestmark = pytest.mark.slow

REQUEST_DEADLINE_S = 30.0  # a request still unanswered after this is a hang
EXAMPLES = 120

JUNK = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
SMALL_INT = st.integers(0, 6) | st.sampled_from([-1, 2**40])
ANY_INT = st.integers(-(2**66), 2**66)
VOCAB_ID = st.integers(0, 49_151)
TOKEN_IDS = st.lists(VOCAB_ID, min_size=1, max_size=5) | st.lists(st.integers(-3, 49_200) | ANY_INT, max_size=3)
SHORT_TEXT = st.text(max_size=24)
STOPS = SHORT_TEXT | st.lists(SHORT_TEXT, max_size=3)
SCHEMA = st.sampled_from(
    [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "string", "maxLength": 3},
        {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        {"enum": ["x", "y"]},
        {"type": "nonsense"},
        {},
    ]
)


def _floats(lo: float, hi: float, *edges: float) -> st.SearchStrategy:
    return st.floats(lo, hi) | st.sampled_from([lo, hi, *edges])


# Values of the right type, mostly in range, with the edges that broke samplers before (1e-300...).
# Generation lengths stay small so that the module runs quickly.
PLAUSIBLE: dict[str, st.SearchStrategy] = {
    "max_tokens": SMALL_INT,
    "max_completion_tokens": SMALL_INT,
    "max_new_tokens": SMALL_INT,
    "min_tokens": st.integers(0, 3),
    "min_new_tokens": st.integers(0, 3),
    "n": st.integers(1, 3) | st.sampled_from([0, 65, 10**6]),
    "temperature": _floats(0.0, 2.0, 1e-300, 1e-30, 3.0, 1e300),
    "top_p": _floats(0.01, 1.0, 1e-300, 0.0),
    "min_p": _floats(0.0, 1.0, 1e-300),
    "top_k": st.integers(-1, 50) | st.sampled_from([2**40, -(2**40)]),
    "frequency_penalty": _floats(-2.0, 2.0),
    "presence_penalty": _floats(-2.0, 2.0),
    "repetition_penalty": _floats(0.01, 2.0, 1e-300, 1e300),
    "seed": st.integers(0, 2**31) | ANY_INT,
    "stop": STOPS,
    "stop_token_ids": st.lists(VOCAB_ID | ANY_INT, max_size=3),
    "stop_regex": st.sampled_from(["a+", "(a+)+b", "[", "\\d", ""]) | st.lists(st.sampled_from(["x", "(y"])),
    "regex": st.sampled_from(["[ab]{1,3}", "(", "a*", "\\d+"]),
    "ebnf": st.sampled_from(['root ::= "a" | "b"', "root ::=", "nonsense"]),
    "json_schema": SCHEMA | SCHEMA.map(json.dumps),
    "choices": st.lists(SHORT_TEXT, max_size=3),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "return_logprob": st.booleans(),
    "top_logprobs_num": st.integers(0, 5),
    "logprob_start_len": st.integers(-1, 4),
    "return_text_in_logprobs": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "rid": st.none() | SHORT_TEXT,
    "cache_salt": st.none() | SHORT_TEXT,
    "model": st.none() | SHORT_TEXT,
    "user": SHORT_TEXT,
    "text": SHORT_TEXT | st.lists(SHORT_TEXT, max_size=2),
    "input_ids": TOKEN_IDS | st.lists(TOKEN_IDS, max_size=2),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"}])
    | SCHEMA.map(lambda s: {"type": "json_schema", "json_schema": {"name": "r", "schema": s}}),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
    "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
}


def _bodies(names: list[str], required: dict[str, st.SearchStrategy]) -> st.SearchStrategy[dict]:
    """Three in four bodies take a few fields with plausible values (they reach the scheduler); the rest
    add one field of any name with junk (a wrong type, NaN, a huge number, nested lists and dicts)."""
    known = sorted(n for n in names if n in PLAUSIBLE and n not in required)
    others = sorted(n for n in names if n not in required)

    def build(chosen: list[str], junk: list[str]) -> st.SearchStrategy[dict]:
        fields = {**required, **{n: PLAUSIBLE[n] for n in chosen}, **{n: JUNK for n in junk}}
        return st.fixed_dictionaries(fields)

    plausible = st.lists(st.sampled_from(known), max_size=4, unique=True).flatmap(lambda c: build(c, []))
    junk = st.tuples(
        st.lists(st.sampled_from(known), max_size=3, unique=True), st.sampled_from(others).map(lambda n: [n])
    ).flatmap(lambda cj: build([n for n in cj[0] if n not in cj[1]], cj[1]))
    return st.one_of(plausible, plausible, plausible, junk)


SAMPLING = _bodies([f.name for f in dataclasses.fields(SamplingParams)], {"max_new_tokens": SMALL_INT})
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": SHORT_TEXT}),
    min_size=1,
    max_size=3,
).map(lambda m: [*m, {"role": "user", "content": "Hi"}])
CHAT_BODIES = _bodies(list(ChatCompletionRequest.model_fields), {"messages": MESSAGES, "max_tokens": SMALL_INT})
GENERATE_BODIES = _bodies(
    list(GenerateRequest.model_fields), {"text": SHORT_TEXT.map(lambda t: t or "Hi"), "sampling_params": SAMPLING}
)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=REQUEST_DEADLINE_S) as c:
        yield c


def _check(http: httpx.Client, path: str, body: dict) -> None:
    content = json.dumps(body, allow_nan=True)  # NaN / Infinity literals, as a careless client sends them
    with http.stream("POST", path, content=content) as r:
        text = "".join(r.iter_text())  # a stream is read to its end, within the deadline
        assert r.status_code < 500, f"{r.status_code} for {content}\n{text[:2000]}"
        if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
            assert text.rstrip().endswith("data: [DONE]"), f"unterminated stream for {content}"
            assert '"server_error"' not in text, f"a 5xx error inside the stream for {content}\n{text[-2000:]}"


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # the client's timeout is the deadline
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(body=CHAT_BODIES)
def test_fuzz_chat_completions(http, body):
    _check(http, "/v1/chat/completions", body)


@FUZZ
@given(body=GENERATE_BODIES)
def test_fuzz_generate(http, body):
    _check(http, "/generate", body)


def test_after_fuzzing_the_server_serves_and_no_slot_leaked(http):
    assert http.get("/health").status_code == 200
    assert_still_serves(http)
