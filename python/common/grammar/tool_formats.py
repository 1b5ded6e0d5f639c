"""Grammars of tool calls in each tool-call format, so that strict tools (and tool_choice forcing a call in
the model's own format) are enforced whatever the format writes:

- JSON formats (hermes, llama3_json, mistral): the call's arguments object between fixed texts
  (``ToolParser.call_tag``), a JSON-schema grammar inside;
- qwen3_coder: ``<parameter=k>`` blocks in schema order (the required ones present), each value raw text
  for a ``"type": "string"`` parameter (as the parser reads it back) and JSON for any other;
- pythonic: ``[f(k=v, ...), ...]`` at the start of the output, keyword values as Python literals (the JSON
  grammar with ``True`` / ``False`` / ``None`` for JSON's literals); the parser reads calls only there;
- harmony (gpt-oss, a forced call): the thinking's analysis messages if written, then the call's message with a
  JSON-schema grammar for its arguments (`harmony_calls`).

The flattened formats (qwen3_coder, pythonic) spell an arguments object as its properties, so a schema
whose top level is not plain properties (anyOf, patternProperties, minProperties, ...) cannot be enforced
there: a strict tool with one is a ConstraintError naming the keyword (a warning for a non-strict tool).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import xgrammar as xgr

from radixgen.common.grammar.compose import CallTag, _structural, calls_only, json_ebnf, triggered_calls
from radixgen.common.grammar.schema import ConstraintError, analyze_schema, report_unenforced
from radixgen.common.parsers import tool_parser_class
from radixgen.common.parsers.harmony import CHANNEL, CONSTRAIN, MESSAGE, START
from radixgen.common.parsers.xml_calls import CLOSE, FN, FN_CLOSE, OPEN, PARAM, PARAM_CLOSE


class ToolSpec(NamedTuple):
    name: str
    parameters: dict[str, Any]  # the arguments' JSON schema
    strict: bool = True  # an unenforceable keyword is an error (else a warning)
    where: str = "tools"  # what an error names


# top-level keywords of an arguments schema that the flattened formats spell (or that assert nothing)
_FLAT_KEYS = frozenset({"type", "properties", "required", "additionalProperties", "description", "title",
                        "$schema", "$id", "$defs", "definitions", "default", "examples", "$comment"})
# keywords of a raw-text string parameter (qwen3_coder) that its grammar spells
_RAW_STRING_KEYS = frozenset({"type", "description", "title", "enum", "const", "pattern", "minLength",
                              "maxLength", "default", "examples", "$comment"})
_JSON_LITERAL = re.compile(r'(?<!\\)"(true|false|null)"')
_JSON_CHAR = r'[^\0-\x1f\"\\\r\n]'  # a JSON string's plain character in xgrammar's EBNF
_PY_LITERAL = {"true": '"True"', "false": '"False"', "null": '"None"'}


def _flat_properties(t: ToolSpec) -> list[tuple[str, dict, bool]]:
    """(name, schema, required) of each property in schema order, after checking the schema is enforceable
    as flattened properties."""
    analysis = analyze_schema(t.parameters)
    schema, problems = analysis.schema, list(analysis.unenforced)
    if not isinstance(schema, dict):
        raise ConstraintError(f"{t.where}: the arguments schema must be an object schema")
    problems += [f"/{k}: not expressible in this tool-call format (its calls spell the arguments as properties)"
                 for k in schema if k not in _FLAT_KEYS]
    if schema.get("type", "object") != "object":
        problems.append(f"/type: {schema['type']!r} (a call's arguments are an object)")
    props = schema.get("properties") or {}
    required = schema.get("required") or []
    problems += [f"/required: {r!r} is not among the properties" for r in required if r not in props]
    report_unenforced(t.where, problems, t.strict)
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # local $refs resolve in each part
    out = []
    for name, sub in props.items():
        sub = sub if isinstance(sub, dict) else {}
        out.append((name, {**sub, **defs} if defs and "$ref" in str(sub) else sub, name in required))
    return out


# ---------------------------------------------------------------- qwen3_coder


def _raw_string(sub: dict, where: str, strict: bool) -> dict | None:
    """A string parameter's value as raw text (what the parser keeps as it is)."""
    report_unenforced(where, [f"/{k}: not expressible for a raw-text parameter" for k in sub
                              if k not in _RAW_STRING_KEYS], strict)
    if "const" in sub or "enum" in sub:
        values = [sub["const"]] if "const" in sub else sub["enum"]
        if all(isinstance(v, str) for v in values):
            return {"type": "or", "elements": [{"type": "const_string", "value": v} for v in values]}
    lo, hi = sub.get("minLength"), sub.get("maxLength")
    if "pattern" in sub:
        if lo is not None or hi is not None:
            report_unenforced(where, ["/minLength, /maxLength: not enforced together with a pattern"], strict)
        return {"type": "regex", "pattern": sub["pattern"]}
    if lo is not None or hi is not None:  # without "<": the value cannot hold the closing marker
        return {"type": "regex", "pattern": rf"[^<]{{{lo or 0},{'' if hi is None else hi}}}"}
    return None  # any text up to the closing marker


def _json_value(sub: dict, where: str, strict: bool, whitespace: str) -> str:
    """A parameter's JSON value, whose strings write "<" escaped (\\u003c): the parser ends the value at the
    first closing marker, wherever it stands."""
    return json_ebnf(sub, where, whitespace=whitespace, strict=strict).replace(_JSON_CHAR, _JSON_CHAR[:-1] + '<]')


def _xml_body(t: ToolSpec, whitespace: str) -> dict:
    parts = []
    for name, sub, required in _flat_properties(t):
        where = f"{t.where}/properties/{name}"
        begin = {"type": "const_string", "value": f"{PARAM}{name}>\n"}
        value = _raw_string(sub, where, t.strict) if sub.get("type") == "string" else {
            "type": "grammar", "grammar": _json_value(sub, where, t.strict, whitespace)}
        if value is None:  # free text: it ends at the first closing marker (the parser's reading too)
            tag = {"type": "sequence", "elements": [
                begin, {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": PARAM_CLOSE},
                {"type": "const_string", "value": "\n"}]}
        else:
            tag = {"type": "tag", "begin": begin["value"], "content": value, "end": f"\n{PARAM_CLOSE}\n"}
        parts.append(tag if required else {"type": "or", "elements": [{"type": "const_string", "value": ""}, tag]})
    if not parts:
        return {"type": "const_string", "value": ""}
    return {"type": "sequence", "elements": parts} if len(parts) > 1 else parts[0]


def _xml_tags(tools: Sequence[ToolSpec], whitespace: str) -> list[CallTag]:
    return [CallTag(OPEN, f"{OPEN}\n{FN}{t.name}>\n", f"{FN_CLOSE}\n{CLOSE}", t.parameters, t.strict, t.where,
                    content=_xml_body(t, whitespace)) for t in tools]


# ---------------------------------------------------------------- pythonic


def _empty() -> xgr.Grammar:
    return xgr.Grammar.from_ebnf('root ::= ""')


def _text(s: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf("root ::= " + json_str(s))


def json_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _python_value(sub: dict, where: str, strict: bool, whitespace: str) -> xgr.Grammar:
    """A JSON value's grammar spelled as a Python literal (the JSON escape ``\\/`` is left out: Python keeps
    its backslash)."""
    ebnf = json_ebnf(sub, where, whitespace=whitespace, strict=strict)
    ebnf = _JSON_LITERAL.sub(lambda m: _PY_LITERAL[m.group(1)], ebnf).replace(r'[\"\\/bfnrt]', r'[\"\\bfnrt]')
    return xgr.Grammar.from_ebnf(ebnf)


def _kwargs(t: ToolSpec, whitespace: str) -> xgr.Grammar:
    """``k1=v1, k2=v2`` in schema order, the required ones present (``first``: no comma before the item)."""
    items = [(xgr.Grammar.concat(_text(f"{name}="), _python_value(sub, f"{t.where}/properties/{name}", t.strict,
                                                                  whitespace)), required)
             for name, sub, required in _flat_properties(t)]
    later = _empty()  # the rest after an item has been written: each next item with its comma
    first = _empty()  # the rest while no item has been written yet
    for item, required in reversed(items):
        with_comma = xgr.Grammar.concat(_text(", "), item)
        first_here = xgr.Grammar.concat(item, later)
        first = first_here if required else xgr.Grammar.union(first_here, first)
        later = xgr.Grammar.concat(with_comma if required else xgr.Grammar.union(with_comma, _empty()), later)
    return first


def _pythonic_calls(tools: Sequence[ToolSpec], parallel: bool, whitespace: str) -> xgr.Grammar:
    tags = [{"type": "tag", "begin": f"{t.name}(", "end": ")",
             "content": {"type": "grammar", "grammar": str(_kwargs(t, whitespace))}} for t in tools]
    inner = _structural({"type": "tags_with_separator", "tags": tags, "separator": ", ", "at_least_one": True,
                         "stop_after_first": not parallel})
    return xgr.Grammar.concat(_text("["), inner, _text("]"))


# ---------------------------------------------------------------- per format


def _json_tags(fmt: str, tools: Sequence[ToolSpec]) -> list[CallTag]:
    cls = tool_parser_class(fmt)
    tags = []
    for t in tools:
        tag = cls.call_tag(t.name)
        if tag is None:
            raise ConstraintError(f"{t.where}: the {fmt} tool-call format has no grammar for its calls")
        tags.append(CallTag(*tag, t.parameters, t.strict, t.where))
    return tags


def auto_calls(fmt: str, tools: Sequence[ToolSpec], *, whitespace: str = "compact") -> xgr.Grammar:
    """Free output in which every call the format's parser would read is one of `tools` with valid arguments."""
    if fmt == "pythonic":  # calls only open the output: either the call list or text that does not open with "["
        text = xgr.Grammar.from_regex(r"(\s*[^\[\s][\s\S]*)?")
        return xgr.Grammar.union(_pythonic_calls(tools, True, whitespace), text)
    tags = _xml_tags(tools, whitespace) if fmt == "qwen3_coder" else _json_tags(fmt, tools)
    return triggered_calls(tags, whitespace=whitespace)


def only_calls(fmt: str, tools: Sequence[ToolSpec], *, parallel: bool = True,
               whitespace: str = "compact") -> xgr.Grammar:
    """One call (several when `parallel`) in the format, and nothing else."""
    if fmt == "pythonic":
        return _pythonic_calls(tools, parallel, whitespace)
    tags = _xml_tags(tools, whitespace) if fmt == "qwen3_coder" else _json_tags(fmt, tools)
    separator = "; " if fmt == "llama3_json" else "\n"  # Llama 3's calls are one JSON text, ";" between them
    return calls_only(tags, parallel=parallel, whitespace=whitespace, separator=separator)


def calls_or_answer(fmt: str, answer: xgr.Grammar, tools: Sequence[ToolSpec], *, parallel: bool = True,
                    whitespace: str = "compact") -> xgr.Grammar:
    """Either calls (nothing else) or an answer of `answer`'s grammar."""
    return xgr.Grammar.union(only_calls(fmt, tools, parallel=parallel, whitespace=whitespace), answer)


# ---------------------------------------------------------------- harmony (gpt-oss)


def harmony_calls(tools: Sequence[ToolSpec], *, whitespace: str = "compact") -> xgr.Grammar:
    """gpt-oss's output (after the prompt's ``<|start|>assistant``) ending in one call of `tools`: analysis
    messages first if the model writes them (its thinking, free text), then the call's message, on the commentary
    channel to ``functions.NAME`` with JSON content, the arguments valid under the tool's schema. The ``<|call|>``
    that ends the call is a stop token (the turn ends there: one call per turn, the format's way)."""
    thought = _structural({"type": "tag", "begin": f"{CHANNEL}analysis{MESSAGE}", "content": {"type": "any_text"},
                           "end": f"<|end|>{START}assistant"})
    calls = [{"type": "sequence", "elements": [
        {"type": "const_string", "value": f"{CHANNEL}commentary to=functions.{t.name} {CONSTRAIN}json{MESSAGE}"},
        {"type": "grammar", "grammar": json_ebnf(t.parameters, t.where, whitespace=whitespace, strict=t.strict)
         .replace(_JSON_CHAR, _JSON_CHAR[:-1] + '<]')}]}  # "<" escaped in strings: no marker inside the arguments
        for t in tools]
    call = _structural(calls[0] if len(calls) == 1 else {"type": "or", "elements": calls})
    return xgr.Grammar.union(xgr.Grammar.concat(thought, call), call)
