"""Constrained decoding over xgrammar: compile cache, per-request matchers, batch bitmasks, jump-forward.

Constraint kinds (``SamplingParams.constraint`` gives the request's ``Constraint(kind, text)`` record,
radixgen.common.constraint: the front check's input and the compile cache's key):
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

Modules: ``schema`` (JSON-schema analysis, no tokenizer), ``compile`` (the front-process check, the compile
cache and its time limit), ``matcher`` (per-request state, jump-forward), ``backend`` (tokenizer info, the
batch bitmask).

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

from radixgen.common.grammar.compile import (
    CONSTRAINT_KINDS,
    CacheInfo,
    CompileCache,
    CompiledConstraint,
    CompileHandle,
    check_constraint,
    choices_to_ebnf,
)
from radixgen.common.grammar.schema import (
    ENFORCED_FORMATS,
    FORMAT_PATTERNS,
    ConstraintError,
    SchemaAnalysis,
    UnenforcedSchemaWarning,
    analyze_schema,
    unenforced_keywords,
)
from radixgen.runtime.grammar.backend import GrammarBackend, build_tokenizer_info, default_stop_token_ids, make_backend
from radixgen.runtime.grammar.matcher import JumpForward, Matcher, jump_forward

__all__ = [
    "CONSTRAINT_KINDS", "ENFORCED_FORMATS", "FORMAT_PATTERNS", "CacheInfo", "CompileCache", "CompileHandle",
    "CompiledConstraint", "ConstraintError", "GrammarBackend", "JumpForward", "Matcher", "SchemaAnalysis",
    "UnenforcedSchemaWarning", "analyze_schema", "build_tokenizer_info", "check_constraint", "choices_to_ebnf",
    "default_stop_token_ids", "jump_forward", "make_backend", "unenforced_keywords",
]
