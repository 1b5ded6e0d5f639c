"""radixgen: structured generation programs over a radix-tree KV cache runtime.

    import radixgen as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.Engine())
    print(qa.run(question="What is a radix tree?")["answer"])

The offline batch API in vLLM's shape:

    from radixgen.offline import LLM, SamplingParams
    outs = LLM().generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))

The language is imported eagerly (it is light); the runtime (torch, the model) and the HTTP /
OpenAI clients only when first used.
"""

from typing import Any

from radixgen import lang as _lang
from radixgen.lang import (  # noqa: F401 - re-exported, listed in __all__ via _lang.__all__
    BaseBackend,
    ChoicesDecision,
    ChoicesSamplingMethod,
    Function,
    GlobalConfig,
    ProgramError,
    ProgramState,
    ProgramStateGroup,
    Runtime,
    assistant,
    assistant_begin,
    assistant_end,
    embed,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    global_config,
    greedy_token_selection,
    image,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
    user_begin,
    user_end,
    video,
)

__version__ = "0.1.0"

# name -> (module, attribute), imported on first access
_LAZY = {
    "Engine": ("radixgen.runtime.engine", "Engine"),
    "SamplingParams": ("radixgen.common.sampling_params", "SamplingParams"),
    "EngineBackend": ("radixgen.lang.backend_engine", "EngineBackend"),
    "RuntimeEndpoint": ("radixgen.lang.backend_http", "RuntimeEndpoint"),
    "OpenAI": ("radixgen.lang.backend_openai", "OpenAI"),
    # the offline API in vLLM's shape; its SamplingParams (max_tokens...) is radixgen.offline.SamplingParams
    "LLM": ("radixgen.offline", "LLM"),
    "GuidedDecodingParams": ("radixgen.offline", "GuidedDecodingParams"),
    "LoRARequest": ("radixgen.offline", "LoRARequest"),
    "RequestOutput": ("radixgen.offline", "RequestOutput"),
    "CompletionOutput": ("radixgen.offline", "CompletionOutput"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'radixgen' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = sorted({*_lang.__all__, *_LAZY})
