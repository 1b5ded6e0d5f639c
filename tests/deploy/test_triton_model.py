"""deploy/triton's Python-backend model, loaded as Triton loads it, against a stub of Triton's
`triton_python_backend_utils` (tensors, responses, errors, the response sender of a decoupled model) and a
real Engine on a tiny random Llama: whole and streamed answers equal the Engine's own, the final response
carries the counts (the radix cache's hits in num_cached_tokens), a bad parameter is an error response, and
config.pbtxt declares exactly the tensors model.py reads and writes."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
from tiny_models import tiny_model_dir

REPO = Path(__file__).resolve().parents[2] / "deploy" / "triton" / "model_repository" / "radixgen"
FINAL = 1


class Tensor:
    def __init__(self, name: str, array: np.ndarray):
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class TritonError:
    def __init__(self, message: str):
        self._message = message

    def message(self) -> str:
        return self._message


class InferenceResponse:
    def __init__(self, output_tensors: list, error: TritonError | None = None):
        self.tensors = {t.name(): t.as_numpy() for t in output_tensors}
        self.error = error


def stub_module() -> types.ModuleType:
    m = types.ModuleType("triton_python_backend_utils")
    m.Tensor, m.TritonError, m.InferenceResponse = Tensor, TritonError, InferenceResponse
    m.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    m.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    m.using_decoupled_model_transaction_policy = lambda config: config["model_transaction_policy"]["decoupled"]
    return m


class Sender:
    def __init__(self):
        self.sent: list[tuple[InferenceResponse | None, int]] = []
        self.done = threading.Event()

    def send(self, response=None, flags: int = 0):
        assert not self.done.is_set(), "a response after the final one"
        self.sent.append((response, flags))
        if flags & FINAL:
            self.done.set()


class Request:
    def __init__(self, **inputs):
        self.inputs = {}
        for name, value in inputs.items():
            if isinstance(value, str):
                array = np.array([value.encode()], dtype=np.object_)
            elif isinstance(value, list):
                array = np.array([v.encode() for v in value], dtype=np.object_)
            else:
                array = np.array([value])
            self.inputs[name] = Tensor(name, array)
        self.sender = Sender()

    def get_response_sender(self) -> Sender:
        return self.sender

    def is_cancelled(self) -> bool:
        return False

    def responses(self) -> list[InferenceResponse]:
        assert self.sender.done.wait(120), "no final response"
        assert all(flags == 0 for _, flags in self.sender.sent[:-1]) and self.sender.sent[-1][1] == FINAL
        return [r for r, _ in self.sender.sent]


def _text(response: InferenceResponse) -> str:
    return "".join(x.decode() for x in response.tensors["text_output"].reshape(-1))


@pytest.fixture(scope="module")
def model():
    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = stub_module()
    try:
        spec = importlib.util.spec_from_file_location("radixgen_triton_model", REPO / "1" / "model.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        instance = module.TritonPythonModel()
        engine_args = {"model": str(tiny_model_dir("llama")), "dtype": "float32", "max_total_tokens": 4096}
        config = {"model_transaction_policy": {"decoupled": True},
                  "parameters": {"engine_args": {"string_value": json.dumps(engine_args)}}}
        instance.initialize({"model_config": json.dumps(config)})
        yield module, instance
        instance.finalize()
    finally:
        if saved is None:
            sys.modules.pop("triton_python_backend_utils", None)
        else:
            sys.modules["triton_python_backend_utils"] = saved


def test_config_declares_the_tensors_model_py_uses(model):
    module, _ = model
    text = (REPO / "config.pbtxt").read_text()
    assert re.search(r"model_transaction_policy\s*{\s*decoupled:\s*true\s*}", text)
    assert re.search(r'backend:\s*"python"', text)
    inputs = re.search(r"\ninput \[(.*?)\n\]", text, re.S).group(1)
    outputs = re.search(r"\noutput \[(.*?)\n\]", text, re.S).group(1)
    read = {"text_input", "stop_words", "stream", "exclude_input_in_output", *module.PARAMETERS}
    assert set(re.findall(r'name: "(\w+)"', inputs)) == read
    written = {"text_output", "finish_reason", "num_input_tokens", "num_cached_tokens", "num_output_tokens"}
    assert set(re.findall(r'name: "(\w+)"', outputs)) == written
    engine_args = re.search(r'key: "engine_args"\s*value: { string_value: "(.*)" }', text).group(1)
    assert isinstance(json.loads(engine_args.replace('\\"', '"')), dict)


def test_whole_and_streamed_answers_equal_the_engines(model):
    _, instance = model
    prompt = "The radix tree of the cache"
    expected = instance.engine.generate(prompt, {"max_new_tokens": 8, "temperature": 0})["text"]
    whole = Request(text_input=prompt, max_tokens=np.int32(8), temperature=np.float32(0.0))
    streamed = Request(text_input=prompt, max_tokens=np.int32(8), temperature=np.float32(0.0), stream=True,
                       exclude_input_in_output=True)
    instance.execute([whole, streamed])  # one call, two requests: both answered, concurrently

    (one,) = whole.responses()
    assert one.error is None and _text(one) == prompt + expected
    assert one.tensors["finish_reason"].reshape(-1)[0].decode() == "length"
    assert int(one.tensors["num_output_tokens"][0]) == 8

    parts = streamed.responses()
    assert len(parts) >= 2 and all(p.error is None for p in parts)
    assert "".join(_text(p) for p in parts) == expected
    final = parts[-1].tensors
    assert int(final["num_input_tokens"][0]) == len(instance.engine.tokenize([prompt])[0])
    assert int(final["num_output_tokens"][0]) == 8


def test_a_repeated_prompt_reports_cached_tokens_and_stops_at_a_stop_word(model):
    _, instance = model
    prompt = "Once upon a time in a land far away"
    first = Request(text_input=prompt, max_tokens=np.int32(4), temperature=np.float32(0.0))
    instance.execute([first])
    text = _text(first.responses()[0])[len(prompt):]
    again = Request(text_input=prompt, max_tokens=np.int32(4), temperature=np.float32(0.0),
                    stop_words=[text[2:4]] if len(text) >= 4 else ["\x00"])
    instance.execute([again])
    (resp,) = again.responses()
    assert int(resp.tensors["num_cached_tokens"][0]) > 0
    if len(text) >= 4:
        assert _text(resp) == prompt + text[:text.index(text[2:4])]
        assert resp.tensors["finish_reason"].reshape(-1)[0].decode() == "stop"


@pytest.mark.parametrize("inputs, match", [
    ({"temperature": np.float32(-1.0)}, "temperature"),
    ({"max_tokens": np.int32(-3)}, "max_new_tokens"),
    ({"top_p": [0.5, 0.6]}, "one element"),
])
def test_bad_parameters_are_an_error_response(model, inputs, match):
    _, instance = model
    if isinstance(inputs.get("top_p"), list):
        request = Request(text_input="hi")
        request.inputs["top_p"] = Tensor("top_p", np.array(inputs["top_p"], dtype=np.float32))
    else:
        request = Request(text_input="hi", **inputs)
    instance.execute([request])
    (resp,) = request.responses()
    assert resp.error is not None and match in resp.error.message()
