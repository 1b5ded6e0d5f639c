"""vLLM's `LoRARequest` for `radixgen.LLM`: a request (or a list of them, one per prompt) names a LoRA adapter.

    llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=16)
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))

An adapter is loaded into the engine the first time a request names it (its folder read then, a bad one
refused with the problem named); `lora_int_id` is the adapter's identity, as in vLLM: one id is one
(name, path) for the life of the LLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name: must be a non-empty string (got {self.lora_name!r})")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id: must be a positive integer (got {self.lora_int_id!r})")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"LoRARequest.lora_path: must be a string (got {self.lora_path!r})")


class LoRARegistry:
    """The adapters an LLM's requests named, by id; loads each into the engine on first use."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.by_id: dict[int, LoRARequest] = {}

    def names(self, lora_request: Any, count: int) -> list[str | None] | None:
        """The adapter name of each of `count` prompts (None: the base model), or None when no prompt has one."""
        if lora_request is None:
            return None
        requests = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * count
        if len(requests) != count:
            raise ValueError(f"LLM.generate.lora_request: got {len(requests)} for {count} prompts")
        return [None if r is None else self.resolve(r) for r in requests]

    def resolve(self, req: Any) -> str:
        if not isinstance(req, LoRARequest):
            raise ValueError(f"LLM.generate.lora_request: expected a LoRARequest, got {type(req).__name__}")
        known = self.by_id.get(req.lora_int_id)
        if known is not None and known != req:
            raise ValueError(f"LoRARequest: lora_int_id {req.lora_int_id} is already {known.lora_name!r} "
                             f"({known.lora_path!r})")
        loaded = self.engine.lora_adapters
        if loaded is None:
            raise ValueError("LLM.generate.lora_request: LoRA is not enabled (LLM(..., enable_lora=True))")
        if req.lora_name in loaded:
            if req.lora_path and loaded[req.lora_name] != req.lora_path:
                raise ValueError(f"LoRARequest: adapter {req.lora_name!r} is loaded from {loaded[req.lora_name]!r}, "
                                 f"not {req.lora_path!r}")
        elif not req.lora_path:
            raise ValueError(f"LoRARequest: adapter {req.lora_name!r} is not loaded and has no lora_path")
        else:
            self.engine.load_lora_adapter(req.lora_name, req.lora_path)
        self.by_id[req.lora_int_id] = req
        return req.lora_name
