"""The native and OpenAI APIs of a real server subprocess, through the `openai` package and httpx."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def model_info(http) -> dict:
    return http.get("/get_model_info").json()


def needs_constraints(model_info: dict) -> None:
    if not model_info.get("supports_constraints"):
        pytest.skip("the Engine reports supports_constraints=False (grammar backend not wired in yet)")


def sse_events(response: httpx.Response) -> list:
    """Parsed `data:` payloads of an SSE response; the final `[DONE]` is kept as the string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ---------------------------------------------------------------- models


def test_models_list_and_retrieve(oai, server):
    ids = [m.id for m in oai.models.list().data]
    assert ids == [server.model]
    assert oai.models.retrieve(server.model).id == server.model
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


# ---------------------------------------------------------------- completions


def test_completion_streamed_equals_non_streamed(oai, server, http):
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0)
    full = oai.completions.create(**kw)
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens == 8 or full.choices[0].finish_reason == "stop"
    with http.stream(
        "POST", "/v1/completions", json={**kw, "stream": True, "stream_options": {"include_usage": True}}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert (
        usage_chunk["choices"] == []
        and usage_chunk["usage"]["completion_tokens"] == full.usage.completion_tokens
    )
    text = "".join(c["choices"][0]["text"] for c in chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert text == full.choices[0].text
    assert finishes == [full.choices[0].finish_reason]


def test_completion_logprobs_and_echo(oai, server):
    out = oai.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == out.usage.completion_tokens == len(lp.token_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    for top, x in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        assert max(top.values()) == pytest.approx(x, abs=1e-4)

    echo = oai.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=1
    )
    c = echo.choices[0]
    assert c.text.startswith(PROMPT)
    n_prompt = echo.usage.prompt_tokens
    assert len(c.logprobs.tokens) == n_prompt + echo.usage.completion_tokens
    assert c.logprobs.token_logprobs[0] is None and all(x is not None for x in c.logprobs.token_logprobs[1:])
    assert "".join(c.logprobs.tokens[:n_prompt]) == PROMPT
    # prefill only (how a client scores a continuation): the echoed prompt and its logprobs, nothing else
    score = oai.completions.create(model=server.model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    assert score.choices[0].text == PROMPT and score.usage.completion_tokens == 0
    assert score.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        c.logprobs.token_logprobs[1:n_prompt]
    )


def test_completion_n_and_batch(oai, server):
    out = oai.completions.create(
        model=server.model, prompt=["One,", "1, 2,"], max_tokens=3, n=2, temperature=0
    )
    texts = {c.index: c.text for c in out.choices}
    assert sorted(texts) == [0, 1, 2, 3]
    # index = prompt * n + choice; greedy, so both choices of a prompt agree
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]
    assert 0 < out.usage.completion_tokens <= 12


def test_cached_tokens_on_repeated_prompt(oai, server):
    prompt = "Here is a long shared context about the history of science. " * 6 + "Question: why?"
    first = oai.completions.create(model=server.model, prompt=prompt, max_tokens=1, temperature=0)
    second = oai.completions.create(model=server.model, prompt=prompt, max_tokens=1, temperature=0)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens > 40
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


# ---------------------------------------------------------------- chat


def test_chat_streamed_equals_non_streamed(oai, server):
    kw = dict(model=server.model, messages=CHAT, max_tokens=8, temperature=0)
    full = oai.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    stream = oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == msg.content
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= full.usage.prompt_tokens - 1


def test_chat_n2_streamed_one_finish_per_choice(oai, server):
    stream = oai.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=4, temperature=1.0, n=2, seed=3, stream=True
    )
    roles, finishes, texts = {}, {}, {0: "", 1: ""}
    for c in stream:
        ch = c.choices[0]
        if ch.delta.role:
            roles[ch.index] = ch.delta.role
        texts[ch.index] += ch.delta.content or ""
        if ch.finish_reason:
            assert ch.index not in finishes
            finishes[ch.index] = ch.finish_reason
    assert roles == {0: "assistant", 1: "assistant"} and set(finishes) == {0, 1}
    assert texts[0] and texts[1]


def test_chat_logprobs(oai, server):
    out = oai.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode(errors="replace") == entry.token


def test_response_format_json_schema(oai, server, model_info):
    needs_constraints(model_info)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    out = oai.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Invent a person. Reply in JSON."}],
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_tool_choice_required(oai, server, model_info):
    needs_constraints(model_info)
    out = oai.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_tokens=64,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls[:1]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


def test_tool_choice_named_streamed(oai, server, model_info):
    needs_constraints(model_info)
    stream = oai.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Weather in Oslo, in celsius?"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=48,
        temperature=0,
        stream=True,
    )
    name, args, finishes = None, "", []
    for chunk in stream:
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            name = call.function.name or name
            args += call.function.arguments or ""
        if chunk.choices[0].finish_reason:
            finishes.append(chunk.choices[0].finish_reason)
    assert name == "get_weather" and finishes == ["tool_calls"]
    jsonschema.validate(json.loads(args), WEATHER_TOOL["function"]["parameters"])


def test_tool_choice_auto_and_history(oai, server):
    """auto: the tools are described to a template that cannot render them, the answer is parsed; a
    history with an assistant tool call and its result is accepted."""
    history = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "C"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    out = oai.chat.completions.create(
        model=server.model, messages=history, tools=[WEATHER_TOOL], max_tokens=6, temperature=0
    )
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    with_tools = out.usage.prompt_tokens
    plain = oai.chat.completions.create(
        model=server.model,
        messages=history,
        tools=[WEATHER_TOOL],
        tool_choice="none",
        max_tokens=1,
        temperature=0,
    )
    assert with_tools > plain.usage.prompt_tokens  # the tool descriptions are in the prompt


# ---------------------------------------------------------------- errors


def _bad(
    status: int,
    path: str,
    body: dict | str | None = None,
    *,
    headers=None,
    method="POST",
    param=None,
    code=None,
):
    return pytest.param(
        status, method, path, body, headers, param, code, id=f"{status}-{path}-{str(body)[:40]}"
    )


LONG_IDS = [42] * 8200
ERRORS = [
    _bad(401, "/v1/completions", {"prompt": "x"}, headers={}, code="invalid_api_key"),
    _bad(401, "/v1/models", method="GET", headers={"Authorization": "Bearer wrong"}, code="invalid_api_key"),
    _bad(404, "/v1/models/nope", method="GET", param="model", code="model_not_found"),
    _bad(404, "/no/such/route", method="GET"),
    _bad(400, "/v1/completions", {"prompt": "x", "temperature": 5}, param="temperature"),
    _bad(400, "/v1/completions", {"prompt": "x", "top_p": 0}, param="top_p"),
    _bad(400, "/v1/completions", {"prompt": "x", "n": 0}, param="n"),
    _bad(400, "/v1/completions", {"prompt": "x", "bogus_field": 1}, param="bogus_field"),
    _bad(400, "/v1/completions", "{not json"),
    _bad(400, "/v1/completions", {"prompt": "x", "top_k": -5}, param="top_k"),
    _bad(400, "/v1/completions", {"prompt": "x", "top_k": -5, "stream": True}, param="top_k"),
    _bad(400, "/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, param="min_new_tokens"),
    _bad(400, "/v1/completions", {"prompt": "x", "logit_bias": {"1": 200.0}}, param="logit_bias"),
    _bad(400, "/generate", {"text": "x", "sampling_params": {"logit_bias": {"-3": 1.0}}}, param="logit_bias"),
    _bad(400, "/v1/completions", {"prompt": LONG_IDS, "max_tokens": 1}, param="prompt"),
    _bad(400, "/v1/completions", {"prompt": "x", "max_tokens": 9000}, param="max_tokens"),
    _bad(400, "/v1/completions", {"prompt": [49152]}, param="prompt"),
    _bad(400, "/v1/completions", {"prompt": "x", "regex": "(unclosed"}),
    _bad(400, "/v1/completions", {"prompt": "x", "regex": "a", "ebnf": "root ::= 'a'"}),
    _bad(400, "/v1/chat/completions", {"messages": []}, param="messages"),
    _bad(400, "/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}),
    _bad(
        400,
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}},
        },
    ),
    _bad(400, "/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}),
    _bad(
        400,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        param="messages",
    ),
    _bad(400, "/generate", {"input_ids": [1, 10**6]}, param="input_ids"),
    _bad(400, "/generate", {"input_ids": [-1]}, param="input_ids"),
    _bad(400, "/generate", {"text": "x", "sampling_params": {"temperature": -1}}, param="temperature"),
    _bad(400, "/generate", {"text": "x", "sampling_params": {"nonsense": 1}}),
    _bad(400, "/generate", {"text": "x", "sampling_params": {"n": 129}}, param="n"),  # batches stream (SGLang)
    _bad(400, "/detokenize", {"tokens": [10**7]}, param="tokens"),
]


@pytest.mark.parametrize("status,method,path,body,headers,param,code", ERRORS)
def test_error_paths(server, status, method, path, body, headers, param, code):
    hdrs = server.headers() if headers is None else headers
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.request(
        method, server.url + path, headers=hdrs, timeout=60, **(kwargs if body is not None else {})
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    # the server still answers
    assert httpx.get(server.url + "/v1/models", headers=server.headers(), timeout=30).status_code == 200


def test_health_is_open_and_the_rest_needs_the_key(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401


# ---------------------------------------------------------------- native API


def test_generate_single_batch_and_stream(http):
    one = http.post(
        "/generate",
        json={
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
        },
    ).json()
    meta = one["meta_info"]
    assert meta["completion_tokens"] == len(one["output_ids"]) == len(meta["output_token_logprobs"])
    assert "".join(t for _, _, t in meta["output_token_logprobs"]) == one["text"]
    batch = http.post(
        "/generate",
        json={"text": [PROMPT, "1, 2, 3,"], "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
    ).json()
    assert isinstance(batch, list) and len(batch) == 2 and batch[0]["text"] == one["text"]
    with http.stream(
        "POST",
        "/generate",
        json={
            "input_ids": one["output_ids"][:1] + [28],
            "stream": True,
            "sampling_params": {"max_new_tokens": 3},
        },
    ) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["finish_reason"] is not None
    assert "".join(e["delta"] for e in events[:-1]) == events[-2]["text"]


def test_abort_request(http):
    rid = "abort-me-1"
    body = {
        "text": "Count: 1, 2, 3,",
        "rid": rid,
        "stream": True,
        "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
    }
    with http.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["meta_info"]["finish_reason"] is None
        assert http.post("/abort_request", json={"rid": rid}).json() == {"rid": rid, "aborted": True}
        rest = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert rest[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert rest[-1]["meta_info"]["completion_tokens"] < 500
    assert http.post("/abort_request", json={"rid": rid}).json()["aborted"] is False


def test_tokenize_detokenize(http):
    toks = http.post("/tokenize", json={"text": "Hello world"}).json()
    assert toks["count"] == len(toks["tokens"]) > 0
    assert http.post("/detokenize", json={"tokens": toks["tokens"]}).json()["text"] == "Hello world"
    many = http.post("/tokenize", json={"text": ["a", "b c"]}).json()
    assert [m["count"] for m in many] == [1, 2]
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > toks["count"]
    assert "Name three colors." in http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["text"]


def test_info_endpoints(http, server):
    info = http.get("/get_model_info").json()
    assert info["vocab_size"] > 0 and info["context_length"] > 0
    s = http.get("/get_server_info").json()
    assert s["server_args"]["api_key"] == "<set>" and s["http"]["served_model_name"] == server.model
    cache = s["cache"]
    assert cache["free"] + cache["evictable"] + cache["protected"] == cache["total"]
    assert http.post("/flush_cache").json() == {"success": True}
    assert http.get("/health_generate").status_code == 200


def test_metrics(http):
    text = http.get("/metrics").text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['radixgen_requests_total{api="completions"}'] >= 1
    assert samples["radixgen_prompt_tokens_total"] > 0 and samples["radixgen_generation_tokens_total"] > 0
    assert (
        samples["radixgen_prefix_cache_query_tokens_total"]
        >= samples["radixgen_prefix_cache_hit_tokens_total"]
    )
    assert samples["radixgen_time_to_first_token_seconds_count"] >= 1
    assert samples["radixgen_inter_token_latency_seconds_count"] >= 1
    assert "radixgen_num_waiting_reqs" in samples and "radixgen_kv_slots_total" in samples
