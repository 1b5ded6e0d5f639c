"""Speculative decoding on the bundled default model (bf16: verifications on the fused CPU step where the CPU
has it): greedy outputs token for token as without speculation, with n-gram drafts (free text copying its
document, and JSON-schema output) and with draft models (the model itself; a tiny random model of the same
tokenizer, whose vocabulary is padded differently)."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
from extraction_suite import CASES, messages
from tiny_models import tiny_model_dir

from radixgen.common.sampling_params import SamplingParams
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ModelRunner
from radixgen.runtime.grammar import make_backend
from radixgen.runtime.loader import load_tokenizer, resolve_model_path
from radixgen.runtime.scheduler import Scheduler
from radixgen.runtime.scheduler.request import GenerateRequest

pytestmark = pytest.mark.slow

DOC = ("The maintenance window for the Frankfurt data centre starts on Saturday 9 November at 22:00 UTC and "
       "ends on Sunday 10 November at 04:00 UTC. During the window the storage cluster FRA-S3 will be upgraded "
       "to firmware 7.2.1, and the backup link to Amsterdam will be tested twice. Customers with workloads in "
       "FRA-S3 should pause their batch jobs before 21:30 UTC and resume them after 04:30 UTC.")
CASE = next(c for c in CASES if c.name == "restaurant_reservation")  # a short answer
ASKS = ["Copy the sentence about the storage cluster exactly as written.",
        "Quote the first sentence of the notice word for word.",
        "Repeat the instructions for customers verbatim."]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def scheduler(tokenizer, **kw) -> Scheduler:
    cfg = RuntimeConfig(dtype="bfloat16", max_total_tokens=8192, max_running_requests=8, context_length=2048, **kw)
    runner = ModelRunner(cfg)
    return Scheduler(cfg, runner, tokenizer, make_backend(cfg, tokenizer, runner.vocab_size))


def run(sched: Scheduler, reqs: list[GenerateRequest]) -> dict[str, list[int]]:
    # Each run starts from an empty radix cache: in bf16 a prompt's prefill bits depend on how much of it was
    # cached before (a suffix of 64 rows or more runs on oneDNN's AMX GEMM, a shorter one on the C kernels; only
    # the deterministic mode promises cache-independent bits), and this module is about what speculation changes.
    sched.kv.flush()
    for r in reqs:
        sched.handle_message(r)
    out = {r.rid: [] for r in reqs}
    deadline = time.monotonic() + 600
    while not sched.is_idle() and time.monotonic() < deadline:
        if not sched.step():
            time.sleep(0.005)  # a grammar compiling
        for msg in sched.outbox:
            out[msg.rid] += msg.new_ids
        sched.outbox.clear()
    assert sched.is_idle() and sched.invariant_holds()
    return out


@pytest.fixture(scope="module")
def requests(tokenizer):
    def ids(msgs):
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)

    greedy = dict(max_new_tokens=64, temperature=0.0)
    reqs = [GenerateRequest(f"copy{i}", ids([{"role": "user", "content": f"{DOC}\n\n{a}"}]),
                            SamplingParams(**greedy)) for i, a in enumerate(ASKS)]
    case = CASE
    reqs.append(GenerateRequest("json", ids(messages(case)),
                                SamplingParams(max_new_tokens=160, temperature=0.0,
                                               json_schema=json.dumps(case.schema))))
    return reqs


@pytest.fixture(scope="module")
def reference(tokenizer, requests):
    sched = scheduler(tokenizer)
    return {r.rid: run(sched, [r])[r.rid] for r in requests}  # batch 1, one after the other


def test_ngram_greedy_output_is_unchanged(tokenizer, requests, reference):
    sched = scheduler(tokenizer, speculative_algorithm="ngram")
    got = {r.rid: run(sched, [r])[r.rid] for r in requests}
    assert got == reference
    jsonschema.validate(json.loads(tokenizer.decode(got["json"][:-1])), CASE.schema)
    stats = sched.stats
    assert stats["spec_accepted_tokens"] > 0.3 * stats["spec_draft_tokens"]
    assert stats["decode_passes"] < 0.7 * stats["generation_tokens"]  # several tokens per verification


@pytest.mark.parametrize("draft", ["self", "tiny"])
def test_draft_model_greedy_output_is_unchanged(tokenizer, requests, reference, draft):
    path = tiny_model_dir("llama") if draft == "tiny" else resolve_model_path(None)
    sched = scheduler(tokenizer, speculative_algorithm="draft", speculative_draft_model=str(path))
    sched.spec.drafter.forward_cost = 0.0  # drafts even where they cannot pay, to exercise the path
    got = {r.rid: run(sched, [r])[r.rid] for r in requests[:2] + requests[3:]}
    assert got == {rid: reference[rid] for rid in got}
    proposed, accepted = sched.stats["spec_draft_tokens"], sched.stats["spec_accepted_tokens"]
    assert proposed > 0
    if draft == "self":
        assert accepted > 0.9 * proposed
