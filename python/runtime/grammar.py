"""Constrained decoding over xgrammar: compile cache, per-request matchers, batch bitmasks, jump-forward.

Constraint kinds (``SamplingParams.constraint`` gives ``(kind, text)``):
  regex        a regular expression the whole output must match
  json_schema  a JSON schema (string); see "JSON schemas" below
  ebnf         an EBNF grammar with a ``root`` rule (xgrammar's dialect)
  choices      a JSON list of strings; the output is exactly one of them

Use, in the scheduler process::

    backend = make_backend(cfg, tokenizer, vocab_size)   # or GrammarBackend(tokenizer, vocab_size, ...)
    handle = backend.submit(kind, text)          # never blocks; compiles in a thread pool (cached)
    state = backend.poll(handle)                 # each step: None (compiling) | ConstraintError | compiled
    matcher = backend.new_matcher(state)
    apply = backend.mask_fn(reqs)                # fills the bitmask rows of reqs[i].grammar (None: free)
    apply(logits)                                # (B, V_padded) in place: -inf where disallowed
    matcher.accept_token(token); matcher.is_terminated()  # terminated: finish with reason "stop"
    backend.jump_forward(matcher, tokenizer, req_ids)     # forced tokens to prefill, already accepted
The lower-level pieces (allocate_bitmask / fill_bitmask / apply_bitmask, handle.ready() / result()) are
public too.

In the front process, ``check_constraint(kind, text)`` validates without a tokenizer (milliseconds) so a
bad regex / schema / grammar raises ValueError before anything is queued.

Stop tokens: the matcher allows the stop tokens (``stop_token_ids``, e.g. ``<|im_end|>``, ``<|endoftext|>``)
only where the grammar may end; accepting one terminates the matcher. Special tokens (``<|im_start|>``,
``<repo_name>``, ...) are never allowed inside constrained output: their text would vanish on detokenization.
Ids in [vocab_size, logits width) -- a model's padded vocabulary -- are never allowed either.

Compile time limit: a compile that has not finished ``compile_timeout_s`` after its ``submit`` fails that
request alone (``result()`` raises). xgrammar cannot be interrupted, so the compile keeps its pool thread
until done and its result still lands in the cache for later requests. xgrammar releases the GIL while
compiling (a Python thread keeps running beside a compile), so compiles do not stall the scheduler loop.

JSON schemas: compiled in xgrammar's strict mode (no properties or items beyond the schema: the output
still validates). xgrammar enforces type, properties, required, additionalProperties, minProperties,
maxProperties, propertyNames, unevaluatedProperties, items, prefixItems, minItems, maxItems,
unevaluatedItems, enum, const, local $ref ($defs / definitions, recursion), anyOf, oneOf (as anyOf),
allOf with one subschema, pattern (anchored), minLength / maxLength, minimum / maximum / exclusive bounds,
multipleOf on integers, and the formats in ``ENFORCED_FORMATS`` ("date" and "date-time" are compiled from
our own exact patterns: xgrammar's accept 2023-02-30). It dispatches on the first of $ref, const,
enum, anyOf/oneOf, allOf, type and ignores sibling keywords; for strings format wins over pattern, and
pattern over lengths. ``unenforced_keywords`` walks a schema and names every validation keyword that this
leaves unenforced (uniqueItems, contains, not, if/then/else, patternProperties, dependentRequired,
multipleOf on numbers, unknown formats, overlapping oneOf branches, ...): an error when
``strict_json=True``, otherwise an ``UnenforcedSchemaWarning``. Keywords outside the validation
vocabulary (title, description, x-anything) have no effect on validity and are not reported.
Whitespace: "compact" emits ``{"a":1,"b":[2,3]}``; "flexible" allows whitespace between tokens but at
most ``max_whitespace`` characters in a row, so a model cannot loop on newlines.
"""

from __future__ import annotations

import json
import re
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError  # not the builtin before Python 3.11
from typing import Any, NamedTuple

import numpy as np
import torch
import xgrammar as xgr

CONSTRAINT_KINDS = ("regex", "json_schema", "ebnf", "choices")
JSON_WHITESPACE = ("compact", "flexible")
ENFORCED_FORMATS = frozenset({
    "date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
    "uri-template", "uuid", "json-pointer", "relative-json-pointer",
})


class ConstraintError(ValueError):
    """A constraint that cannot be compiled: invalid, unenforceable in strict mode, or too slow."""


class UnenforcedSchemaWarning(UserWarning):
    """A JSON-schema keyword the grammar does not enforce: outputs may violate it."""


class CompiledConstraint(NamedTuple):
    kind: str
    text: str
    grammar: xgr.CompiledGrammar
    unenforced: tuple[str, ...]  # "<json pointer>: <why>" for json_schema, else ()


class JumpForward(NamedTuple):
    text: str  # the forced text the tokens spell (a prefix of the grammar's forced continuation)
    token_ids: list[int]


class SchemaAnalysis(NamedTuple):
    schema: Any  # what xgrammar compiles: a copy with "date" / "date-time" formats made exact
    unenforced: list[str]  # "<json pointer>: <why>"


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    entries: int


# ---------------------------------------------------------------- validation (no tokenizer needed)

_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")


def _clean(e: BaseException) -> str:
    """xgrammar's C++ errors carry a time stamp and source location; keep the message."""
    return _XGR_PREFIX.sub("", str(e).strip())


def choices_to_ebnf(choices_json: str) -> str:
    """A JSON list of strings -> ``root ::= "a" | "b"``; json.dumps escapes quotes, backslashes and
    control characters the same way xgrammar's EBNF string literals read them."""
    try:
        choices = json.loads(choices_json)
    except ValueError as e:
        raise ConstraintError(f"choices: not a JSON list of strings: {e}") from e
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ConstraintError(f"choices: must be a non-empty list of non-empty strings, got {choices_json}")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))


def _parse_schema(text: str) -> Any:
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ConstraintError(f"json_schema: not valid JSON: {e}") from e
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"json_schema: must be a JSON object or boolean, got {type(schema).__name__}")
    return schema


def _report(kind: str, unenforced: list[str], strict_json: bool) -> None:
    if not unenforced:
        return
    listing = "; ".join(unenforced)
    if strict_json:
        raise ConstraintError(f"{kind}: keywords the grammar cannot enforce (strict_json=True): {listing}")
    warnings.warn(f"{kind}: not enforced, outputs may violate: {listing}", UnenforcedSchemaWarning,
                  stacklevel=3)


def check_constraint(kind: str, text: str, *, strict_json: bool = False) -> None:
    """Cheap front-process check: raises ConstraintError (a ValueError) naming the problem; warns with
    UnenforcedSchemaWarning for unenforced schema keywords when not strict."""
    if kind not in CONSTRAINT_KINDS:
        raise ConstraintError(f"constraint kind must be one of {CONSTRAINT_KINDS}, got {kind!r}")
    try:
        if kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(text)
        elif kind == "choices":
            xgr.Grammar.from_ebnf(choices_to_ebnf(text))
        else:
            analysis = analyze_schema(_parse_schema(text))
            _report(kind, analysis.unenforced, strict_json)
            xgr.Grammar.from_json_schema(json.dumps(analysis.schema))
    except ConstraintError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for every parse error
        raise ConstraintError(f"{kind}: {_describe(kind)}: {_clean(e)}") from e


def _describe(kind: str) -> str:
    return {"regex": "invalid regular expression", "ebnf": "invalid EBNF grammar",
            "choices": "cannot build the choices grammar", "json_schema": "invalid JSON schema"}[kind]


# ---------------------------------------------------------------- the JSON-schema walker

# xgrammar's own "date" / "date-time" accept 2023-02-30; these patterns check the day against the month
# and leap years (year 0001-9999: Python and jsonschema reject year 0).
_YEAR = r"(?:[1-9]\d{3}|0[1-9]\d{2}|00[1-9]\d|000[1-9])"
_LEAP_YEAR = r"(?:\d\d(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (rf"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)"
         rf"|02-(?:0[1-9]|1\d|2[0-8]))|{_LEAP_YEAR}-02-29)")
_TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,6})?(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
FORMAT_PATTERNS = {"date": _DATE, "date-time": f"{_DATE}T{_TIME}"}


def _rewrite_optional_groups(pattern: str) -> str:
    """`(X)?` -> `(X|)`, same language. Works around xgrammar 0.2.9, whose JSON-schema patterns lose the
    head of an optional group holding a repetition: `^a(?:b1+)?$` accepts "a1"."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            j += pattern[j:j + 1] == "]"  # a "]" first in a class is literal
            out.append(pattern[i:j])
            i = j
            continue
        elif c == ")" and pattern[i + 1:i + 2] == "?":
            out.append("|)")
            i += 3 if pattern[i + 2:i + 3] == "?" else 2  # a lazy `??` matches the same strings
            continue
        out.append(c)
        i += 1
    return "".join(out)


# xgrammar 0.2.9 writes length-bounded strings as repetitions of [^"\\\r\n], which lets raw control
# characters (tab, \x01, ...) into the JSON; JSON forbids them. Its own unbounded strings exclude \0-\x1f.
_BOUNDED_CHARS = re.compile(r'^(\S+_characters ::= \(\()\[\^\\"\\\\\\r\\n\](\)\))$', re.M)


def _fix_bounded_strings(ebnf: str) -> str:
    return _BOUNDED_CHARS.sub(lambda m: m.group(1) + r'[^\0-\x1f\"\\\r\n]' + m.group(2), ebnf)

_NEVER_ENFORCED = {
    "uniqueItems": "uniqueItems is not enforced",
    "contains": "contains is not enforced",
    "minContains": "minContains is not enforced",
    "maxContains": "maxContains is not enforced",
    "dependentRequired": "dependentRequired is not enforced",
    "dependentSchemas": "dependentSchemas is not enforced",
    "dependencies": "dependencies is not enforced",
    "if": "if/then/else is not enforced",
    "not": "not is not enforced",
    "patternProperties": "patternProperties is not supported (its keys are rejected)",
    "contentEncoding": "contentEncoding is not enforced",
    "contentMediaType": "contentMediaType is not enforced",
    "contentSchema": "contentSchema is not enforced",
    "$dynamicRef": "$dynamicRef is not supported",
    "$recursiveRef": "$recursiveRef is not supported",
    "nullable": "nullable (OpenAPI) lets the grammar emit null, which JSON Schema validators reject",
}
_STRING_KW = ("format", "pattern", "minLength", "maxLength")
_NUMBER_KW = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_ARRAY_KW = ("items", "prefixItems", "minItems", "maxItems", "unevaluatedItems")
_OBJECT_KW = ("properties", "required", "additionalProperties", "minProperties", "maxProperties",
              "propertyNames", "unevaluatedProperties")
_COMBINATORS = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
# Every keyword that affects validity (other keys are annotations or unknown: no effect on validation).
_VALIDATION_KW = frozenset(
    ("type", "then", "else", *_NEVER_ENFORCED, *_STRING_KW, *_NUMBER_KW, *_ARRAY_KW, *_OBJECT_KW,
     *_COMBINATORS, "additionalItems")
)


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _types_overlap(a: set[str], b: set[str]) -> bool:
    widen = lambda s: s | ({"integer"} if "number" in s else set())
    return bool(widen(a) & widen(b))


class _SchemaWalker:
    """Follows local $refs from the root; collects "<pointer>: <why>" for unenforced keywords and raises
    ConstraintError for forms xgrammar rejects (with a clearer message than its own). Works on a copy of
    the schema, in which it replaces the formats of FORMAT_PATTERNS by their exact patterns."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.found: list[str] = []
        self.visited: set[str] = set()

    def resolve(self, ref: str, path: str) -> Any:
        if ref != "#" and not ref.startswith("#/"):
            raise ConstraintError(f"json_schema: {path}/$ref: {ref!r} is not supported "
                                  f"(local references are '#' or '#/<json pointer>')")
        node = self.root
        for raw in ref.split("/")[1:]:
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise ConstraintError(f"json_schema: {path}/$ref: {ref!r} does not resolve")
        return node

    def possible_types(self, node: Any, depth: int = 0) -> set[str] | None:
        """The JSON types `node` can produce under xgrammar's dispatch; None: any."""
        if not isinstance(node, dict) or depth > 16:
            return None
        ref = node.get("$ref")
        if isinstance(ref, str):
            return self.possible_types(self.resolve(ref, ""), depth + 1) if ref.startswith("#") else None
        if "const" in node:
            return {_json_type(node["const"])}
        if isinstance(node.get("enum"), list):
            return {_json_type(v) for v in node["enum"]}
        for comb in ("anyOf", "oneOf"):
            if isinstance(node.get(comb), list):
                branches = [self.possible_types(b, depth + 1) for b in node[comb]]
                return None if any(b is None for b in branches) else set().union(*branches)
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1:
            return self.possible_types(node["allOf"][0], depth + 1)
        t = node.get("type")
        if isinstance(t, str):
            return {t}
        if isinstance(t, list):
            return set(t)
        if any(k in node for k in _OBJECT_KW):
            return {"object"}
        if any(k in node for k in _ARRAY_KW):
            return {"array"}
        return None

    def note(self, path: str, why: str) -> None:
        self.found.append(f"{path or '/'}: {why}")

    def walk(self, node: Any, path: str) -> None:
        if isinstance(node, bool):
            return
        if not isinstance(node, dict):
            raise ConstraintError(f"json_schema: {path or '/'}: a schema must be an object or a boolean, "
                                  f"got {type(node).__name__}")
        keys = [k for k in node if k in _VALIDATION_KW]
        for k in keys:
            if k in _NEVER_ENFORCED:
                self.note(path, _NEVER_ENFORCED[k])
        for k in ("exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(node.get(k), bool):
                raise ConstraintError(f"json_schema: {path}/{k}: boolean form (draft 4) is not supported; "
                                      f"give the bound as a number")
        if isinstance(node.get("items"), list) or "additionalItems" in node:
            raise ConstraintError(f"json_schema: {path or '/'}: array-form items / additionalItems "
                                  f"(draft 4) are not supported; use prefixItems and items")
        head = next((k for k in _COMBINATORS if k in node), None)
        if head is not None:
            self.walk_combinator(node, head, keys, path)
        else:
            self.walk_typed(node, keys, path)

    def ignored_siblings(self, node: dict, head: str, keys: list[str], path: str) -> None:
        """xgrammar honours only `head`; a sibling "type" is harmless when `head` cannot leave it."""
        own = self.possible_types({head: node[head]})
        for k in keys:
            if k == head or k in _NEVER_ENFORCED or k in ("then", "else"):
                continue
            if k == "type":
                t = node["type"]
                declared = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()
                if own is not None and all(_types_overlap({o}, declared) for o in own):
                    continue
            self.note(path, f"{k} is ignored beside {head}")

    def walk_combinator(self, node: dict, head: str, keys: list[str], path: str) -> None:
        self.ignored_siblings(node, head, keys, path)
        if head == "$ref":
            ref = node["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#"):
                self.note(path, f"$ref {ref!r} is not local: it is not resolved and any value passes")
                return
            target = self.resolve(ref, path)
            if ref not in self.visited:
                self.visited.add(ref)
                self.walk(target, ref[1:])
        elif head in ("anyOf", "oneOf"):
            branches = node[head]
            if not isinstance(branches, list) or not branches:
                raise ConstraintError(f"json_schema: {path}/{head}: must be a non-empty list")
            for i, b in enumerate(branches):
                self.walk(b, f"{path}/{head}/{i}")
            if head == "oneOf" and not self.disjoint(branches):
                self.note(path, "oneOf branches may overlap: exclusivity is not enforced (treated as anyOf)")
        elif head == "allOf":
            subs = node["allOf"]
            if isinstance(subs, list) and len(subs) == 1:
                self.walk(subs[0], f"{path}/allOf/0")
            else:
                self.note(path, "allOf with several subschemas is not enforced (merge them into one)")
        elif head == "enum" and (not isinstance(node["enum"], list) or not node["enum"]):
            raise ConstraintError(f"json_schema: {path}/enum: must be a non-empty list")

    def disjoint(self, branches: list) -> bool:
        types = [self.possible_types(b) for b in branches]
        if all(t is not None for t in types) and all(
            not _types_overlap(types[i], types[j]) for i in range(len(types)) for j in range(i)
        ):
            return True
        return self.has_discriminator(branches)

    def has_discriminator(self, branches: list) -> bool:
        """Objects told apart by a required property whose const/enum values never coincide."""
        objs = []
        for b in branches:
            while isinstance(b, dict) and isinstance(b.get("$ref"), str) and b["$ref"].startswith("#"):
                b = self.resolve(b["$ref"], "")
            if not isinstance(b, dict) or not isinstance(b.get("properties"), dict):
                return False
            objs.append(b)
        for name in objs[0]["properties"]:
            values = []
            for b in objs:
                p = b["properties"].get(name)
                if name not in b.get("required", []) or not isinstance(p, dict):
                    break
                vals = [p["const"]] if "const" in p else p.get("enum")
                if not isinstance(vals, list):
                    break
                values.append({json.dumps(v, sort_keys=True) for v in vals})
            else:
                if all(not (values[i] & values[j]) for i in range(len(values)) for j in range(i)):
                    return True
        return False

    def walk_typed(self, node: dict, keys: list[str], path: str) -> None:
        types = self.possible_types(node)
        if types is None:
            for k in keys:
                if k in _STRING_KW or k in _NUMBER_KW:
                    self.note(path, f"{k} is not enforced without a \"type\"")
            return
        if "string" in types:
            self.check_string(node, path)
        if "number" in types and "multipleOf" in node:
            self.note(path, "multipleOf is not enforced on numbers (only on integers with an integer step)")
        elif "integer" in types and "multipleOf" in node and not _is_int(node["multipleOf"]):
            self.note(path, "multipleOf with a fractional step is not enforced")
        if "object" in types:
            self.walk_object(node, path)
        if "array" in types:
            if isinstance(node.get("items"), dict):
                self.walk(node["items"], f"{path}/items")
            for i, b in enumerate(node.get("prefixItems") or []):
                self.walk(b, f"{path}/prefixItems/{i}")
            if isinstance(node.get("unevaluatedItems"), dict):
                self.walk(node["unevaluatedItems"], f"{path}/unevaluatedItems")

    def check_string(self, node: dict, path: str) -> None:
        if "format" in node:
            fmt = node["format"]
            if fmt not in ENFORCED_FORMATS:
                self.note(path, f"format {fmt!r} is not enforced")
            shadowed = [k for k in ("pattern", "minLength", "maxLength") if k in node]
            if shadowed:
                self.note(path, f"{', '.join(shadowed)} ignored beside format")
            if fmt in FORMAT_PATTERNS:  # the walker owns this copy: rewrite in place
                del node["format"]
                node["pattern"] = FORMAT_PATTERNS[fmt]
        elif "pattern" in node:
            shadowed = [k for k in ("minLength", "maxLength") if k in node]
            if shadowed:
                self.note(path, f"{', '.join(shadowed)} ignored beside pattern (bound the length in it)")
        if isinstance(node.get("pattern"), str):
            node["pattern"] = _rewrite_optional_groups(node["pattern"])

    def walk_object(self, node: dict, path: str) -> None:
        props = node.get("properties") or {}
        if not isinstance(props, dict):
            raise ConstraintError(f"json_schema: {path}/properties: must be an object")
        for name, sub in props.items():
            self.walk(sub, f"{path}/properties/{name}")
        for name in node.get("required") or []:
            if name not in props:
                self.note(path, f"required property {name!r} is not declared in properties: "
                                "it is never generated")
        names = node.get("propertyNames")
        if isinstance(names, dict) and "type" not in names and not any(k in names for k in _COMBINATORS):
            names["type"] = "string"  # implied: a property name is a string
        for k in ("additionalProperties", "propertyNames", "unevaluatedProperties"):
            if isinstance(node.get(k), dict):
                self.walk(node[k], f"{path}/{k}")


def _is_int(x: Any) -> bool:
    return (isinstance(x, int) and not isinstance(x, bool)) or (isinstance(x, float) and x.is_integer())


def analyze_schema(schema: Any) -> SchemaAnalysis:
    """The schema to compile and "<json pointer>: <why>" for every validation keyword the grammar does not
    enforce (reachable from the root, following local $refs). Raises ConstraintError for unsupported
    forms. `schema` itself is not modified."""
    copy = json.loads(json.dumps(schema))
    walker = _SchemaWalker(copy)
    walker.walk(copy, "")
    return SchemaAnalysis(copy, list(dict.fromkeys(walker.found)))


def unenforced_keywords(schema: Any) -> list[str]:
    return analyze_schema(schema).unenforced


# ---------------------------------------------------------------- compile handles


class _Outcome(NamedTuple):
    constraint: CompiledConstraint | None
    error: str | None
    finished_at: float  # time.monotonic() when the compile ended


class CompileHandle:
    """One request's view of a (possibly shared) compile. Poll `ready()`; then `result()`."""

    def __init__(self, key: tuple[str, str], future: Future, timeout_s: float) -> None:
        self.key = key
        self._future = future
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s

    def ready(self) -> bool:
        return self._future.done() or time.monotonic() > self._deadline

    def result(self) -> CompiledConstraint:
        """Raises ConstraintError when the constraint is invalid or its compile overran the limit;
        RuntimeError when called before ready()."""
        if not self._future.done():
            if time.monotonic() <= self._deadline:
                raise RuntimeError("grammar compile not finished: poll ready() first")
            raise self._timeout_error()
        outcome: _Outcome = self._future.result()
        if outcome.finished_at > self._deadline:  # decided by when it finished, not when we polled
            raise self._timeout_error()
        if outcome.error is not None:
            raise ConstraintError(outcome.error)
        return outcome.constraint

    def wait(self) -> CompiledConstraint:
        """Blocking: wait until the compile ends or its time limit passes, then result()."""
        try:
            self._future.result(timeout=max(0.0, self._deadline - time.monotonic()))
        except FutureTimeoutError:
            pass
        return self.result()

    def _timeout_error(self) -> ConstraintError:
        return ConstraintError(f"{self.key[0]}: grammar compile exceeded the time limit "
                               f"(compile_timeout_s={self._timeout_s})")


# ---------------------------------------------------------------- the backend


def _memory_bytes(future: Future) -> int:
    if not future.done():
        return 0
    constraint = future.result().constraint
    return 0 if constraint is None else constraint.grammar.memory_size_bytes


class GrammarBackend:
    """Owns the tokenizer info, the compiler, the compile pool and the (kind, text) -> compile cache."""

    def __init__(self, tokenizer, vocab_size: int, *, stop_token_ids: Sequence[int] | None = None,
                 num_threads: int = 2, compile_timeout_s: float = 30.0, strict_json: bool = False,
                 json_whitespace: str = "compact", max_whitespace: int = 8, cache_limit_mb: float = 256) -> None:
        if json_whitespace not in JSON_WHITESPACE:
            raise ValueError(f"json_whitespace must be one of {JSON_WHITESPACE}, got {json_whitespace!r}")
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if compile_timeout_s <= 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {compile_timeout_s}")
        if max_whitespace < 1:
            raise ValueError(f"max_whitespace must be >= 1, got {max_whitespace}")
        if cache_limit_mb <= 0:
            raise ValueError(f"cache_limit_mb must be > 0, got {cache_limit_mb}")
        if stop_token_ids is None:
            stop_token_ids = default_stop_token_ids(tokenizer)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.strict_json = strict_json
        self.json_whitespace = json_whitespace
        self.max_whitespace = max_whitespace
        self.cache_limit_bytes = int(cache_limit_mb * 2**20)
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, self.stop_token_ids)
        # Our own cache (of futures) so in-flight compiles are shared and hits are countable.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=num_threads,
                                             cache_enabled=False)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")
        self._batch = xgr.BatchGrammarMatcher(max_threads=num_threads)
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = 0
        self._bitmask: torch.Tensor | None = None  # mask_fn's buffer, grown on demand

    # -- compile

    def submit(self, kind: str, text: str) -> CompileHandle:
        """Start (or share) the compile of (kind, text); never raises for a bad constraint: the
        handle's result() does."""
        key = (kind, text)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._hits += 1
                self._cache.move_to_end(key)
            else:
                self._misses += 1
                fut = self._pool.submit(self._compile, kind, text)
                self._cache[key] = fut
                self._evict()
        return CompileHandle(key, fut, self.compile_timeout_s)

    def compile(self, kind: str, text: str) -> CompiledConstraint:
        """Blocking convenience (tests, tools): submit and wait."""
        return self.submit(kind, text).wait()

    def poll(self, handle: CompileHandle) -> CompiledConstraint | ConstraintError | None:
        """Non-blocking: None while compiling, the error when the constraint failed, else the grammar."""
        if not handle.ready():
            return None
        try:
            return handle.result()
        except ConstraintError as e:
            return e

    def _evict(self) -> None:
        """Least recently used finished compiles go until the compiled grammars fit the byte limit (a JSON
        schema takes ~0.5 MB for a 49k vocabulary, a long bounded regex several MB)."""
        sizes = {k: _memory_bytes(f) for k, f in self._cache.items()}
        total = sum(sizes.values())
        for key in list(self._cache):
            if total <= self.cache_limit_bytes:
                return
            if self._cache[key].done():
                total -= sizes[key]
                del self._cache[key]

    @property
    def cache_info(self) -> CacheInfo:
        return CacheInfo(self._hits, self._misses, len(self._cache))

    def _compile(self, kind: str, text: str) -> _Outcome:
        try:
            constraint = self._compile_now(kind, text)
            return _Outcome(constraint, None, time.monotonic())
        except ConstraintError as e:
            return _Outcome(None, str(e), time.monotonic())
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for every input error
            return _Outcome(None, f"{kind}: {_describe(kind)}: {_clean(e)}", time.monotonic())

    def _compile_now(self, kind: str, text: str) -> CompiledConstraint:
        if kind == "regex":
            return CompiledConstraint(kind, text, self._compiler.compile_regex(text), ())
        if kind == "ebnf":
            return CompiledConstraint(kind, text, self._compiler.compile_grammar(text), ())
        if kind == "choices":
            return CompiledConstraint(kind, text, self._compiler.compile_grammar(choices_to_ebnf(text)), ())
        if kind == "json_schema":
            analysis = analyze_schema(_parse_schema(text))
            _report(kind, analysis.unenforced, self.strict_json)
            if self.json_whitespace == "compact":
                ws = dict(any_whitespace=False, separators=(",", ":"))
            else:
                ws = dict(any_whitespace=True, max_whitespace_cnt=self.max_whitespace)
            ebnf = str(xgr.Grammar.from_json_schema(json.dumps(analysis.schema), strict_mode=True, **ws))
            grammar = self._compiler.compile_grammar(_fix_bounded_strings(ebnf))
            return CompiledConstraint(kind, text, grammar, tuple(analysis.unenforced))
        raise ConstraintError(f"constraint kind must be one of {CONSTRAINT_KINDS}, got {kind!r}")

    # -- matchers and the batch bitmask

    def new_matcher(self, compiled: CompiledConstraint) -> Matcher:
        return Matcher(compiled)

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(batch_size, self.vocab_size)  # (B, ceil(V/32)) int32, CPU

    def mask_fn(self, reqs: Sequence) -> Callable[[torch.Tensor], None] | None:
        """For one sampling step over `reqs` (objects with a `.grammar`: Matcher or None), row i of the
        logits being reqs[i]: fills the bitmask now and returns the in-place masking of the logits
        (None when no row is constrained)."""
        matchers = [r.grammar for r in reqs]
        if all(m is None for m in matchers):
            return None
        if self._bitmask is None or self._bitmask.shape[0] < len(reqs):
            self._bitmask = self.allocate_bitmask(max(len(reqs), 32))
        bitmask = self._bitmask[:len(reqs)]  # reused across steps: no allocation per step
        rows = self.fill_bitmask(bitmask, matchers)
        if not rows:
            return None
        return lambda logits: self.apply_bitmask(logits, bitmask, rows)

    def fill_bitmask(self, bitmask: torch.Tensor, matchers: Sequence[Matcher | None]) -> list[int]:
        """Fill row i for each live matcher i (None: an unconstrained row, left as is); returns those rows."""
        rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        if rows:
            # One C++ call over a thread pool instead of a Python loop of fills.
            self._batch.batch_fill_next_token_bitmask([matchers[i]._m for i in rows], bitmask, rows)
        return rows

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """In place on logits (B, V_padded): in `rows`, disallowed ids and ids >= vocab_size get -inf;
        other rows are untouched."""
        if logits.dim() != 2 or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits: expected (B, >= {self.vocab_size}), got {tuple(logits.shape)}")
        if not rows:
            return
        mask = bitmask if bitmask.device == logits.device else bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=list(rows))
        if logits.shape[1] > self.vocab_size:
            idx = torch.tensor(list(rows), device=logits.device)
            logits[idx, self.vocab_size:] = float("-inf")  # padded ids: no token behind them

    def jump_forward(self, matcher: Matcher, tokenizer, prev_ids: Sequence[int] = ()) -> list[int]:
        return jump_forward(matcher, tokenizer, prev_ids)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_END_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "</s>")


def default_stop_token_ids(tokenizer) -> list[int]:
    """The tokenizer's eos plus its special tokens that end a text (SmolLM2: <|im_end|> 2,
    <|endoftext|> 0)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if tok.special and tok.content in _END_TOKENS:
            ids.add(i)
    if not ids:
        raise ValueError("stop_token_ids: the tokenizer has no eos token; pass the model's stop ids")
    return sorted(ids)


def make_backend(cfg, tokenizer, vocab_size: int,
                 stop_token_ids: Sequence[int] | None = None) -> GrammarBackend:
    """The backend a RuntimeConfig asks for (its grammar_* fields)."""
    return GrammarBackend(tokenizer, vocab_size, stop_token_ids=stop_token_ids,
                          compile_timeout_s=cfg.grammar_compile_timeout_s,
                          strict_json=cfg.grammar_strict_json, json_whitespace=cfg.grammar_json_whitespace)


def build_tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, with special tokens other than the stop tokens blanked (an
    empty token is never allowed): their text would be dropped by the detokenizer."""
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's vocabulary "
                         f"(max id {max(vocab.values())})")
    bad_stop = [t for t in stop_token_ids if not 0 <= t < vocab_size]
    if bad_stop:
        raise ValueError(f"stop_token_ids: {bad_stop} outside [0, {vocab_size})")
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                   stop_token_ids=list(stop_token_ids))
    encoded = [""] * vocab_size
    for token, idx in vocab.items():
        encoded[idx] = token
    special = set(getattr(tokenizer, "all_special_ids", []))
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    for i in special - set(stop_token_ids):
        if 0 <= i < vocab_size:
            encoded[i] = ""
    return xgr.TokenizerInfo(encoded, vocab_type=detected.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids), add_prefix_space=detected.add_prefix_space)


def allowed_token_ids(bitmask_row: torch.Tensor, vocab_size: int) -> np.ndarray:
    """Ids allowed by one filled bitmask row (W,) int32 on CPU: for tests and debugging."""
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab_size]  # (32 * W,)
    return np.flatnonzero(bits)


# ---------------------------------------------------------------- the per-request matcher

_TAIL_TOKENS = 4  # previous tokens re-tokenized with the forced text, enough context for pre-tokenizers


class Matcher:
    """One request's grammar state. Not thread-safe: the scheduler thread owns it."""

    __slots__ = ("constraint", "_m", "num_accepted")

    def __init__(self, compiled: CompiledConstraint) -> None:
        self.constraint = compiled
        self._m = xgr.GrammarMatcher(compiled.grammar)
        self.num_accepted = 0  # tokens accepted since creation / reset, the stop token included

    def accept_token(self, token_id: int) -> bool:
        """False (state unchanged) when the grammar does not allow `token_id` here."""
        if self._m.is_terminated():
            return False
        ok = self._m.accept_token(token_id)
        self.num_accepted += ok
        return ok

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """All or nothing: on the first refusal the ones already accepted are rolled back."""
        for n, t in enumerate(token_ids):
            if not self.accept_token(t):
                self.rollback(n)
                return False
        return True

    def is_terminated(self) -> bool:
        """A stop token was accepted: the request finishes with reason "stop"."""
        return self._m.is_terminated()

    def is_completed(self) -> bool:
        """The text so far is a complete match (a stop token would be accepted now)."""
        return self._m.is_completed()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"rollback: num_tokens must be in [0, {self.num_accepted}], got {num_tokens}")
        if num_tokens:
            self._m.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def reset_to(self, token_ids: Sequence[int]) -> bool:
        """Restart from the grammar's beginning and replay `token_ids` (e.g. a retracted request's
        output). False, leaving the matcher reset, when the replay is refused."""
        self._m.reset()
        self.num_accepted = 0
        return self.accept_tokens(token_ids)

    def find_jump_forward(self, tokenizer, prev_ids: Sequence[int] = ()) -> JumpForward:
        """Tokens for the text the grammar forces next, in the tokenizer's own segmentation, without
        accepting them. The forced text is re-tokenized after the last few tokens of `prev_ids` (the
        request's tokens so far); when the natural segmentation merges old text with forced text the
        model emits that token itself (no jump). The last forced token is left to the model too, so it
        can merge with what follows (e.g. `":"` + the value's opening quote)."""
        forced = self._m.find_jump_forward_string()
        if not forced or not getattr(tokenizer, "is_fast", False):
            return JumpForward("", [])
        tail_ids = list(prev_ids[-_TAIL_TOKENS:])
        tail = tokenizer.decode(tail_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) \
            if tail_ids else ""
        text = tail + forced
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        start = len(tail)
        first = next((i for i, (_, e) in enumerate(offsets) if e > start), len(ids))
        if first == len(ids) or offsets[first][0] != start:
            return JumpForward("", [])  # [start, end) of the first forced token: must begin at the boundary
        body = ids[first:-1]  # [first, last): the last token may merge with the next generated text
        if not body:
            return JumpForward("", [])
        return JumpForward(text[start:offsets[first + len(body) - 1][1]], body)


def jump_forward(matcher: Matcher, tokenizer, prev_ids: Sequence[int] = ()) -> list[int]:
    """The scheduler's jump-forward step: the forced tokens, already accepted by `matcher` (empty when
    nothing is forced or the grammar refuses the tokenization). Prefill them instead of decoding."""
    jf = matcher.find_jump_forward(tokenizer, prev_ids)
    if jf.token_ids and matcher.accept_tokens(jf.token_ids):
        return jf.token_ids
    return []
