"""The harmony format end to end: a real server over a tiny gpt-oss whose tokenizer has the format's special tokens,
hit over HTTP. Its weights are set so that greedy decoding writes one harmony tool call (each token's embedding a
unit vector, attention and experts adding nothing, the LM head mapping each token of the call to the next): the
server renders the prompt in the format (tools, reasoning effort), keeps the special tokens in the output text,
and answers with `tool_calls`, streamed and whole."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from server_proc import start_server, stop_server
from tiny_models import tiny_window_model_dir

from radixgen.common.harmony_prompt import render_harmony

SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


def harmony_folder(root) -> tuple:
    """The tiny gpt-oss with the format's special tokens added to its tokenizer, writing CALL greedily."""
    from transformers import AutoTokenizer

    folder = root / "gpt_oss_harmony"
    shutil.copytree(tiny_window_model_dir("gpt_oss"), folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.save_pretrained(folder)
    prompt = tok.encode(render_harmony(MESSAGES, TOOLS, "high"), add_special_tokens=False)
    chain = [prompt[-1], *tok.encode(CALL, add_special_tokens=False)]  # (the prompt ends with "assistant")
    assert len(set(chain)) == len(chain), "each token of the call must have one successor"
    cfg = json.loads((folder / "config.json").read_text())
    assert max(chain) < cfg["vocab_size"] and len(chain) <= cfg["hidden_size"]
    w = load_file(folder / "model.safetensors")
    hidden = cfg["hidden_size"]
    w["model.embed_tokens.weight"] = torch.zeros(cfg["vocab_size"], hidden)
    w["lm_head.weight"] = torch.zeros(cfg["vocab_size"], hidden)
    for k, (t, nxt) in enumerate(zip(chain, chain[1:], strict=False)):
        w["model.embed_tokens.weight"][t, k] = 1.0
        w["lm_head.weight"][nxt, k] = 10.0
    w["model.norm.weight"] = torch.ones(hidden)
    for name in list(w):  # attention and experts add nothing to the residual stream
        if name.endswith(("o_proj.weight", "o_proj.bias", "experts.down_proj", "experts.down_proj_bias")):
            w[name] = torch.zeros_like(w[name])
    save_file(w, folder / "model.safetensors", metadata={"format": "pt"})
    cfg["eos_token_id"] = [cfg["eos_token_id"], tok.convert_tokens_to_ids("<|call|>")]
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, len(prompt)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder, prompt_len = harmony_folder(tmp_path_factory.mktemp("harmony"))
    s = start_server("--model", str(folder), "--reasoning-parser", "harmony", "--tool-call-parser", "harmony")
    try:
        yield s, prompt_len, folder
    finally:
        stop_server(s)


def _body(**kw) -> dict:
    return {"model": "m", "messages": MESSAGES, "tools": TOOLS, "reasoning_effort": "high", "max_tokens": 40,
            "temperature": 0, **kw}


def test_tool_call_whole_and_streamed(server):
    server, prompt_len, _ = server
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=_body())
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["prompt_tokens"] == prompt_len  # our harmony rendering, markers one token each
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assert choice["message"]["content"] is None and choice["message"]["reasoning_content"] is None

        deltas, finish = [], None
        with c.stream("POST", "/v1/chat/completions", json=_body(stream=True)) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])["choices"][0]
                    deltas.append(ch["delta"])
                    finish = ch["finish_reason"] or finish
        calls = [t for d in deltas for t in d.get("tool_calls") or []]
        assert calls[0]["function"]["name"] == "get_weather" and finish == "tool_calls"
        assert json.loads("".join(t["function"].get("arguments", "") for t in calls)) == {"city": "Paris"}
        assert not any(d.get("content") for d in deltas)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_in_the_format(server, choice):
    """tool_choice required / named: the grammar of one call in the format's own messages, whose markers (special
    tokens) it lets through: the model's call is allowed token by token, and read back as the call."""
    server, _, _ = server
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=_body(tool_choice=choice))
        assert r.status_code == 200, r.text
        choice_out = r.json()["choices"][0]
        assert choice_out["finish_reason"] == "tool_calls"
        (call,) = choice_out["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_constraints_are_refused_by_name(server):
    server, _, _ = server
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=_body(response_format={"type": "json_object"}))
        assert r.status_code == 400 and "harmony" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json=_body(reasoning_effort=None,
                                                      chat_template_kwargs={"reasoning_effort": "extreme"}))
        assert r.status_code == 400 and "reasoning_effort" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_history_with_a_call_its_thinking_and_result(server):
    """An open turn's thinking (reasoning_content echoed back), its call and the tool's result are rendered in the
    format: the prompt is exactly our rendering of them."""
    from transformers import AutoTokenizer

    server, _, folder = server
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = MESSAGES + [{"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
                           "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    expected = render_harmony(history, TOOLS, "high")
    assert "<|channel|>analysis<|message|>Need the tool.<|end|>" in expected
    tok = AutoTokenizer.from_pretrained(folder)
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=_body(messages=history, max_tokens=1))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(expected, add_special_tokens=False))
