"""OpenAI clients must never get a 400 for fields they normally send (issue 14 item 4): the spec's fields
that change nothing here are accepted, reasoning_effort / chat_template_kwargs reach the chat template,
the legacy functions / function_call work, any `model` name is served; and the openai, langchain-openai
and litellm clients run a chat call and a structured / tool call each against the real server."""

from __future__ import annotations

import json
import os

import httpx
import jsonschema
import openai
import pytest
from checks import assert_still_serves
from pydantic import BaseModel

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Name a color."}]
CITY_FN = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


def _chat(http, **fields) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "temperature": 0, **fields})


# ---------------------------------------------------------------- leniency


NO_EFFECT_FIELDS = {
    "store": True,
    "metadata": {"project": "demo"},
    "service_tier": "auto",
    "user": "user-1234",
    "safety_identifier": "abc",
    "prompt_cache_key": "k",
    "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "Blue"},
    "modalities": ["text"],
    "audio": None,
    "web_search_options": None,
    "logit_bias": {},
    "top_logprobs": 0,
    "separate_reasoning": True,
    "stream_reasoning": False,
    "lora_path": None,
    "return_hidden_states": False,
    "session_params": None,
    "rid": None,
}


def test_spec_fields_without_effect_are_accepted(http):
    plain = _chat(http)
    assert plain.status_code == 200, plain.text
    r = _chat(http, **NO_EFFECT_FIELDS)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]
    r = http.post("/v1/completions", json={"prompt": "1, 2,", "max_tokens": 2, "user": "u", "store": False})
    assert r.status_code == 200, r.text


def test_sglang_extra_body_fields(http):
    fields = {
        "top_k": 5,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "min_tokens": 1,
        "stop_token_ids": [2],
        "skip_special_tokens": True,
        "ignore_eos": True,
        "no_stop_trim": False,
        "regex": "(red|blue|green)",
    }
    r = _chat(http, **{**fields, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("red", "blue", "green")


@pytest.mark.parametrize(
    "fields,param,words",
    [
        ({"logit_bias": {"42": 500.0}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"token": 5.0}}, "logit_bias", "token ids"),
        ({"logit_bias": {"49152": 5.0}}, "logit_bias", "out of the vocabulary"),
        ({"lora_path": "adapters/x"}, "lora_path", "LoRA"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio"),
        ({"modalities": ["text", "audio"]}, "modalities", "text"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort", "reasoning_effort"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "set by the server"),
        ({"no_such_field": 1}, "no_such_field", "Extra inputs"),
        ({"tools": [{"type": "function", "function": CITY_FN}], "functions": [CITY_FN]}, None, "legacy"),
    ],
)
def test_values_stay_strict(http, fields, param, words):
    r = _chat(http, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"], err
    if param is not None:
        assert err["param"] == param, err


def test_any_model_name_is_served_by_default(http, oai, server):
    for name in ("default", "gpt-4o-mini", server.model):
        r = http.post("/v1/completions", json={"model": name, "prompt": "1, 2,", "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == server.model
    assert oai.chat.completions.create(model="default", messages=CHAT, max_tokens=2).choices[0].message.content
    with pytest.raises(openai.NotFoundError):  # a lookup by name still knows only the served one
        oai.models.retrieve("default")


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(http):
    """The bundled template ignores unknown variables: the same prompt; a template variable it does read
    (add_generation_prompt is the server's, so it is refused) would change it."""
    base = _chat(http).json()["usage"]["prompt_tokens"]
    for fields in ({"reasoning_effort": "low"}, {"chat_template_kwargs": {"enable_thinking": False}}):
        r = _chat(http, **fields)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == base


def test_continue_final_message(http):
    msgs = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello, my name"}]
    closed = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1, "temperature": 0})
    cont = http.post(
        "/v1/chat/completions",
        json={"messages": msgs, "max_tokens": 1, "temperature": 0, "continue_final_message": True},
    )
    assert closed.status_code == cont.status_code == 200, cont.text
    # the continued turn is left open: no end-of-turn, no new assistant header
    assert cont.json()["usage"]["prompt_tokens"] < closed.json()["usage"]["prompt_tokens"]
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "continue_final_message": True})
    assert r.status_code == 400 and "last message" in r.json()["error"]["message"]


# ---------------------------------------------------------------- legacy functions


def test_legacy_function_call_named(http):
    body = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "functions": [CITY_FN],
        "function_call": {"name": "get_weather"},
        "max_tokens": 40,
        "temperature": 0,
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "function_call" and "tool_calls" not in choice["message"]
    call = choice["message"]["function_call"]
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), CITY_FN["parameters"])

    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    streamed = [d["function_call"] for d in deltas if "function_call" in d]
    assert [c["name"] for c in streamed if "name" in c] == ["get_weather"]  # then the arguments in pieces
    assert json.loads("".join(c["arguments"] for c in streamed)) == json.loads(call["arguments"])
    assert events[-1]["choices"][0]["finish_reason"] == "function_call"


def test_legacy_function_history_and_auto(http):
    msgs = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
        },
        {"role": "function", "name": "get_weather", "content": '{"temp": 21}'},
    ]
    for choice in ("auto", "none"):
        r = http.post(
            "/v1/chat/completions",
            json={"messages": msgs, "functions": [CITY_FN], "function_call": choice, "max_tokens": 4},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "function_call")
    assert_still_serves(http)


# ---------------------------------------------------------------- clients


def test_openai_client_structured_output_and_tools(oai, server):
    class Person(BaseModel):
        name: str
        age: int

    parsed = oai.chat.completions.parse(
        model="default",
        messages=[{"role": "user", "content": "Invent a person. Reply in JSON."}],
        response_format=Person,
        max_tokens=60,
        temperature=0,
        store=False,
        metadata={"suite": "compat"},
    )
    assert isinstance(parsed.choices[0].message.parsed, Person)
    out = oai.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        tools=[{"type": "function", "function": CITY_FN}],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=40,
        temperature=0,
        user="someone",
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), CITY_FN["parameters"])


def test_langchain_openai(server):
    import langchain_openai

    def llm(max_tokens: int):
        return langchain_openai.ChatOpenAI(
            model="default",
            base_url=f"{server.url}/v1",
            api_key=server.api_key,
            temperature=0,
            max_tokens=max_tokens,
            max_retries=0,
            timeout=120,
        )

    assert llm(8).invoke("Name a color.").content

    structured = llm(60).with_structured_output(PERSON | {"title": "Person"}, method="json_schema")
    person = structured.invoke("Invent a person.")
    jsonschema.validate(person, PERSON)

    tooled = llm(40).bind_tools([CITY_FN], tool_choice="get_weather")
    msg = tooled.invoke("What is the weather in Lima?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(msg.tool_calls[0]["args"], CITY_FN["parameters"])


def test_litellm(server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of a price list at import
    import litellm
    litellm.telemetry = False
    common = {"model": "openai/default", "api_base": f"{server.url}/v1", "api_key": server.api_key}
    out = litellm.completion(messages=CHAT, max_tokens=8, temperature=0, **common)
    assert out.choices[0].message.content

    out = litellm.completion(
        messages=[{"role": "user", "content": "Weather in Cairo?"}],
        tools=[{"type": "function", "function": CITY_FN}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40,
        temperature=0,
        **common,
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), CITY_FN["parameters"])

    out = litellm.completion(
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        max_tokens=60,
        temperature=0,
        **common,
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


# ---------------------------------------------------------------- logit_bias (OpenAI's, and SGLang's native)


def test_logit_bias_bans_and_forces_tokens(http, oai):
    """The greedy first token banned with -100 is never produced; +100 on a token makes it the output, through
    the openai client, /v1/completions and the native /generate alike."""
    first = oai.completions.create(model="default", prompt="The capital of France is", max_tokens=1, temperature=0,
                                   logprobs=1)
    banned = http.post("/tokenize", json={"text": first.choices[0].text, "add_special_tokens": False})
    banned_id = banned.json()["tokens"][0]
    other = oai.completions.create(model="default", prompt="The capital of France is", max_tokens=1, temperature=0,
                                   logit_bias={str(banned_id): -100})
    assert other.choices[0].text != first.choices[0].text
    forced_id = http.post("/tokenize", json={"text": " banana", "add_special_tokens": False}).json()["tokens"][0]
    body = {"text": "The capital of France is", "return_logprob": True,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0.8, "seed": 5,
                                "logit_bias": {str(forced_id): 100.0}}}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert [tok for _, tok, _ in r.json()["meta_info"]["output_token_logprobs"]] == [forced_id] * 3
    assert_still_serves(http)
