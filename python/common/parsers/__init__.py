"""Output parsers of chat responses: reasoning formats (thinking -> ``reasoning_content``) and tool-call
formats (calls -> ``tool_calls``), chosen by name (``--reasoning-parser``, ``--tool-call-parser``) or
detected from the model's chat template. Every parser is incremental: see parsers.base for the contract."""

from __future__ import annotations

from collections.abc import Mapping

from radixgen.common.parsers.base import (
    CallArgs,
    CallStart,
    Content,
    Event,
    ParsedCalls,
    Split,
    ToolParser,
    collect,
)
from radixgen.common.parsers.harmony import HarmonyFormat, HarmonyToolParser
from radixgen.common.parsers.json_calls import (
    ForcedParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
)
from radixgen.common.parsers.pythonic import PythonicParser
from radixgen.common.parsers.reasoning import REASONING_FORMATS, ReasoningFormat, ReasoningParser
from radixgen.common.parsers.xml_calls import Qwen3CoderParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,  # Qwen2.5 / Qwen3 write Hermes' calls
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser,
    "harmony": HarmonyToolParser,  # gpt-oss: calls in the commentary channel
}
DEFAULT_TOOL_PARSER = "hermes"  # what the server teaches a model whose template does not render tools

__all__ = [
    "DEFAULT_TOOL_PARSER", "REASONING_FORMATS", "TOOL_PARSERS", "CallArgs", "CallStart", "Content", "Event",
    "ForcedParser", "HarmonyFormat", "NamedParser", "ParsedCalls", "ReasoningFormat", "ReasoningParser", "Split",
    "ToolParser",
    "collect", "detect_reasoning_format", "detect_tool_parser", "reasoning_format", "tool_parser_class",
]


def _known(kind: str, name: str, names: Mapping[str, object]) -> None:
    if name not in names:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(names))}")


def reasoning_format(name: str) -> ReasoningFormat:
    """The format named `name`; ValueError naming the known ones otherwise."""
    _known("reasoning parser", name, REASONING_FORMATS)
    return REASONING_FORMATS[name]


def tool_parser_class(name: str) -> type[ToolParser]:
    _known("tool-call parser", name, TOOL_PARSERS)
    return TOOL_PARSERS[name]


def detect_reasoning_format(template: str | None) -> ReasoningFormat | None:
    """The reasoning format a chat template writes, or None (the model does not think in a block)."""
    t = template or ""
    if "<|channel|>" in t:
        return REASONING_FORMATS["harmony"]  # type: ignore[return-value]
    if "</think>" not in t:
        return None
    if "<｜Assistant｜>" in t or "<｜assistant｜>" in t:
        return REASONING_FORMATS["deepseek-r1"]
    return REASONING_FORMATS["qwen3"]


def detect_tool_parser(template: str | None) -> str:
    """The tool-call format a chat template teaches; the default when it names none."""
    t = template or ""
    if "<|channel|>" in t:
        return "harmony"
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "[func_name1(" in t or "<|python_start|>" in t:
        return "pythonic"
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and '"parameters"' in t):
        return "llama3_json"
    return DEFAULT_TOOL_PARSER
