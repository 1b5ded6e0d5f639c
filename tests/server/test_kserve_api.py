"""KServe v2 / Triton's HTTP protocol end to end: `tritonclient.http` against a real `radixgen serve` of the tiny
random Qwen3 (the adapters' shared server, tests/server/conftest.py). Health, server and model metadata and
readiness; infer with JSON and binary tensors (a batch of prompts: the same text as /v1/completions);
Triton's generate extension, whole and streamed; the radix cache's hits in num_cached_tokens; errors in the
v2 shape {"error": "..."} with 4xx codes that tritonclient turns into its own exception."""

from __future__ import annotations

import json
import uuid

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from server_proc import APIS_KEYS
from tritonclient.utils import InferenceServerException


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {APIS_KEYS[0]}"}  # a new dict each call: tritonclient adds to it


@pytest.fixture
def client(apis_server):
    c = triton.InferenceServerClient(apis_server.url.removeprefix("http://"))
    yield c
    c.close()


def _input(name: str, values, dtype: str, binary: bool = True) -> triton.InferInput:
    array = np.array(values, dtype=np.object_ if dtype == "BYTES" else None)
    if dtype != "BYTES":
        array = array.astype(triton.triton_to_np_dtype(dtype))
    t = triton.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array, binary_data=binary)
    return t


def _texts(array) -> list[str]:
    """BYTES elements: bytes from binary data, str from JSON (as tritonclient gives them)."""
    return [x.decode() if isinstance(x, bytes) else x for x in array.reshape(-1)]


def _completion(srv, prompt: str, max_tokens: int) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    r = httpx.post(srv.url + "/v1/completions", json=body, headers=_headers(), timeout=60)
    return r.json()["choices"][0]["text"]


def test_health_and_metadata(client, apis_server):
    assert client.is_server_live() and client.is_server_ready()  # probes need no key
    meta = client.get_server_metadata(headers=_headers())
    assert meta["name"] == "radixgen" and "generate" in meta["extensions"]
    model = apis_server.model
    assert client.is_model_ready(model, headers=_headers())
    assert client.is_model_ready(model, model_version="1", headers=_headers())
    m = client.get_model_metadata(model, headers=_headers())
    assert m["name"] == model and m["versions"] == ["1"]
    assert {"name": "text_input", "datatype": "BYTES", "shape": [-1]} in m["inputs"]
    assert {t["name"] for t in m["outputs"]} >= {"text_output", "finish_reason", "num_cached_tokens"}
    assert client.get_model_config(model, headers=_headers())["name"] == model
    assert client.get_model_repository_index(headers=_headers()) == [{"name": model, "version": "1", "state": "READY"}]


@pytest.mark.parametrize("binary", [True, False])
def test_infer_a_batch_equals_the_completions(client, apis_server, binary):
    prompts = [f"[{uuid.uuid4().hex[:6]}] Once upon a time", "The radix tree"]
    inputs = [_input("text_input", prompts, "BYTES", binary), _input("max_tokens", [6], "INT32", binary),
              _input("temperature", [0.0], "FP32", binary), _input("return_finish_reason", [True], "BOOL", binary),
              _input("exclude_input_in_output", [True], "BOOL", binary)]
    outputs = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("text_output", "finish_reason",
                                                                              "num_output_tokens")]
    r = client.infer(apis_server.model, inputs, outputs=outputs, request_id="req-7", headers=_headers())
    texts = _texts(r.as_numpy("text_output"))
    assert texts == [_completion(apis_server, p, 6) for p in prompts]
    assert _texts(r.as_numpy("finish_reason")) == ["length", "length"]
    assert r.as_numpy("num_output_tokens").tolist() == [6, 6]
    assert r.get_response()["id"] == "req-7"


def test_infer_includes_the_prompt_and_reports_cached_tokens(client, apis_server):
    prompt = f"[{uuid.uuid4().hex}] A long prompt about the sea and its tides. " * 4
    inputs = [_input("text_input", [prompt], "BYTES"), _input("max_tokens", [2], "INT32"),
              _input("return_num_cached_tokens", [True], "BOOL"), _input("return_num_input_tokens", [True], "BOOL")]
    first = client.infer(apis_server.model, inputs, headers=_headers())
    again = client.infer(apis_server.model, inputs, headers=_headers())
    assert _texts(first.as_numpy("text_output"))[0].startswith(prompt)  # the LLM backends' default
    assert first.as_numpy("num_cached_tokens")[0] < 8 < again.as_numpy("num_cached_tokens")[0]
    assert again.as_numpy("num_cached_tokens")[0] <= again.as_numpy("num_input_tokens")[0]


def test_generate_whole_and_streamed(apis_server):
    url = f"{apis_server.url}/v2/models/{apis_server.model}"
    body = {"text_input": "The radix tree", "max_tokens": 6, "parameters": {"temperature": 0}}
    whole = httpx.post(url + "/generate", json=body, headers=_headers(), timeout=60).json()
    assert whole["model_name"] == apis_server.model and whole["model_version"] == "1"
    assert whole["text_output"] == "The radix tree" + _completion(apis_server, "The radix tree", 6)
    with httpx.stream("POST", url + "/generate_stream", json={**body, "exclude_input_in_output": True,
                                                              "return_finish_reason": True},
                      headers=_headers(), timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(e["text_output"] for e in events) == whole["text_output"].removeprefix("The radix tree")
    assert events[-1]["finish_reason"] == "length" and all(e["finish_reason"] == "" for e in events[:-1])


def test_errors_are_v2_shaped_and_tritonclient_raises_them(client, apis_server):
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("missing-model", headers=_headers())
    assert e.value.status() == "404" and "missing-model" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        client.infer(apis_server.model, [_input("text_input", ["hi"], "BYTES"), _input("beam_width", [4], "INT32")],
                     headers=_headers())
    assert e.value.status() == "400" and "beam" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        client.infer(apis_server.model, [_input("text_input", ["hi"], "BYTES"), _input("top_p", [1.5], "FP32")],
                     headers=_headers())
    assert e.value.status() == "400" and "top_p" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        client.get_server_metadata()  # no key
    assert e.value.status() == "401"


@pytest.mark.parametrize("path, body, status, match", [
    ("/generate", {"max_tokens": 3}, 400, "text_input"),
    ("/generate", {"text_input": "hi", "max_tokens": "three"}, 400, "max_tokens"),
    ("/generate", {"text_input": "hi", "unknown_knob": 1}, 400, "unknown_knob"),
    ("/generate", {"text_input": "hi", "temperature": 0.5, "parameters": {"temperature": 0.1}}, 400, "both"),
    ("/infer", {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2], "data": ["a"]}]}, 400,
     "shape"),
    ("/infer", {"inputs": [{"name": "text_input", "datatype": "STRING", "shape": [1], "data": ["a"]}]}, 400,
     "datatype"),
    ("/infer", {"inputs": "text"}, 400, "inputs"),
    ("/nothing", {}, 404, "Not Found"),
])
def test_bad_bodies(apis_server, path, body, status, match):
    r = httpx.post(f"{apis_server.url}/v2/models/{apis_server.model}{path}", json=body, headers=_headers(),
                   timeout=60)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and match in r.json()["error"]
