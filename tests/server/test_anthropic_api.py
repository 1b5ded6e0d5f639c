"""Anthropic's Messages API end to end: the `anthropic` client against a real `radixgen serve` of the tiny random
Qwen3 (its template renders tools and a think block) with two API keys, each its own cache namespace. Whole
and streamed messages agree; the stream's events come in Anthropic's order; a tool round trip (tool_use, then
tool_result) reuses the cached conversation; thinking blocks come from the reasoning parser; stop_sequences;
count_tokens; x-api-key selects the key's cache; bad bodies are 4xx in Anthropic's error shape."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import jsonschema
import pytest
from server_proc import APIS_KEYS

WEATHER = {"name": "get_weather", "description": "The weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                             "days": {"type": "integer", "enum": [1, 2, 3]}},
                            "required": ["city", "days"], "additionalProperties": False}}
# temperature is not a parameter of this client version's create(): it goes in the body as older clients send it
GREEDY = {"model": "tiny", "extra_body": {"temperature": 0.0}}


@pytest.fixture
def client(apis_server):
    with anthropic.Anthropic(base_url=apis_server.url, api_key=APIS_KEYS[0], max_retries=0) as c:
        yield c


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_whole_and_streamed_messages_agree_and_events_come_in_order(client):
    msgs = _user(f"[{uuid.uuid4().hex}] Tell me about tides.")
    whole = client.messages.create(max_tokens=8, messages=msgs, system="Be brief.", **GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.stop_reason == "max_tokens"
    assert [b.type for b in whole.content] == ["text"] and whole.usage.output_tokens == 8
    counted = client.messages.count_tokens(model="tiny", messages=msgs, system="Be brief.").input_tokens
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == counted

    events = list(client.messages.create(max_tokens=8, messages=msgs, system="Be brief.", stream=True, **GREEDY))
    kinds = [e.type for e in events]  # the client drops ping events: the raw stream below has them
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    body = {"model": "tiny", "max_tokens": 3, "messages": msgs, "stream": True, "temperature": 0.0}
    with httpx.stream("POST", str(client.base_url.join("/v1/messages")), json=body, timeout=60,
                      headers={"x-api-key": APIS_KEYS[0]}) as r:
        raw = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert raw[:3] == ["message_start", "ping", "content_block_start"] and raw[-2:] == ["message_delta",
                                                                                         "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 8
    assert events[0].message.usage.cache_read_input_tokens > 0  # the same prompt again: from the radix cache

    with client.messages.stream(max_tokens=8, messages=msgs, system="Be brief.", **GREEDY) as stream:
        assert stream.get_final_message().content[0].text == whole.content[0].text


def test_tool_round_trip_whole_and_streamed(client):
    msgs = _user(f"[{uuid.uuid4().hex}] What is the weather in Oslo?")
    forced = {"type": "tool", "name": "get_weather"}
    first = client.messages.create(max_tokens=60, messages=msgs, tools=[WEATHER], tool_choice=forced, **GREEDY)
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])  # the tool_choice grammar held

    with client.messages.stream(max_tokens=60, messages=msgs, tools=[WEATHER], tool_choice=forced,
                                **GREEDY) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert "input_json" in kinds  # the arguments arrive as input_json_delta events
    assert [b.model_dump() for b in streamed.content if b.type == "tool_use"][0]["input"] == call.input

    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"},
                                          {"type": "text", "text": "Thanks. Summarize."}]}]
    second = client.messages.create(max_tokens=6, messages=msgs, tools=[WEATHER], **GREEDY)
    assert second.stop_reason in ("max_tokens", "end_turn", "tool_use")
    # the first turn's prompt is a prefix of the second's: the radix cache holds it
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens + first.usage.cache_read_input_tokens - 2


def test_thinking_blocks_come_from_the_reasoning_parser(client):
    msgs = _user(f"[{uuid.uuid4().hex}] Think first.")
    thinking = {"type": "enabled", "budget_tokens": 4}  # the template leaves the block open: closed at 4 tokens
    whole = client.messages.create(max_tokens=12, messages=msgs, thinking=thinking, **GREEDY)
    assert [b.type for b in whole.content][:1] == ["thinking"] and whole.content[0].thinking
    events = list(client.messages.create(max_tokens=12, messages=msgs, thinking=thinking, stream=True, **GREEDY))
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == [b.type for b in whole.content]
    thought = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                      and e.delta.type == "thinking_delta")
    assert thought == whole.content[0].thinking


def test_output_config_format_is_enforced(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    msg = client.messages.create(max_tokens=40, messages=_user("Is the sea salty?"), **GREEDY,
                                 output_config={"format": {"type": "json_schema", "schema": schema}})
    assert msg.stop_reason == "end_turn", msg.content
    jsonschema.validate(json.loads(msg.content[0].text), schema)


def test_stop_sequences_end_the_message(client):
    msgs = _user(f"[{uuid.uuid4().hex}] Go on.")
    text = client.messages.create(max_tokens=12, messages=msgs, **GREEDY).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = client.messages.create(max_tokens=12, messages=msgs, stop_sequences=[stop], **GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


def test_x_api_key_selects_the_keys_cache_namespace(apis_server):
    msgs = _user(f"[{uuid.uuid4().hex}] A long shared context about the sea. " * 6)

    def cached(key: str) -> int:
        with anthropic.Anthropic(base_url=apis_server.url, api_key=key, max_retries=0) as c:
            return c.messages.create(max_tokens=1, messages=msgs, **GREEDY).usage.cache_read_input_tokens

    assert cached(APIS_KEYS[0]) < 8  # the template's first tokens may be cached from earlier requests
    assert cached(APIS_KEYS[0]) > 40  # a key reuses its own prefixes
    assert cached(APIS_KEYS[1]) < 8  # never another key's


@pytest.mark.parametrize("body, status, kind, match", [
    ({"model": "m", "messages": _user("hi")}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400,
     "invalid_request_error", "messages[0].content[0].type"),
    ({"model": "m", "max_tokens": 4, "messages": _user("hi"), "tools": [{"type": "web_search_20250305",
                                                                         "name": "web_search"}]},
     400, "invalid_request_error", "custom"),
    ({"model": "m", "max_tokens": 4, "messages": _user("hi"), "tool_choice": {"type": "maybe"}}, 400,
     "invalid_request_error", "tool_choice.type"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     400, "invalid_request_error", "text only"),
    ({"model": "m", "max_tokens": 4, "messages": _user("hi"), "temperature": 1.5}, 400, "invalid_request_error",
     "temperature"),
    ({"model": "m", "max_tokens": 4, "messages": _user("hi"), "thinking": {"type": "enabled", "budget_tokens": 9}},
     400, "invalid_request_error", "budget_tokens"),
])
def test_bad_bodies_get_anthropics_error_shape(apis_server, body, status, kind, match):
    r = httpx.post(apis_server.url + "/v1/messages", json=body, headers={"x-api-key": APIS_KEYS[0]}, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
    assert match in r.json()["error"]["message"]


def test_client_errors_are_anthropics_exceptions(apis_server, client):
    with anthropic.Anthropic(base_url=apis_server.url, api_key="wrong", max_retries=0) as c:
        with pytest.raises(anthropic.AuthenticationError) as e:
            c.messages.create(max_tokens=4, messages=_user("hi"), **GREEDY)
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(max_tokens=4, messages=_user("hi"), extra_body={"temperature": -1.0}, model="tiny")
    assert e.value.body["type"] == "error"
    assert client.messages.create(max_tokens=1, messages=_user("still serving"), **GREEDY).usage.output_tokens == 1
