"""JSON-schema analysis, without a tokenizer: which validation keywords the grammar enforces, which it leaves
unenforced ("<json pointer>: <why>"), which forms are refused, and the copy of the schema that is compiled
("date" / "date-time" formats replaced by exact patterns, optional groups of patterns rewritten)."""

from __future__ import annotations

import json
import warnings
from typing import Any, NamedTuple

from radixgen.common.nesting import MAX_SCHEMA_DEPTH, NestingError, check_text_depth, check_value_depth

ENFORCED_FORMATS = frozenset({
    "date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
    "uri-template", "uuid", "json-pointer", "relative-json-pointer",
})


class ConstraintError(ValueError):
    """A constraint that cannot be compiled: invalid, unenforceable in strict mode, or too slow."""


class UnenforcedSchemaWarning(UserWarning):
    """A JSON-schema keyword the grammar does not enforce: outputs may violate it."""


class SchemaAnalysis(NamedTuple):
    schema: Any  # what xgrammar compiles: a copy with "date" / "date-time" formats made exact
    unenforced: list[str]  # "<json pointer>: <why>"


def parse_schema(text: str) -> Any:
    try:
        check_text_depth(text, "json_schema")
        schema = json.loads(text)
    except NestingError as e:
        raise ConstraintError(str(e)) from None
    except ValueError as e:
        raise ConstraintError(f"json_schema: not valid JSON: {e}") from e
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"json_schema: must be a JSON object or boolean, got {type(schema).__name__}")
    return schema


def report_unenforced(kind: str, unenforced: list[str], strict_json: bool) -> None:
    """An error naming them when `strict_json`, else an UnenforcedSchemaWarning."""
    if not unenforced:
        return
    listing = "; ".join(unenforced)
    if strict_json:
        raise ConstraintError(f"{kind}: keywords the grammar cannot enforce (strict_json=True): {listing}")
    warnings.warn(f"{kind}: not enforced, outputs may violate: {listing}", UnenforcedSchemaWarning,
                  stacklevel=3)


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
        self.depth = 0  # schemas being walked, one inside the other (a chain of $refs counts too)

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
            return {x for x in t if isinstance(x, str)}  # other members are refused when the node is walked
        if any(k in node for k in _OBJECT_KW):
            return {"object"}
        if any(k in node for k in _ARRAY_KW):
            return {"array"}
        return None

    def note(self, path: str, why: str) -> None:
        self.found.append(f"{path or '/'}: {why}")

    def walk(self, node: Any, path: str) -> None:
        if self.depth >= MAX_SCHEMA_DEPTH:
            raise ConstraintError(f"json_schema: {path or '/'}: subschemas (and $refs) nested deeper than the "
                                  f"limit of {MAX_SCHEMA_DEPTH} levels")
        self.depth += 1
        self.walk_node(node, path)  # a ConstraintError ends the whole walk: no need to unwind the count
        self.depth -= 1

    def walk_node(self, node: Any, path: str) -> None:
        if isinstance(node, bool):
            return
        if not isinstance(node, dict):
            raise ConstraintError(f"json_schema: {path or '/'}: a schema must be an object or a boolean, "
                                  f"got {type(node).__name__}")
        _check_shapes(node, path)
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
            for _ in range(MAX_SCHEMA_DEPTH):  # a $ref to a $ref...; a cycle of them ends here
                if not (isinstance(b, dict) and isinstance(b.get("$ref"), str) and b["$ref"].startswith("#")):
                    break
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


def _check_shapes(node: dict, path: str) -> None:
    """A ConstraintError for a keyword whose value has the wrong JSON type (the walk relies on them)."""
    t = node.get("type")
    if "type" in node and not (isinstance(t, str) or (isinstance(t, list) and all(isinstance(x, str) for x in t))):
        raise ConstraintError(f"json_schema: {path}/type: must be a type name or a list of them")
    req = node.get("required")
    if "required" in node and not (isinstance(req, list) and all(isinstance(x, str) for x in req)):
        raise ConstraintError(f"json_schema: {path}/required: must be a list of property names")
    if "prefixItems" in node and not isinstance(node["prefixItems"], list):
        raise ConstraintError(f"json_schema: {path}/prefixItems: must be a list of schemas")


def _is_int(x: Any) -> bool:
    return (isinstance(x, int) and not isinstance(x, bool)) or (isinstance(x, float) and x.is_integer())


def analyze_schema(schema: Any) -> SchemaAnalysis:
    """The schema to compile and "<json pointer>: <why>" for every validation keyword the grammar does not
    enforce (reachable from the root, following local $refs). Raises ConstraintError for unsupported
    forms. `schema` itself is not modified."""
    try:
        check_value_depth(schema, "json_schema")
    except NestingError as e:
        raise ConstraintError(str(e)) from None
    copy = json.loads(json.dumps(schema))
    walker = _SchemaWalker(copy)
    walker.walk(copy, "")
    return SchemaAnalysis(copy, list(dict.fromkeys(walker.found)))


def unenforced_keywords(schema: Any) -> list[str]:
    return analyze_schema(schema).unenforced

