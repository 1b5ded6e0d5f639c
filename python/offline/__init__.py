"""The offline batch API in vLLM's shape: `LLM`, `SamplingParams`, `GuidedDecodingParams`, `LoRARequest`, and
the `RequestOutput` / `CompletionOutput` results. See llm.py."""

from radixgen.offline.llm import LLM
from radixgen.offline.lora import LoRARequest
from radixgen.offline.outputs import CompletionOutput, Logprob, RequestOutput
from radixgen.offline.params import GuidedDecodingParams, SamplingParams

__all__ = ["LLM", "CompletionOutput", "GuidedDecodingParams", "Logprob", "LoRARequest", "RequestOutput",
           "SamplingParams"]
