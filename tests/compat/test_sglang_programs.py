"""SGLang's own frontend test programs (`sglang/test/test_programs.py`, shipped in the sglang package) run
unchanged through `sglang.RuntimeEndpoint` against a real `radixgen serve`.

A protocol failure (an HTTP error, a missing meta_info key, a hang) fails a test here. Programs whose final
assertion is about the answer's quality, which the bundled 135M model lacks, are marked one by one with
xfail(raises=AssertionError): a protocol error there still fails the test, since it raises something else
(the client raises RuntimeError on any non-200)."""

from __future__ import annotations

import json
import re
import sys
import types

import httpx
import pytest

sgl = pytest.importorskip("sglang", reason="SGLang's frontend (pip install --no-deps sglang) is not installed")
programs = pytest.importorskip("sglang.test.test_programs")

pytestmark = pytest.mark.slow

QUALITY = "the 135M model does not know the answer"


@pytest.fixture(scope="module", autouse=True)
def endpoint(sglang_server):
    backend = sgl.RuntimeEndpoint(sglang_server.url, api_key=sglang_server.api_key)
    previous = sgl.global_config.default_backend
    sgl.set_default_backend(backend)
    yield backend
    sgl.global_config.default_backend = previous


# ---------------------------------------------------------------- programs whose assertions hold here


@pytest.mark.parametrize(
    "name",
    [
        "test_mt_bench",
        "test_decode_json_regex",
        "test_regex",
        "test_dtype_gen",
        "test_stream",
        "test_stream_logprobs",  # per-chunk output_token_logprobs and output_token_logprobs_length
        "test_parallel_decoding",  # fork / join
    ],
)
def test_program(name):
    getattr(programs, name)()


def test_decode_json():
    """Five constrained gens (`gen_string`, `gen_int`, `gen(dtype=...)`) at SGLang's max_new_tokens=64. The bundled
    135M model can run a string field for all 64 tokens without closing it (which one, and whether, follows the
    CPU's arithmetic), or write an integer JSON refuses ("+5", "007": REGEX_INT allows both), and the program's
    JSON then does not parse. That alone is the model's length, not the
    protocol: every field must still be exactly what its constraint allows, with only a string's closing quote
    missing; anything else fails here."""
    try:
        programs.test_decode_json()
    except json.JSONDecodeError as error:
        string, integer = r'"[\w\d\s]*"?', r"[-+]?[0-9]+[ \n]*"  # sglang.lang.ir's REGEX_STR / REGEX_INT
        fields = [("name", string), ("population", integer), ("area", integer), ("country", string),
                  ("timezone", string)]
        shape = r"\{\n" + ",\n".join(f'  "{key}": {value}' for key, value in fields) + r"\n\}"
        assert re.fullmatch(shape, error.doc), f"the constrained fields broke their regex: {error.doc!r}"
        pytest.xfail("the model's text within the constraints is not JSON: a string cut at max_new_tokens=64, or "
                     "an integer with a sign or leading zeros")


@pytest.mark.xfail(raises=AssertionError, reason="the model's arithmetic: where a prefill's bf16 bits follow the "
                   "AMX GEMM (AMX CPUs), its greedy expression for 257 * 983 evaluates to 3855")
def test_tool_use():
    programs.test_tool_use()


def test_select_protocol():
    programs.test_select(check_answer=False)  # select: prompt logprobs of each choice (token healing)


def test_expert_answer_protocol():
    programs.test_expert_answer(check_answer=False)


def test_parallel_encoding_protocol():
    programs.test_parallel_encoding(check_answer=False)  # join(mode="concate_and_append")


def test_gen_min_new_tokens(monkeypatch, endpoint):
    # The program counts tokens with sglang.srt's get_tokenizer, whose module imports torchvision (a
    # server dependency not installed here); the same transformers tokenizer, loaded directly, stands in.
    from transformers import AutoTokenizer

    shim = types.ModuleType("sglang.srt.utils.hf_transformers_utils")
    shim.get_tokenizer = lambda path, **kw: AutoTokenizer.from_pretrained(path)
    monkeypatch.setitem(sys.modules, "sglang.srt.utils.hf_transformers_utils", shim)
    # it reads the model path through an `sgl.Runtime` (a launched server + its endpoint): the same
    # object, holding our endpoint, without the launch
    from sglang.lang.backend.runtime_endpoint import Runtime

    runtime = object.__new__(Runtime)
    runtime.pid, runtime.endpoint = None, endpoint
    monkeypatch.setattr(sgl.global_config, "default_backend", runtime)
    programs.test_gen_min_new_tokens()


# ---------------------------------------------------------------- answers the 135M model gets wrong


@pytest.mark.xfail(raises=AssertionError, reason=f"{QUALITY}: it answers 'New York' for the US capital")
def test_few_shot_qa():
    programs.test_few_shot_qa()


@pytest.mark.xfail(raises=AssertionError, reason=f"{QUALITY}: it writes 24000... for the hours in a day")
def test_decode_int():
    programs.test_decode_int()


@pytest.mark.xfail(raises=AssertionError, reason=f"{QUALITY}: the ReAct chain does not reach Finland")
def test_react():
    programs.test_react()


@pytest.mark.xfail(raises=AssertionError, reason=f"{QUALITY}: True/False/Unknown from the facts given")
def test_select_answers():
    programs.test_select(check_answer=True)


@pytest.mark.xfail(raises=AssertionError, reason=f"{QUALITY}: the capital of France through an 'expert'")
def test_expert_answer():
    programs.test_expert_answer(check_answer=True)


@pytest.mark.xfail(raises=AssertionError, reason=f"{QUALITY}: who is Julian's father, from three statements")
def test_parallel_encoding():
    programs.test_parallel_encoding(check_answer=True)


# not run: test_image_qa (it reads an example image of SGLang's repository, which the package does not ship; a
# program with sgl.image runs on a vision-language model in tests/server/test_multimodal_server.py, and this text
# model answers image_data with a 400 naming the feature, tested below), test_completion_speculative and
# test_chat_completion_speculative (API speculative execution: SGLang runs them with its OpenAI backend).


# ---------------------------------------------------------------- the client's other calls


def test_endpoint_calls(endpoint, sglang_server):
    info = endpoint.get_server_info()  # GET /server_info
    assert info["internal_states"] and "cache" in info
    endpoint.flush_cache()  # POST /flush_cache
    endpoint.cache_prefix("A prefix worth caching. " * 4)  # /generate with max_new_tokens 0
    endpoint.concatenate_and_append(["a", "b"], "c")  # /concate_and_append_request
    assert endpoint.get_model_name() == endpoint.model_info["model_path"]
    headers = sglang_server.headers()
    r = httpx.post(f"{sglang_server.url}/generate", headers=headers, timeout=60,
                   json={"text": "x", "image_data": "data:image/png;base64,AAAA"})
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]


def test_bench_serving_request_body(sglang_server):
    """The body `bench_serving --backend sglang` sends (null/false fields for features radixgen lacks)."""
    body = {
        "text": "Hello",
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True},
        "stream": True,
        "lora_path": None,
        "return_logprob": False,
        "return_routed_experts": False,
        "logprob_start_len": -1,
    }
    with httpx.stream("POST", f"{sglang_server.url}/generate", json=body, headers=sglang_server.headers(),
                      timeout=60) as r:
        assert r.status_code == 200
        lines = [x for x in r.iter_lines() if x.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    assert '"completion_tokens":4' in lines[-2]
