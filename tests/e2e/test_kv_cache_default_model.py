"""The bundled default model over an 8-bit KV cache against the bf16 cache (kv_cache_dtype auto on this CPU):
greedy output over 32 tokens on the prompts of test_default_model_greedy.py, and the logits of every decode step
with the bf16 cache's greedy tokens forced (so both caches see the same contexts).

Stated tolerances: int8 logits within 5% (relative L2) of the bf16 cache's and the same argmax at >= 90% of the
96 forced steps; fp8 e4m3 within 8% and >= 85%. (Measured against a float32 model with a float32 cache, the bf16
cache is 1.0% off with 97.9% argmax agreement, int8 2.0% / 95.8%, fp8 e4m3 2.7% / 95.8%: the 8-bit caches about
double the bf16 path's own error on this 135M model.) Greedy agreement is printed (-s): a greedy sequence that
takes another token at a near-tie goes its own way from there, so it is the forced-token figures that measure the
cache's error, and where a greedy output parts from the bf16 cache's, the test asserts that it did so at a near-tie
(NEAR_TIE) of the bf16 cache's own logits: which prompts part there depends on the CPU's rounding."""

from __future__ import annotations

import pytest
import torch
from kv_helpers import kv_of
from test_default_model_greedy import NEW_TOKENS, PROMPTS  # noqa: F401  (prompt_ids is a fixture of that module)

from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.engine import Engine
from radixgen.runtime.executor.model_runner import ForwardInput, ModelRunner

BOUNDS = {"int8": (0.05, 0.90), "fp8_e4m3": (0.08, 0.85)}  # (relative logit error, argmax agreement)
# the largest lead, in logits, of the bf16 cache's greedy token over the 8-bit cache's where the greedy outputs
# part: bf16 logits near 16-32 lie 0.125 apart, and the partings seen were 1-2 such steps (a logit's spread over
# the vocabulary is about 3.4)
NEAR_TIE = 0.5


@pytest.fixture(scope="module")
def prompt_ids():
    from radixgen.runtime.loader import load_tokenizer

    tok = load_tokenizer(None)
    return [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            for m in PROMPTS]


@pytest.fixture(scope="module")
def greedy_bf16(prompt_ids):
    with Engine(dtype="bfloat16") as eng:
        return [o["output_ids"] for o in eng.generate(input_ids=prompt_ids, sampling_params={
            "max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True})]


def forced_logits(kv: str, prompt_ids, continuations) -> torch.Tensor:
    """Prefill the prompts, then decode the given continuations token by token: (steps, B, vocab) logits."""
    r = ModelRunner(RuntimeConfig(dtype="bfloat16", kv_cache_dtype=kv, max_total_tokens=1024, max_running_requests=4))
    rows = list(range(len(prompt_ids)))
    lens = [len(p) for p in prompt_ids]
    slots = [kv_of(r).allocator.allocate(n) for n in lens]
    for row, s in zip(rows, slots, strict=True):
        kv_of(r).table.write(row, 0, s)
    out = [r.forward(ForwardInput(torch.tensor(sum(prompt_ids, [])), torch.cat([torch.arange(n) for n in lens]),
                                  torch.cat(slots), torch.tensor(rows), [0] * len(rows), lens,
                                  torch.tensor(lens).cumsum(0) - 1))]
    for step in range(NEW_TOKENS - 1):
        s = kv_of(r).allocator.allocate(len(rows))
        for i, row in enumerate(rows):
            kv_of(r).table.write(row, lens[i], s[i:i + 1])
        ids = torch.tensor([c[step] for c in continuations])
        out.append(r.forward(ForwardInput(ids, torch.tensor(lens), s, torch.tensor(rows), list(lens),
                                          [1] * len(rows), torch.arange(len(rows)))))
        lens = [n + 1 for n in lens]
    return torch.stack(out)


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_default_model_over_8bit_kv_cache(kv, prompt_ids, greedy_bf16):
    ref = forced_logits("auto", prompt_ids, greedy_bf16)
    got = forced_logits(kv, prompt_ids, greedy_bf16)
    err = ((got - ref).norm() / ref.norm()).item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    with Engine(dtype="bfloat16", kv_cache_dtype=kv) as eng:
        outs = eng.generate(input_ids=prompt_ids, sampling_params={
            "max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True})
        assert eng.get_server_info()["invariant_ok"]
    pairs = [list(zip(o["output_ids"], g, strict=True)) for o, g in zip(outs, greedy_bf16, strict=True)]
    same = [sum(a == b for a, b in p) for p in pairs]
    prefix = [next((i for i, (a, b) in enumerate(p) if a != b), NEW_TOKENS) for p in pairs]
    print(f"\n{kv}: logits rel err {err:.4f}, forced argmax agreement {agree:.3f}, greedy tokens equal per prompt "
          f"{same} of {NEW_TOKENS} (identical prefixes {prefix})")
    max_err, min_agree = BOUNDS[kv]
    assert err < max_err and agree >= min_agree
    # where a greedy sequence first leaves the bf16 cache's, the contexts are still the same, so the forced logits
    # there are the bf16 cache's own: its top token may lead the 8-bit cache's choice only by a near-tie
    for b, (o, p) in enumerate(zip(outs, prefix, strict=True)):
        if p < NEW_TOKENS:
            lead = (ref[p, b, greedy_bf16[b][p]] - ref[p, b, o["output_ids"][p]]).abs().item()
            assert lead <= NEAR_TIE, f"prompt {b} left the bf16 cache's greedy tokens at step {p} by {lead} logits"
