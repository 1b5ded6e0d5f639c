"""Adapter names vs adapter folders: a request names a loaded LoRA adapter with `lora_name`; `lora_path` is a folder
(/load_lora_adapter, vLLM's LoRARequest) except where SGLang's API names the adapter so (/generate, the OpenAI extra
body, Engine.generate, kept as an alias of lora_name). No model needed; the same over a real server:
tests/server/test_lora_server.py."""

import pytest

import radixgen.lang.api as lang_api
from radixgen.runtime.server.protocol import ChatCompletionRequest, CompletionRequest


def test_lora_name_and_its_sglang_alias_on_the_bodies():
    from radixgen.runtime.server.native_protocol import GenerateRequest, LoadLoRAAdapterRequest

    assert GenerateRequest(text="x", lora_name="a").lora == ("lora_name", "a")
    assert GenerateRequest(text="x", lora_path="a").lora == ("lora_path", "a")  # SGLang's /generate spelling
    assert GenerateRequest(text=["x", "y"], lora_name=["a", None], lora_path=["a", None]).lora[1] == ["a", None]
    with pytest.raises(ValueError, match="different adapters"):
        GenerateRequest(text="x", lora_name="a", lora_path="b")
    with pytest.raises(ValueError, match="lora_name: must be a LoRA adapter's name"):
        GenerateRequest(text="x", lora_name="")
    assert CompletionRequest(prompt="x", lora_path="b").lora == ("lora_path", "b")
    assert CompletionRequest(prompt="x", lora_name="b").lora == ("lora_name", "b")
    with pytest.raises(ValueError, match="different adapters"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], lora_name="a", lora_path="b")
    # a folder stays lora_path where SGLang's /load_lora_adapter and vLLM's LoRARequest name one
    assert LoadLoRAAdapterRequest(lora_name="a", lora_path="/adapters/a").lora_path == "/adapters/a"
    from radixgen.offline.lora import LoRARequest

    assert LoRARequest("a", 1, "/adapters/a").lora_path == "/adapters/a"


def test_engine_validation_names_the_keyword_the_caller_used():
    from radixgen.runtime.engine.request_state import RequestError
    from radixgen.runtime.engine.validation import lora_names
    from radixgen.runtime.engine.validation import pick_lora_name as pick

    loaded = {"a": "/p"}
    assert lora_names("a", 2, loaded) == ["a", "a"]
    with pytest.raises(RequestError, match="^lora_path: unknown LoRA adapter 'zz'"):
        lora_names("zz", 1, loaded, "lora_path")
    with pytest.raises(RequestError, match="^lora_name: LoRA adapters are not enabled"):
        lora_names("a", 1, None)
    assert pick(None, "a") == ("lora_path", "a") and pick("a", None) == ("lora_name", "a")


def test_run_takes_lora_name_and_refuses_lora_path():
    @lang_api.function
    def prog(s):
        s += "x"

    with pytest.raises(TypeError, match="lora_name"):
        prog.run(lora_path="a")
    with pytest.raises(ValueError, match="run.lora_name"):
        prog.run(lora_name=3)
