"""Ollama's API end to end: the `ollama` client against a real `radixgen serve` of the tiny random Qwen3 (the
adapters' shared server, tests/server/conftest.py). Streamed (NDJSON, the default) and whole answers agree;
`format` ("json" or a schema) holds through the constraint engine; `options` reach the sampler (num_predict,
stop, seed, num_ctx); generate's `context` continues a conversation from the radix cache; tool history is
rendered; the model routes answer; bad bodies get Ollama's {"error": "..."} with a 4xx."""

from __future__ import annotations

import json
import uuid

import httpx
import jsonschema
import ollama
import pytest
from server_proc import APIS_KEYS

VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
           "additionalProperties": False}
GREEDY = {"temperature": 0.0, "seed": 7}


@pytest.fixture
def client(apis_server):
    return ollama.Client(host=apis_server.url, headers={"Authorization": f"Bearer {APIS_KEYS[0]}"})


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_whole_and_streamed_agree(client):
    msgs = [{"role": "system", "content": "Be brief."}, *_user(f"[{uuid.uuid4().hex}] Tides?")]
    whole = client.chat(model="tiny", messages=msgs, options={**GREEDY, "num_predict": 8}, stream=False)
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 8
    assert whole.message.role == "assistant" and whole.message.content
    parts = list(client.chat(model="tiny", messages=msgs, options={**GREEDY, "num_predict": 8}, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "length"
    assert "".join(p.message.content for p in parts) == whole.message.content
    # the same prompt again: only what the radix cache did not hold is evaluated
    assert parts[-1].prompt_eval_count < whole.prompt_eval_count
    assert parts[-1].total_duration >= parts[-1].eval_duration > 0


def test_format_is_enforced(client, apis_server):
    msgs = _user("Is the sea salty? Answer in JSON.")
    r = client.chat(model="tiny", messages=msgs, format=VERDICT, options={**GREEDY, "num_predict": 60})
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), VERDICT)
    # "json" is the OpenAI API's json_object constraint (a random model may not close its object soon: compared)
    r = client.chat(model="tiny", messages=msgs, format="json", options={**GREEDY, "num_predict": 12})
    body = {"model": "tiny", "messages": msgs, "max_tokens": 12, "response_format": {"type": "json_object"},
            **GREEDY}
    oai = httpx.post(apis_server.url + "/v1/chat/completions", json=body, timeout=60,
                     headers={"Authorization": f"Bearer {APIS_KEYS[0]}"}).json()
    assert r.message.content == oai["choices"][0]["message"]["content"] and r.message.content.startswith("{")


def test_options_reach_the_sampler(client):
    msgs = _user(f"[{uuid.uuid4().hex}] Go on.")
    text = client.chat(model="tiny", messages=msgs, options={**GREEDY, "num_predict": 12}).message.content
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = client.chat(model="tiny", messages=msgs, options={**GREEDY, "num_predict": 12, "stop": [stop]})
    assert cut.done_reason == "stop" and cut.message.content == text[:text.index(stop)]
    # num_ctx: a smaller window ends generation where it is full
    windowed = client.chat(model="tiny", messages=msgs, options={**GREEDY, "num_ctx": 64})
    assert windowed.done_reason == "length" and windowed.eval_count <= 64


def test_generate_raw_and_templated_with_context(client):
    first = client.generate(model="tiny", prompt=f"[{uuid.uuid4().hex}] Once upon a time", raw=True,
                            options={**GREEDY, "num_predict": 6})
    assert first.done and first.eval_count == 6 and first.context
    more = client.generate(model="tiny", prompt=" and then", raw=True, context=first.context,
                           options={**GREEDY, "num_predict": 4})
    assert more.context[:len(first.context)] == first.context
    assert more.prompt_eval_count < len(first.context)  # the earlier context is in the radix cache
    chat_like = client.generate(model="tiny", prompt="Hi", system="Be brief.", options={**GREEDY, "num_predict": 4})
    streamed = "".join(p.response for p in client.generate(model="tiny", prompt="Hi", system="Be brief.",
                                                           options={**GREEDY, "num_predict": 4}, stream=True))
    assert streamed == chat_like.response
    assert client.generate(model="tiny", prompt="").done_reason == "load"  # Ollama's way of loading a model


def test_tool_history_is_rendered(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    msgs = [*_user("Weather in Oslo?"),
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                              "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "Sunny", "tool_name": "get_weather"}]
    r = client.chat(model="tiny", messages=msgs, tools=tools, options={**GREEDY, "num_predict": 4})
    assert r.done and r.prompt_eval_count > 0


def test_model_routes(client, apis_server):
    (card,) = client.list().models
    assert card.model == apis_server.model and card.details.family == "qwen3" and card.size > 0
    shown = client.show(apis_server.model)
    assert {"completion", "tools", "thinking"} <= set(shown.capabilities)
    assert "<|im_start|>" in shown.template and shown.modelinfo["qwen3.context_length"] > 0
    assert client.ps().models[0].model == apis_server.model
    version = httpx.get(apis_server.url + "/api/version", headers={"Authorization": f"Bearer {APIS_KEYS[0]}"})
    assert version.status_code == 200 and version.json()["version"]


@pytest.mark.parametrize("path, body, match", [
    ("/api/chat", {"model": "m", "messages": _user("hi"), "format": "yaml"}, "format"),
    ("/api/chat", {"model": "m", "messages": _user("hi"), "options": {"mirostat": 1}}, "options.mirostat"),
    ("/api/chat", {"model": "m", "messages": _user("hi"), "options": {"num_gpu": 1}}, "load-time"),
    ("/api/chat", {"model": "m", "messages": _user("hi"), "options": {"temperature": "hot"}}, "temperature"),
    ("/api/chat", {"model": "m", "messages": _user("hi"), "options": {"num_ctx": 10**9}}, "num_ctx"),
    ("/api/chat", {"model": "m", "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("/api/chat", {"messages": _user("hi")}, "model"),
    ("/api/generate", {"model": "m", "prompt": "hi", "suffix": "end"}, "suffix"),
    ("/api/generate", {"model": "m", "prompt": "hi", "raw": True, "system": "x"}, "raw"),
    ("/api/generate", {"model": "m", "prompt": "hi", "context": [-5]}, "context"),
])
def test_bad_bodies_get_ollamas_error_shape(apis_server, path, body, match):
    r = httpx.post(apis_server.url + path, json=body, headers={"Authorization": f"Bearer {APIS_KEYS[0]}"},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and match in r.json()["error"]


def test_client_errors_are_response_errors(apis_server, client):
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=apis_server.url).chat(model="tiny", messages=_user("hi"))
    assert e.value.status_code == 401 and "API key" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        list(client.chat(model="tiny", messages=_user("hi"), options={"typical_p": 0.5}, stream=True))
    assert e.value.status_code == 400 and "typical_p" in e.value.error
    assert client.chat(model="tiny", messages=_user("still serving"), options={"num_predict": 1}).eval_count == 1
