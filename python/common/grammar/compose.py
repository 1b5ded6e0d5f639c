"""Grammars built of parts, for what one constraint kind cannot say: a constraint that starts after the
model's think block, tool calls whose arguments are enforced from the call marker on (free text around
them), and "either a call or an answer". Built with xgrammar's structural tags and grammar algebra in the
front process, and handed on as EBNF text: the scheduler compiles and caches it like any `ebnf` constraint,
in the same batched sampling step as every other constraint (no second request, no new constraint kind).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import xgrammar as xgr

from radixgen.common.grammar.compile import check_constraint, choices_to_ebnf, fix_bounded_strings
from radixgen.common.grammar.schema import ConstraintError, analyze_schema, report_unenforced

THINK_GAP = r"[ \n]{0,4}"  # what may stand between the end of the think block and the answer


class CallTag(NamedTuple):
    """One tool's call as a format writes it: `begin`, the arguments object, `end`; `trigger` starts it."""

    trigger: str
    begin: str
    end: str
    arguments: dict[str, Any]  # the parameters schema
    strict: bool = True  # a keyword the grammar cannot enforce is an error (else a warning)
    where: str = "tools"  # what an error names
    content: dict | None = None  # a structural-tag format for what stands between begin and end (None: the
    # arguments as a JSON object of the schema; the flattened formats spell it otherwise, grammar/tool_formats)


def _structural(fmt: dict) -> xgr.Grammar:
    return xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))


def json_ebnf(schema: Any, where: str, *, whitespace: str = "compact", strict: bool = False) -> str:
    """A JSON schema's grammar as EBNF, analysed as the `json_schema` constraint is: a keyword the grammar
    cannot enforce is a ConstraintError naming it when `strict`, else a warning."""
    analysis = analyze_schema(schema)
    report_unenforced(where, analysis.unenforced, strict)
    if whitespace == "compact":
        ws: dict[str, Any] = dict(any_whitespace=False, separators=(",", ":"))
    else:
        ws = dict(any_whitespace=True, max_whitespace_cnt=8)
    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(analysis.schema), strict_mode=True, **ws)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for every schema error
        raise ConstraintError(f"{where}: invalid JSON schema: {e}") from e
    return fix_bounded_strings(str(grammar))


def constraint_grammar(kind: str, text: str, *, whitespace: str = "compact", strict: bool = False) -> xgr.Grammar:
    """One constraint (regex / json_schema / ebnf / choices, as SamplingParams carries it) as a Grammar part."""
    check_constraint(kind, text, strict_json=strict)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "ebnf":
        return xgr.Grammar.from_ebnf(text)
    if kind == "choices":
        return xgr.Grammar.from_ebnf(choices_to_ebnf(text))
    return xgr.Grammar.from_ebnf(json_ebnf(json.loads(text), kind, whitespace=whitespace, strict=strict))


def _call_tags(calls: Sequence[CallTag], whitespace: str) -> list[dict]:
    return [{"type": "tag", "begin": c.begin, "end": c.end,
             "content": c.content or {"type": "grammar", "grammar": json_ebnf(c.arguments, c.where,
                                                                             whitespace=whitespace, strict=c.strict)}}
            for c in calls]


def triggered_calls(calls: Sequence[CallTag], *, whitespace: str = "compact") -> xgr.Grammar:
    """Free text in which every call, once its trigger is written, is one of `calls` with valid arguments."""
    triggers = list(dict.fromkeys(c.trigger for c in calls))
    return _structural({"type": "triggered_tags", "triggers": triggers, "tags": _call_tags(calls, whitespace),
                        "at_least_one": False, "stop_after_first": False})


def calls_only(calls: Sequence[CallTag], *, parallel: bool = True, whitespace: str = "compact",
               separator: str = "\n") -> xgr.Grammar:
    """One call (or several, `separator` between them, when `parallel`) and nothing else."""
    return _structural({"type": "tags_with_separator", "tags": _call_tags(calls, whitespace),
                        "separator": separator, "at_least_one": True, "stop_after_first": not parallel})


def calls_or(answer: xgr.Grammar, calls: Sequence[CallTag], *, parallel: bool = True,
             whitespace: str = "compact") -> xgr.Grammar:
    """Either calls (nothing else), or an answer of `answer`'s grammar."""
    return xgr.Grammar.union(calls_only(calls, parallel=parallel, whitespace=whitespace), answer)


def after_thinking(answer: xgr.Grammar, start: str, end: str, *, opened: bool) -> xgr.Grammar:
    """`answer` after a think block: one the prompt `opened` (the output begins inside it), or one the model
    may write first (``start`` ... ``end``) or leave out."""
    block = _structural({"type": "tag", "begin": "" if opened else start, "content": {"type": "any_text"},
                         "end": end})
    thought = xgr.Grammar.concat(block, xgr.Grammar.from_regex(THINK_GAP), answer)
    return thought if opened else xgr.Grammar.union(thought, answer)


def ebnf_of(grammar: xgr.Grammar) -> str:
    """The EBNF text that travels as the request's `ebnf` constraint."""
    return str(grammar)
