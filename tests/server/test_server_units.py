"""Server parts that need no model: request validation, error shapes, metrics text, tool-call handling."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from radixgen.common.http_errors import APIError, install_error_handlers, value_error_param
from radixgen.common.parsers import HermesParser, collect, reasoning_format
from radixgen.common.prometheus import Counter, Histogram
from radixgen.runtime.server.chat_output import ChatOutput
from radixgen.runtime.server.metrics import ServerMetrics
from radixgen.runtime.server.native_protocol import GenerateRequest
from radixgen.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    Tool,
)
from radixgen.runtime.server.tools import tool_choice_schema, tool_parser

WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
)
TIME = Tool.model_validate({"type": "function", "function": {"name": "get_time"}})


# ---------------------------------------------------------------- protocol


def test_unknown_fields_are_rejected_not_ignored():
    with pytest.raises(ValidationError, match="bogus"):
        CompletionRequest.model_validate({"prompt": "x", "bogus": 1})
    with pytest.raises(ValidationError, match="logit_bias"):  # the value's type is still checked
        CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"5": "up"}})
    with pytest.raises(ValidationError, match="stream_options"):
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}
        )


def test_chat_request_checks():
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValidationError, match="top_logprobs requires logprobs"):
        ChatCompletionRequest.model_validate({"messages": msgs, "top_logprobs": 2})
    with pytest.raises(ValidationError, match="tool_choice requires tools"):
        ChatCompletionRequest.model_validate({"messages": msgs, "tool_choice": "required"})
    with pytest.raises(ValidationError, match="not in tools"):
        ChatCompletionRequest.model_validate(
            {
                "messages": msgs,
                "tools": [WEATHER.model_dump()],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            }
        )
    with pytest.raises(ValidationError, match="schema is required"):
        ChatCompletionRequest.model_validate({"messages": msgs, "response_format": {"type": "json_schema"}})
    req = ChatCompletionRequest.model_validate({"messages": msgs, "tools": [WEATHER.model_dump()]})
    assert req.effective_tool_choice == "auto"
    assert ChatCompletionRequest.model_validate({"messages": msgs}).effective_tool_choice == "none"


def test_generate_request_needs_exactly_one_input():
    with pytest.raises(ValidationError, match="exactly one"):
        GenerateRequest.model_validate({})
    with pytest.raises(ValidationError, match="exactly one"):
        GenerateRequest.model_validate({"text": "a", "input_ids": [1]})
    assert GenerateRequest.model_validate({"input_ids": [[1, 2], [3]]}).is_batch
    assert not GenerateRequest.model_validate({"input_ids": [1, 2]}).is_batch
    assert GenerateRequest.model_validate({"text": ["a"]}).is_batch


# ---------------------------------------------------------------- errors


def _error_app() -> TestClient:
    app = FastAPI()
    seen: list[int] = []
    install_error_handlers(app, on_error=seen.append)

    @app.post("/v")
    async def v(req: CompletionRequest):
        return {}

    @app.get("/api")
    async def api():
        raise APIError(404, "no such model", "model", "model_not_found")

    @app.get("/value")
    async def value():
        raise ValueError("sampling_params.top_p: must be in (0, 1] (got 2)")

    client = TestClient(app, raise_server_exceptions=False)
    client.seen = seen  # type: ignore[attr-defined]
    return client


def _assert_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


def test_every_error_has_the_openai_shape():
    client = _error_app()
    err = _assert_error(client.post("/v", json={"prompt": "x", "temperature": 5}), 400)
    assert err["param"] == "temperature" and err["type"] == "invalid_request_error"
    err = _assert_error(
        client.post("/v", content=b"{not json", headers={"content-type": "application/json"}), 400
    )
    err = _assert_error(client.get("/api"), 404)
    assert (err["param"], err["code"]) == ("model", "model_not_found")
    err = _assert_error(client.get("/value"), 400)
    assert err["param"] == "top_p" and "must be in" in err["message"]
    _assert_error(client.get("/nowhere"), 404)
    _assert_error(client.get("/v"), 405)
    assert client.seen == [400, 400, 404, 400, 404, 405]


def test_value_error_param():
    assert value_error_param("sampling_params.top_p: must be in (0, 1]") == "top_p"
    assert value_error_param("regex: bad") == "regex"
    assert value_error_param("the prompt is too long: 9000 tokens") is None


# ---------------------------------------------------------------- metrics


def _parse_exposition(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    return samples


def test_metrics_exposition():
    m = ServerMetrics()
    m.requests.inc(api="chat")
    m.requests.inc(api="chat")
    m.observe_finished(
        {"prompt_tokens": 10, "completion_tokens": 4, "cached_tokens": 6, "finish_reason": {"type": "stop"}}
    )
    for v in (0.003, 0.2, 0.2, 100.0):
        m.ttft.observe(v)
    m.update_from_server_info({"num_running": 2, "num_waiting": 1, "cache": {"total": 100, "free": 90}})
    text = m.render()
    s = _parse_exposition(text)
    assert s['radixgen_requests_total{api="chat"}'] == 2
    assert s["radixgen_prompt_tokens_total"] == 10
    assert s["radixgen_prefix_cache_hit_tokens_total"] == 6
    assert s["radixgen_prefix_cache_query_tokens_total"] == 10
    assert s['radixgen_requests_finished_total{reason="stop"}'] == 1
    assert s["radixgen_num_running_reqs"] == 2 and s["radixgen_kv_slots_free"] == 90
    # cumulative buckets, +Inf == count
    assert s['radixgen_time_to_first_token_seconds_bucket{le="0.005"}'] == 1
    assert s['radixgen_time_to_first_token_seconds_bucket{le="0.25"}'] == 3
    assert s['radixgen_time_to_first_token_seconds_bucket{le="+Inf"}'] == 4
    assert s["radixgen_time_to_first_token_seconds_count"] == 4
    assert math.isclose(s["radixgen_time_to_first_token_seconds_sum"], 100.403)
    assert "# TYPE radixgen_inter_token_latency_seconds histogram" in text
    assert "# TYPE radixgen_requests_total counter" in text


def test_metric_guards():
    with pytest.raises(ValueError, match="_total"):
        Counter("bad", "x")
    with pytest.raises(ValueError, match="only go up"):
        Counter("a_total", "x").inc(-1)
    with pytest.raises(ValueError, match="increasing"):
        Histogram("h", "x", (1.0, 0.5))


def test_label_values_are_escaped():
    c = Counter("c_total", "x", ("k",))
    c.inc(k='a"b\\c\nd')
    assert list(c.samples()) == ['c_total{k="a\\"b\\\\c\\nd"} 1']


# ---------------------------------------------------------------- tools


def test_required_schema_accepts_calls_and_rejects_others():
    schema = tool_choice_schema([WEATHER, TIME], "required")
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Paris"}}], schema)
    jsonschema.validate([{"name": "get_time", "arguments": {}}], schema)
    for bad in (
        [],
        [{"name": "other", "arguments": {}}],
        [{"name": "get_weather", "arguments": {"days": 1}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_choice_schema([WEATHER], "required", parallel=False)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, single)
    named = tool_choice_schema([WEATHER, TIME], _named("get_weather"))
    assert named == WEATHER.function.parameters
    assert tool_choice_schema([WEATHER], "auto") is None


def _named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def _parse(tools, choice, text: str, fmt=HermesParser):
    parser = tool_parser(tools, choice, fmt)()
    return collect(parser.feed(text) + parser.finish())


def test_parse_constrained_output():
    parsed = _parse([WEATHER], "required", '[{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    assert parsed.content is None
    (call,) = parsed.calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}
    named = _parse([WEATHER], _named("get_weather"), '{"city": "Rome"}')
    assert named.calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert not _parse([WEATHER], "required", '[{"name": "get_weather", "argu').calls  # cut by length
    assert not _parse([WEATHER], "required", '[{"name": "nope", "arguments": {}}]').calls
    assert tool_parser([WEATHER], "none", HermesParser) is None


def test_parse_auto_output():
    text = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>'
    parsed = _parse([WEATHER], "auto", text)
    assert parsed.content == "Let me check."
    assert json.loads(parsed.calls[0]["function"]["arguments"]) == {"city": "Lima"}
    # an unclosed last call (the model stopped at EOS) still counts; unknown tools stay text
    assert _parse([WEATHER], "auto", '<tool_call>{"name": "get_weather", "arguments": {}}').calls
    plain = _parse([WEATHER], "auto", '<tool_call>{"name": "launch", "arguments": {}}</tool_call>')
    assert plain.calls == [] and "launch" in plain.content
    assert _parse([WEATHER], "auto", "just text") == ("just text", [])
    assert HermesParser.format_call("get_weather", {"city": "X"}).startswith("<tool_call>{")


@pytest.mark.parametrize("split", [1, 3, 7])
def test_chat_output_streams_content_reasoning_and_call_deltas(split):
    """Deltas of a thinking model's call: thinking, then content up to the call, then the call's head and
    its arguments in pieces; the non-streamed message of the same text agrees."""
    text = ('<think>weather?</think>\n\nSure <tool_ <tool_call>{"name": "get_weather", "arguments": '
            '{"city": "Kyiv"}}</tool_call>')
    fmt = reasoning_format("qwen3")
    spec = ChatOutput(lambda: fmt.parser(""), tool_parser([WEATHER], "auto", HermesParser), False, True)
    out = spec.choice()
    deltas = [d for i in range(0, len(text), split) for d in out.feed(text[i : i + split])] + out.finish()
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "weather?"
    assert "".join(d.get("content", "") for d in deltas) == "Sure <tool_"
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["id"].startswith("call_")
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Kyiv"}
    assert len(calls) > 2 if split == 1 else len(calls) >= 2  # the arguments come in pieces
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"
    whole = spec.choice().message(text)
    assert whole["content"] == "Sure <tool_" and whole["reasoning_content"] == "weather?"
    assert json.loads(whole["tool_calls"][0]["function"]["arguments"]) == {"city": "Kyiv"}

    held = ChatOutput(lambda: fmt.parser(""), None, False, False).choice()  # stream_reasoning false
    deltas = [d for i in range(0, len(text), split) for d in held.feed(text[i : i + split])] + held.finish()
    assert [d["reasoning_content"] for d in deltas if "reasoning_content" in d] == ["weather?"]


# ---------------------------------------------------------------- hardening (issue 12) and leniency (issue 14)


def test_lone_surrogate_escapes():
    from radixgen.runtime.server.middleware import lone_surrogate

    assert lone_surrogate(b'{"a": "\\ud800"}') == "\\ud800"
    assert lone_surrogate(b'{"a": "x\\uDC00y"}') == "\\udc00"
    assert lone_surrogate(b'{"a": "\\ud83d\\ude00"}') is None  # a pair is one character
    assert lone_surrogate(b'{"a": "\\ude00\\ud83d"}') == "\\ude00"  # a pair in the wrong order is not
    assert lone_surrogate(b'{"a": "\\\\ud800"}') is None  # an escaped backslash, then text
    assert lone_surrogate(b'{"a": "\\\\\\ud800"}') == "\\ud800"
    assert lone_surrogate(b'{"a": "\\u00e9 plain"}') is None


def test_public_message_never_carries_a_traceback():
    from radixgen.common.http_errors import error_body, public_message

    trace = (
        "the scheduler process failed:\nTraceback (most recent call last):\n"
        '  File "/work/main/python/runtime/scheduler/core.py", line 12, in step\n    x = y[3]\n'
        "IndexError: list index out of range\n"
    )
    msg = public_message(trace, 503)
    assert msg.startswith("the scheduler process failed: IndexError: list index out of range")
    assert "core.py" not in msg and "Traceback" not in msg and "\n" not in msg
    body = error_body(500, "internal error: OSError: cannot open /srv/data/model/file.bin")
    assert "/srv/data" not in body["error"]["message"] and body["error"]["type"] == "server_error"
    assert public_message("temperature: must be in [0, 2]", 400) == "temperature: must be in [0, 2]"


def test_values_are_strict_and_legacy_functions_map_to_tools():
    chat = [{"role": "user", "content": "x"}]
    for bad in ({"max_tokens": "10"}, {"n": True}, {"temperature": float("nan")}, {"seed": 2**63}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({"messages": chat, **bad})
    with pytest.raises(ValidationError, match="seed"):
        ChatCompletionRequest.model_validate({"messages": chat, "seed": 2**63 - 1, "n": 2})
    req = ChatCompletionRequest.model_validate(
        {"messages": chat, "functions": [{"name": "f"}], "function_call": {"name": "f"}, "store": True, "user": "u"}
    )
    assert req.legacy_functions and not req.parallel_calls
    assert [t.function.name for t in req.tools] == ["f"]
    assert isinstance(req.effective_tool_choice, NamedToolChoice)
    assert req.no_effect_fields() == ["store", "user"]
    req = ChatCompletionRequest.model_validate({"messages": chat, "reasoning_effort": "high"})
    assert req.template_kwargs() == {"reasoning_effort": "high"}
    for feature in ({"audio": {"voice": "x"}}, {"return_hidden_states": True}):
        with pytest.raises(ValidationError, match="not supported"):
            ChatCompletionRequest.model_validate({"messages": chat, **feature})
