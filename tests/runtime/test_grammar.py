"""Constrained decoding (radixgen.runtime.grammar) on the default model's real tokenizer.

Matchers are driven by seeded random walks over the tokens their bitmask allows, and the decoded text is
checked by an independent oracle (re.fullmatch, jsonschema, Python's parser)."""

from __future__ import annotations

import ast
import datetime
import json
import re
import threading
import time
import warnings
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest
import torch

from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.grammar import (
    ConstraintError,
    GrammarBackend,
    UnenforcedSchemaWarning,
    analyze_schema,
    check_constraint,
    jump_forward,
    make_backend,
    unenforced_keywords,
)

VOCAB = 49152
PADDED = VOCAB + 64
EOS_IDS = [2, 0]  # <|im_end|>, <|endoftext|>
SPECIAL_NON_STOP = [1, *range(3, 17)]  # <|im_start|>, <repo_name>, ... <empty_output>


def wait(handle):
    """Poll a compile handle until it is ready (compiled, failed, or past its time limit), then its result."""
    while not handle.ready():
        time.sleep(0.002)
    return handle.result()


def compile_now(backend, kind, text):
    return wait(backend.submit(kind, text))


def allowed_token_ids(bitmask_row: torch.Tensor, vocab_size: int) -> np.ndarray:
    """Ids allowed by one filled bitmask row (W,) int32: bit b of word w allows id 32 * w + b."""
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab_size]  # (32 * W,)
    return np.flatnonzero(bits)


def completes(backend, matcher) -> bool:
    """The text so far is a complete match: the grammar allows a stop token now."""
    bitmask = backend.allocate_bitmask(1)
    if backend.fill_bitmask(bitmask, [matcher]) != [0]:
        return False
    return bool(set(backend.stop_token_ids) & set(allowed_token_ids(bitmask[0], VOCAB).tolist()))


@pytest.fixture(scope="module")
def tokenizer():
    from radixgen.runtime.loader import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def backend(tokenizer):
    be = GrammarBackend(tokenizer, VOCAB, stop_token_ids=EOS_IDS)
    yield be
    be.shutdown()


@pytest.fixture(scope="module")
def token_bytes(backend):
    return backend.tokenizer_info.decoded_vocab  # bytes of each id; b"" for the blanked special ones


@pytest.fixture(scope="module")
def closers(token_bytes):
    """Tokens that tend to end what is open: closing quotes/brackets, '@' (ends an email's local part),
    the stop tokens."""
    mask = np.zeros(VOCAB, dtype=bool)
    for i, b in enumerate(token_bytes):
        mask[i] = bool(b) and set(b) <= set(b'"}]@')
    mask[EOS_IDS] = True
    return mask


def walk(backend, matcher, closers, seed, max_steps=400, prefer=None):
    """Random valid walk: each step samples one allowed token (seeded); as steps go by it prefers tokens
    that close what is open, so the walk ends. `prefer` (a bool mask) biases it toward some tokens.
    Returns the accepted ids before the stop token."""
    rng = np.random.default_rng(seed)
    bitmask = backend.allocate_bitmask(1)
    out = []
    for step in range(max_steps):
        assert backend.fill_bitmask(bitmask, [matcher]) == [0]
        allowed = allowed_token_ids(bitmask[0], VOCAB)
        assert allowed.size > 0
        assert not np.isin(allowed, SPECIAL_NON_STOP).any()
        pool = allowed
        if prefer is not None and prefer[allowed].any() and rng.random() < 0.6:
            pool = allowed[prefer[allowed]]
        elif closers[allowed].any() and rng.random() < min(0.9, step / 30):
            pool = allowed[closers[allowed]]
        token = int(rng.choice(pool))
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            assert token in EOS_IDS
            return out
        assert token not in EOS_IDS
        out.append(token)
    raise AssertionError(f"walk did not terminate in {max_steps} steps")


def decode(token_bytes, ids):
    return b"".join(token_bytes[i] for i in ids).decode("utf-8")


def run_walks(backend, closers, token_bytes, tokenizer, kind, text, seeds):
    compiled = compile_now(backend, kind, text)
    texts = []
    for seed in seeds:
        ids = walk(backend, backend.new_matcher(compiled), closers, seed)
        out = decode(token_bytes, ids)
        assert tokenizer.decode(ids) == out  # the detokenizer sees the same text the grammar did
        texts.append(out)
    return texts


# ---------------------------------------------------------------- compile and cache


def test_compile_cache_hit(backend):
    schema = json.dumps({"type": "object", "properties": {"cache_probe": {"type": "integer"}}})
    before = backend.cache_info
    h1 = backend.submit("json_schema", schema)
    h2 = backend.submit("json_schema", schema)
    assert wait(h1) is wait(h2)
    after = backend.cache_info
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
    compile_now(backend, "regex", "cache_probe")  # another kind/text is a miss
    assert backend.cache_info.misses == after.misses + 1


def test_cache_evicts_least_recently_used(tokenizer, backend):
    schemas = [json.dumps({"type": "object", "properties": {f"evict_{i}": {"type": "string"}}}) for i in range(3)]
    sizes = [compile_now(backend, "json_schema", sch).grammar.memory_size_bytes for sch in schemas]
    small = GrammarBackend(tokenizer, VOCAB, stop_token_ids=EOS_IDS,
                           cache_limit_mb=0.9 * (sizes[0] + sizes[1]) / 2**20)
    try:
        for sch in schemas:
            compile_now(small, "json_schema", sch)  # the third submit finds the first two over the limit
        assert small.cache_info == (0, 3, 2)
        compile_now(small, "json_schema", schemas[0])  # evicted: compiled again
        assert small.cache_info.misses == 4
    finally:
        small.shutdown()


def test_handle_polls_without_blocking(tokenizer):
    be = GrammarBackend(tokenizer, VOCAB, stop_token_ids=EOS_IDS, num_threads=1)
    gate = threading.Event()
    try:
        be.compiles._pool.submit(gate.wait)  # occupy the only compile thread so the compile below cannot start
        handle = be.submit("ebnf", 'root ::= "x" [a-z]* "y"')
        assert not handle.ready()
        with pytest.raises(RuntimeError, match="poll ready"):
            handle.result()
        gate.set()
        assert wait(handle).kind == "ebnf" and handle.ready()
    finally:
        gate.set()
        be.shutdown()


def test_compile_timeout_fails_that_request(tokenizer, backend):
    heavy = json.dumps({
        "type": "object",
        "properties": {f"field_{i}": {"type": "string", "pattern": "[a-z]{2,30}@[a-z]{1,20}\\.(com|org)"}
                       for i in range(40)},
    })
    slow = GrammarBackend(tokenizer, VOCAB, stop_token_ids=EOS_IDS, compile_timeout_s=1e-6)
    try:
        handle = slow.submit("json_schema", heavy)
        with pytest.raises(ConstraintError, match="exceeded the time limit.*compile_timeout_s"):
            wait(handle)
    finally:
        slow.shutdown()
    assert compile_now(backend, "json_schema", heavy).kind == "json_schema"  # a normal limit compiles it


# ---------------------------------------------------------------- walks checked by oracles


@pytest.mark.parametrize("pattern", [
    r"\(\d{3}\) \d{3}-\d{4}",
    r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8}){0,2}",
    r"(cat|dog|bird)s? (eat|sleep)(ing)?",
    r"-?(0|[1-9]\d{0,5})(\.\d{1,3})?",
])
def test_regex_walks_fullmatch(backend, closers, token_bytes, tokenizer, pattern):
    for text in run_walks(backend, closers, token_bytes, tokenizer, "regex", pattern, range(4)):
        assert re.fullmatch(pattern, text), (pattern, text)


ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string", "minLength": 1, "maxLength": 40},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"enum": ["US", "FR", "DE"]},
    },
    "required": ["street", "zip", "country"],
    "additionalProperties": False,
}

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 2, "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "email": {"type": "string", "format": "email"},
            "nickname": {"type": "string", "maxLength": 10},
            "height_m": {"type": "number", "exclusiveMinimum": 0.3, "exclusiveMaximum": 2.6},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "order_with_refs": {
        "$defs": {
            "address": ADDRESS,
            "line": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    "unit_price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "qty"],
            },
        },
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "format": "uuid"},
            "placed_at": {"type": "string", "format": "date-time"},
            "ship_to": {"$ref": "#/$defs/address"},
            "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}, "minItems": 1, "maxItems": 3},
            "status": {"const": "open"},
        },
        "required": ["order_id", "placed_at", "ship_to", "lines", "status"],
    },
    "event_union": {
        "type": "object",
        "properties": {
            "date": {"type": "string", "format": "date"},
            "where": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 15}]},
            "tags": {"type": "array", "items": {"enum": ["work", "home", "travel"]}, "maxItems": 2},
            "payload": {"oneOf": [
                {"type": "object", "properties": {"kind": {"const": "call"}, "minutes": {"type": "integer"}},
                 "required": ["kind", "minutes"]},
                {"type": "object", "properties": {"kind": {"const": "note"}, "text": {"type": "string"}},
                 "required": ["kind", "text"]},
            ]},
        },
        "required": ["date", "where", "tags", "payload"],
    },
    "recursive_tree": {
        "$defs": {"node": {
            "type": "object",
            "properties": {
                "label": {"type": "string", "maxLength": 6},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            "required": ["label"],
        }},
        "$ref": "#/$defs/node",
    },
}


def _check_date_time(value: object) -> bool:
    return not isinstance(value, str) or bool(
        re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", value)
        and datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    )


FORMATS = jsonschema.FormatChecker()
FORMATS.checks("date-time", raises=ValueError)(_check_date_time)  # jsonschema needs an extra package for it


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_walks_validate(backend, closers, token_bytes, tokenizer, name):
    schema = SCHEMAS[name]
    assert unenforced_keywords(schema) == []
    texts = run_walks(backend, closers, token_bytes, tokenizer, "json_schema", json.dumps(schema), range(3))
    for text in texts:
        value = json.loads(text)
        jsonschema.validate(value, schema, format_checker=FORMATS)
        assert json.dumps(value, separators=(",", ":"), ensure_ascii=False) == text  # compact by default


ARITH = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [1-9] [0-9]* | "(" expr ")"
"""


def test_ebnf_walks_parse(backend, closers, token_bytes, tokenizer):
    compiled = compile_now(backend, "ebnf", ARITH)
    for text in run_walks(backend, closers, token_bytes, tokenizer, "ebnf", ARITH, range(4)):
        assert re.fullmatch(r"[0-9+\-*/()]+", text), text
        tree = ast.parse(text, mode="eval")  # Python's parser agrees it is an arithmetic expression
        kinds = (ast.Expression, ast.BinOp, ast.Constant, ast.operator)
        assert all(isinstance(n, kinds) for n in ast.walk(tree))
        replay = backend.new_matcher(compiled)
        assert replay.accept_tokens(tokenizer.encode(text)) and completes(backend, replay)


def test_choices_exact_and_escaped(backend, closers, token_bytes, tokenizer):
    choices = ['yes', 'no "way"', 'back\\slash', 'two\nlines', 'ünïcode', '(x|y)*']
    text = json.dumps(choices)
    outs = run_walks(backend, closers, token_bytes, tokenizer, "choices", text, range(8))
    assert set(outs) <= set(choices)
    compiled = compile_now(backend, "choices", text)
    for c in choices:  # every choice is reachable, nothing longer
        m = backend.new_matcher(compiled)
        assert m.accept_tokens(tokenizer.encode(c)) and completes(backend, m)
        assert not m.accept_tokens(tokenizer.encode("x"))
    assert not backend.new_matcher(compiled).accept_tokens(tokenizer.encode("maybe"))


# ---------------------------------------------------------------- stop tokens, bitmask application


def test_stop_token_terminates(backend):
    m = backend.new_matcher(compile_now(backend, "regex", "abc"))
    bitmask = backend.allocate_bitmask(1)
    backend.fill_bitmask(bitmask, [m])
    assert set(EOS_IDS).isdisjoint(allowed_token_ids(bitmask[0], VOCAB))  # not before the end
    assert m.accept_tokens([backend.tokenizer.convert_tokens_to_ids("abc")])
    assert completes(backend, m) and not m.is_terminated()
    backend.fill_bitmask(bitmask, [m])
    assert sorted(allowed_token_ids(bitmask[0], VOCAB)) == sorted(EOS_IDS)
    assert m.accept_token(0) and m.is_terminated()
    assert not m.accept_token(2)
    assert backend.fill_bitmask(bitmask, [m]) == []  # a terminated matcher has no row to fill


def test_apply_bitmask_padded_and_unconstrained_rows(backend):
    m = backend.new_matcher(compile_now(backend, "regex", "[0-9]+"))
    bitmask = backend.allocate_bitmask(3)
    assert bitmask.shape == (3, VOCAB // 32) and bitmask.dtype == torch.int32
    rows = backend.fill_bitmask(bitmask, [None, m, None])
    assert rows == [1]
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(3, PADDED, generator=torch.Generator().manual_seed(0)).to(dtype)
        original = logits.clone()
        backend.apply_bitmask(logits, bitmask, rows)
        assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
        finite = torch.isfinite(logits[1]).nonzero().flatten().numpy()
        assert np.array_equal(finite, allowed_token_ids(bitmask[1], VOCAB))
        assert torch.isinf(logits[1, VOCAB:]).all()  # padded ids are never allowed
        chosen = int(logits[1].argmax())
        assert re.fullmatch(r"[0-9]+", backend.tokenizer.decode([chosen]))
    with pytest.raises(ValueError, match="logits"):
        backend.apply_bitmask(torch.zeros(3, VOCAB - 1), bitmask, rows)


def test_poll_and_mask_fn(backend):
    bad, good = backend.submit("regex", "["), backend.submit("regex", "[0-9]+")
    with pytest.raises(ConstraintError):
        wait(bad)
    wait(good)
    assert isinstance(backend.poll(bad), ConstraintError)
    compiled = backend.poll(good)
    assert compiled is not None and compiled.kind == "regex"
    free = SimpleNamespace(grammar=None)
    assert backend.mask_fn([free, free]) is None
    reqs = [free, SimpleNamespace(grammar=backend.new_matcher(compiled)), free]
    apply = backend.mask_fn(reqs)
    logits = torch.randn(3, PADDED, generator=torch.Generator().manual_seed(1))
    original = logits.clone()
    apply(logits)
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(re.fullmatch(r"[0-9]+", backend.tokenizer.decode([t])) for t in allowed)


def test_special_tokens_never_allowed(backend):
    m = backend.new_matcher(compile_now(backend, "ebnf", 'root ::= [^"]*'))
    bitmask = backend.allocate_bitmask(1)
    backend.fill_bitmask(bitmask, [m])
    allowed = set(allowed_token_ids(bitmask[0], VOCAB).tolist())
    assert allowed.isdisjoint(SPECIAL_NON_STOP)
    assert set(EOS_IDS) <= allowed and len(allowed) > 40000


def test_rollback(backend, tokenizer):
    compiled = compile_now(backend, "json_schema", json.dumps(SCHEMAS["person"]))
    ids = tokenizer.encode('{"name":"Ada","age":3')
    m = backend.new_matcher(compiled)
    assert m.accept_tokens(ids) and m.num_accepted == len(ids)
    bm_full, bm_back, bm_fresh = (backend.allocate_bitmask(1) for _ in range(3))
    backend.fill_bitmask(bm_full, [m])
    m.rollback(2)
    backend.fill_bitmask(bm_back, [m])
    assert not torch.equal(bm_full, bm_back)
    assert m.accept_tokens(ids[-2:])
    backend.fill_bitmask(bm_back, [m])
    assert torch.equal(bm_full, bm_back)
    fresh = backend.new_matcher(compiled)  # the same tokens from the start: the same state
    assert fresh.accept_tokens(ids)
    backend.fill_bitmask(bm_fresh, [fresh])
    assert torch.equal(bm_full, bm_fresh)
    with pytest.raises(ValueError, match="rollback"):
        m.rollback(len(ids) + 1)
    assert not m.accept_tokens(tokenizer.encode(',"age":4'))  # refused as a whole: state unchanged
    assert m.num_accepted == len(ids)


# ---------------------------------------------------------------- errors and unenforced keywords


@pytest.mark.parametrize("kind, text, message", [
    ("regex", "[a-", "regex: invalid regular expression: .*Unclosed '\\['"),
    ("regex", "(?P<x>a)", "regex: invalid regular expression"),
    ("ebnf", "root ::= missing", 'ebnf: invalid EBNF grammar: .*Rule "missing" is not defined'),
    ("ebnf", 'start ::= "a"', 'ebnf: .*root rule with name "root" is not found'),
    ("json_schema", "{not json", "json_schema: not valid JSON"),
    ("json_schema", "[1, 2]", "json_schema: must be a JSON object or boolean"),
    ("json_schema", '{"type": "strnig"}', 'json_schema: invalid JSON schema: Unsupported type "strnig"'),
    ("json_schema", '{"$ref": "#/$defs/missing"}', "/\\$ref: '#/\\$defs/missing' does not resolve"),
    ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 3}', "minimum greater than maximum"),
    ("json_schema", '{"type": "integer", "exclusiveMinimum": true}', "/exclusiveMinimum: boolean form"),
    ("json_schema", '{"type": "array", "items": [{"type": "string"}]}', "use prefixItems"),
    ("choices", '["a", ""]', "choices: must be a non-empty list of non-empty strings"),
    ("lark", "start: 'a'", "constraint kind must be one of"),
])
def test_invalid_constraints_explain(backend, kind, text, message):
    with pytest.raises(ConstraintError, match=message):
        check_constraint(kind, text)
    handle = backend.submit(kind, text)  # the scheduler path: the error comes back from the handle
    with pytest.raises(ConstraintError, match=message):
        wait(handle)
    assert isinstance(ConstraintError("x"), ValueError)


# Each claim of the walker is checked against xgrammar: "enforced" schemas must reject the bad instance,
# and (for a sample) reported keywords really let an invalid instance through.
ENFORCED = [
    ({"type": "integer", "multipleOf": 5}, "10", "7"),
    ({"type": "integer", "exclusiveMinimum": 5, "maximum": 9}, "6", "5"),
    ({"type": "number", "minimum": 1.5}, "1.75", "1.25"),
    ({"type": "string", "minLength": 3}, '"abc"', '"ab"'),
    ({"type": "string", "maxLength": 3}, '"abc"', '"abcd"'),
    ({"type": "string", "pattern": "^[0-9]{3}$"}, '"123"', '"12a"'),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1,2]", "[1]"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "[1,2]", "[1,2,3]"),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
     '["a",1]', '["a",1,2]'),
    ({"enum": ["a", "b"]}, '"a"', '"c"'),
    ({"const": "x"}, '"x"', '"y"'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a":1}', "{}"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
     '{"a":1}', '{"a":1,"b":2}'),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1}, '{"a":1}',
     '{"a":1,"b":2}'),
    ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
      "additionalProperties": {"type": "integer"}}, '{"ab":1}', '{"AB":1}'),
    ({"$defs": {"P": {"type": "integer", "maximum": 3}}, "$ref": "#/$defs/P"}, "2", "4"),
    ({"definitions": {"P": {"type": "integer", "maximum": 3}}, "$ref": "#/definitions/P"}, "2", "4"),
    ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", '"s"'),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, '"s"', "null"),
    ({"allOf": [{"type": "integer", "maximum": 5}]}, "3", "9"),
    ({"type": ["string", "null"], "maxLength": 2}, "null", '"abcd"'),
    ({"type": "string", "format": "date"}, '"2024-02-29"', '"2023-02-29"'),
    ({"type": "string", "format": "date-time"}, '"2024-01-02T03:04:05Z"', '"2024-01-02 03:04:05"'),
    ({"type": "string", "format": "email"}, '"a@b.com"', '"nobody"'),
    ({"type": "string", "format": "uuid"}, '"123e4567-e89b-12d3-a456-426614174000"', '"123e4567"'),
    ({"type": "object", "title": "T", "description": "d", "x-extension": 1}, "{}", "[]"),
    # xgrammar 0.2.9 bugs worked around: an optional group holding a repetition lost its head ("1234"
    # passed), and length-bounded strings let raw control characters through (invalid JSON).
    ({"type": "string", "pattern": r"^\d{3}(?:\.\d{1,2})?$"}, '"123.45"', '"1234"'),
    ({"type": "string", "maxLength": 5}, '"a b"', '"a\tb"'),  # a raw tab
    ({"type": "string", "minLength": 1}, '"a b"', '"a\x01b"'),
]


@pytest.mark.parametrize("schema, good, bad", ENFORCED)
def test_enforced_keywords(backend, tokenizer, schema, good, bad):
    assert unenforced_keywords(schema) == []
    compiled = compile_now(backend, "json_schema", json.dumps(schema))
    m = backend.new_matcher(compiled)
    assert m.accept_tokens(tokenizer.encode(good)) and completes(backend, m), good
    m = backend.new_matcher(compiled)
    assert not (m.accept_tokens(tokenizer.encode(bad)) and completes(backend, m)), bad
    jsonschema.validate(json.loads(good), schema, format_checker=FORMATS)


UNENFORCED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "[1,1]"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "contains", "[1,2]"),
    ({"not": {"type": "string"}}, "not is not enforced", '"s"'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if/then/else", '{"a":1}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired", '{"a":1}'),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf is not enforced on numbers", "0.7"),
    ({"type": "string", "format": "credit-card"}, "format 'credit-card'", None),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "maxLength ignored beside pattern", '"abcd"'),
    ({"type": "string", "format": "email", "maxLength": 5}, "maxLength ignored beside format", None),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
     "allOf with several", None),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf branches may overlap", "1"),
    ({"enum": ["abc", "x"], "maxLength": 2}, "maxLength is ignored beside enum", '"abc"'),
    ({"type": "string", "anyOf": [{"type": "string"}, {"type": "integer"}]}, "type is ignored beside anyOf",
     "1"),
    ({"type": "object", "required": ["zz"], "additionalProperties": {"type": "integer"}},
     "required property 'zz' is not declared", "{}"),
    ({"minLength": 3}, 'minLength is not enforced without a "type"', '"ab"'),
    ({"$ref": "https://example.com/s.json"}, "is not local", None),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, "patternProperties", None),
    ({"type": "object", "properties": {"deep": {"type": "array", "items": {"$ref": "#/$defs/u"}}},
      "$defs": {"u": {"type": "array", "uniqueItems": True}}}, "/$defs/u: uniqueItems", None),
]


@pytest.mark.parametrize("schema, why, slips_through", UNENFORCED)
def test_unenforced_keywords_reported(backend, tokenizer, schema, why, slips_through):
    found = unenforced_keywords(schema)
    assert any(why in f for f in found), found
    if slips_through is not None:  # the claim holds: xgrammar lets this invalid instance through
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(slips_through), schema)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnenforcedSchemaWarning)
            m = backend.new_matcher(compile_now(backend, "json_schema", json.dumps(schema)))
        assert m.accept_tokens(tokenizer.encode(slips_through)) and completes(backend, m)


def test_oneof_with_discriminator_is_exclusive():
    assert unenforced_keywords(SCHEMAS["event_union"]) == []


def test_strict_mode_errors_and_default_warns(tokenizer):
    schema = json.dumps({"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True}}})
    with pytest.raises(ConstraintError, match="strict_json=True.*/properties/tags: uniqueItems"):
        check_constraint("json_schema", schema, strict_json=True)
    with pytest.warns(UnenforcedSchemaWarning, match="/properties/tags: uniqueItems is not enforced"):
        check_constraint("json_schema", schema)
    strict = make_backend(RuntimeConfig(grammar_strict_json=True), tokenizer, VOCAB)
    try:
        assert strict.strict_json and strict.stop_token_ids == [0, 2]  # <|endoftext|>, <|im_end|>
        with pytest.raises(ConstraintError, match="strict_json=True.*uniqueItems"):
            compile_now(strict, "json_schema", schema)
    finally:
        strict.shutdown()


def test_analyze_schema_does_not_modify_input():
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}}
    before = json.dumps(schema)
    analysis = analyze_schema(schema)
    assert json.dumps(schema) == before
    rewritten = analysis.schema["properties"]["d"]
    assert "pattern" in rewritten and "format" not in rewritten


# ---------------------------------------------------------------- whitespace


def test_flexible_whitespace_is_bounded(tokenizer, closers, token_bytes):
    flex = GrammarBackend(tokenizer, VOCAB, stop_token_ids=EOS_IDS, json_whitespace="flexible",
                          max_whitespace=3)
    try:
        schema = SCHEMAS["person"]
        compiled = compile_now(flex, "json_schema", json.dumps(schema))
        space = tokenizer.convert_tokens_to_ids("Ġ")
        m = flex.new_matcher(compiled)
        assert m.accept_tokens(tokenizer.encode("{"))
        assert all(m.accept_token(space) for _ in range(3))
        assert not m.accept_token(space)  # a fourth whitespace character in a row is refused
        whitespace = np.array([bool(b) and b.isspace() for b in token_bytes])
        for seed in range(3):
            ids = walk(flex, flex.new_matcher(compiled), closers, seed, prefer=whitespace)
            text = decode(token_bytes, ids)
            jsonschema.validate(json.loads(text), schema)
            outside = re.sub(r'"(\\.|[^"\\])*"', '""', text)  # whitespace inside strings is content
            assert re.search(r"\s", outside), text  # the walk did use whitespace
            assert not re.search(r"\s{4}", outside), text
    finally:
        flex.shutdown()


def test_compact_whitespace_refused(backend, tokenizer):
    m = backend.new_matcher(compile_now(backend, "json_schema", json.dumps(SCHEMAS["person"])))
    assert m.accept_tokens(tokenizer.encode("{"))
    assert not m.accept_token(tokenizer.convert_tokens_to_ids("Ġ"))


# ---------------------------------------------------------------- jump-forward

LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_full_legal_name": {"type": "string", "maxLength": 30},
        "shipping_address_first_line": {"type": "string", "maxLength": 30},
        "order_processing_status": {"enum": ["pending_manual_review", "shipped"]},
    },
    "required": ["customer_full_legal_name", "shipping_address_first_line", "order_processing_status"],
}


def test_jump_forward_long_keys(backend, tokenizer):
    m = backend.new_matcher(compile_now(backend, "json_schema", json.dumps(LONG_KEYS)))
    prompt = tokenizer.encode("<|im_start|>assistant\n")
    ids = list(prompt)

    def step_jump():
        jf = m.find_jump_forward(tokenizer, ids)
        before = m.num_accepted
        tokens = jump_forward(m, tokenizer, ids)
        assert tokens == jf.token_ids and m.num_accepted == before + len(tokens)
        assert tokenizer.decode(tokens) == jf.text
        ids.extend(tokens)
        return jf.text

    assert step_jump() == '{"customer_full_legal_name'
    assert m.accept_tokens(tokenizer.encode('":"Ada Lovelace"'))  # the model's tokens
    ids += tokenizer.encode('":"Ada Lovelace"')
    forced = step_jump()  # `","` would merge the quote: the model writes that token itself
    assert forced == ""
    assert m.accept_tokens(tokenizer.encode(',"'))
    ids += tokenizer.encode(',"')
    assert step_jump() == "shipping_address_first_line"
    assert m.accept_tokens(tokenizer.encode('":"1 Main St","'))
    ids += tokenizer.encode('":"1 Main St","')
    assert step_jump() == "order_processing_status"
    assert m.accept_tokens(tokenizer.encode('":"p'))
    ids += tokenizer.encode('":"p')
    assert step_jump() == ""  # "p" + "ending" is one token ("pending"): the model completes the word
    assert m.accept_tokens(tokenizer.encode("ending"))
    ids += tokenizer.encode("ending")
    assert step_jump() == "_manual_review"  # `"}` is left to the model
    assert m.accept_tokens(tokenizer.encode('"}')) and completes(backend, m)
    ids += tokenizer.encode('"}')
    text = tokenizer.decode(ids[len(prompt):])
    value = json.loads(text)
    jsonschema.validate(value, LONG_KEYS)
    assert value["order_processing_status"] == "pending_manual_review"


def test_jump_forward_nothing_forced(backend, tokenizer):
    m = backend.new_matcher(compile_now(backend, "json_schema", json.dumps(LONG_KEYS)))
    assert m.accept_tokens(tokenizer.encode('{"customer_full_legal_name":"A'))
    assert m.find_jump_forward(tokenizer, []).token_ids == []
    assert jump_forward(m, tokenizer, []) == []
    regex = backend.new_matcher(compile_now(backend, "regex", "[ab]+"))
    assert jump_forward(regex, tokenizer, []) == []
