"""Sampler: greedy, seeds, truncation distributions (chi-square), penalties, masks, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from radixgen.common.sampling_params import SamplingParams as SP
from radixgen.runtime.executor import prompt_logprobs as prompt_logprobs_mod
from radixgen.runtime.executor import sampler as sampler_mod
from radixgen.runtime.executor.prompt_logprobs import prompt_logprobs
from radixgen.runtime.executor.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    make_generator,
)


def build(params, vocab, outputs=None, prompts=None, generators=None):
    n = len(params)
    return SamplingBatch.build(params, outputs or [[] for _ in range(n)], prompts or [[] for _ in range(n)],
                               generators or [None] * n, vocab)


def sample(logits, params, vocab=None, sampler=None, **kw):
    vocab = vocab or logits.shape[1]
    return (sampler or Sampler()).forward(logits.clone(), build(params, vocab, **kw)).next_ids


# --- greedy, padding -------------------------------------------------------------------------------------

def test_greedy_is_argmax_and_temperature_zero_is_greedy_in_a_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    params = [SP(temperature=0.0), SP(temperature=1.0), SP(top_k=1), SP(temperature=0.0, top_p=0.5),
              SP(temperature=2.0), SP(temperature=0.0, min_p=0.5)]
    batch = build(params, 300)
    assert batch.greedy_rows.tolist() == [0, 2, 3, 5] and batch.sample_rows.tolist() == [1, 4]
    for _ in range(5):
        ids = Sampler().forward(logits.clone(), batch).next_ids
        assert ids.dtype == torch.int64 and ids.shape == (6,)
        assert ids[[0, 2, 3, 5]].tolist() == logits[[0, 2, 3, 5]].argmax(-1).tolist()
    all_greedy = build([SP(temperature=0.0)] * 6, 300)
    assert all_greedy.is_all_greedy
    assert Sampler().forward(logits.clone(), all_greedy).next_ids.tolist() == logits.argmax(-1).tolist()


def test_padded_vocab_columns_are_never_chosen():
    torch.manual_seed(1)
    vocab, width = 50, 64
    logits = torch.randn(40, width)
    logits[:, vocab:] = 30.0  # padding columns that would win every draw if they were considered
    params = [SP(temperature=0.0), SP(temperature=1.5), SP(top_p=0.9), SP(top_k=60), SP(min_p=0.01)] * 8
    for _ in range(10):
        ids = sample(logits, params, vocab=vocab)
        assert int(ids.max()) < vocab
    batch = build([SP()] * 40, vocab)
    out = Sampler().forward(logits.clone(), batch, return_logprob=True, top_logprobs_num=3)
    expected = torch.log_softmax(logits[:, :vocab], -1).gather(1, out.next_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)
    assert all(max(t.token_ids) < vocab for t in out.top_logprobs)


# --- seeds -----------------------------------------------------------------------------------------------

def _run_steps(seed_row_params, seed, others, position, steps=12, vocab=1000, candidates=None):
    """Tokens of one seeded request over `steps` steps, placed at `position` among `others` rows."""
    gen = make_generator(seed)
    sampler = Sampler() if candidates is None else Sampler(candidates)
    step_logits = torch.Generator().manual_seed(123)
    noise = torch.Generator().manual_seed(7 + position + len(others))  # the other rows differ per setup
    tokens = []
    for _ in range(steps):
        mine = torch.randn(1, vocab, generator=step_logits) * 2
        rest = torch.randn(len(others), vocab, generator=noise) * 2
        logits = torch.cat([rest[:position], mine, rest[position:]])
        params = list(others[:position]) + [seed_row_params] + list(others[position:])
        gens = [None] * position + [gen] + [None] * (len(others) - position)
        out = sampler.forward(logits, build(params, vocab, generators=gens)).next_ids
        tokens.append(int(out[position]))
    return tokens


@pytest.mark.parametrize("params", [
    SP(seed=11, temperature=1.3),
    SP(seed=11, top_p=0.8),
    SP(seed=11, top_k=20, min_p=0.05, temperature=0.9),
])
def test_seeded_request_repeats_regardless_of_batch_and_position(params):
    others = [SP(temperature=0.0), SP(top_p=0.5), SP(temperature=0.7, top_k=5), SP(min_p=0.2), SP()]
    alone = _run_steps(params, 11, [], 0)
    assert alone == _run_steps(params, 11, [], 0)
    assert alone == _run_steps(params, 11, others, 3)
    assert alone == _run_steps(params, 11, others[:2], 0)
    assert alone == _run_steps(params, 11, others, 5)
    # the candidate search width changes only the speed, never the token
    assert alone == _run_steps(params, 11, others, 2, candidates=1)
    assert alone == _run_steps(params, 11, others, 2, candidates=8)
    assert alone != _run_steps(params, 12, [], 0)


def test_seed_without_generator_is_rejected_and_generators_are_independent():
    with pytest.raises(ValueError, match="seed"):
        build([SP(seed=3)], 10)
    with pytest.raises(ValueError, match="seed"):
        make_generator("3")
    a, b = make_generator(5), make_generator(5)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


# --- truncation distributions ----------------------------------------------------------------------------

# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}
# a small logit vector whose vocabulary order differs from its probability order
LOGITS = [0.5, 2.0, -1.0, 1.0, 1.5, -3.0, 0.0, -0.5]


def expected_dist(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """The renormalized target distribution, computed independently in float64 Python."""
    z = [x / temperature for x in logits]
    m = max(z)
    p = [math.exp(x - m) for x in z]
    p = [x / sum(p) for x in p]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(p[i] for i in kept)
    nucleus, acc = [], 0.0
    for i in kept:
        nucleus.append(i)
        acc += p[i] / mass
        if acc >= top_p:
            break
    final = [i for i in nucleus if p[i] >= min_p * p[order[0]]]
    total = sum(p[i] for i in final)
    return [p[i] / total if i in final else 0.0 for i in range(len(p))]


def chi_square_passes(counts, expected):
    n = sum(counts)
    if any(c > 0 and e == 0.0 for c, e in zip(counts, expected, strict=True)):
        return False
    support = [(c, e * n) for c, e in zip(counts, expected, strict=True) if e > 0]
    stat = sum((c - e) ** 2 / e for c, e in support)
    return stat < CHI2_CRIT_001[len(support) - 1]


@pytest.mark.parametrize("kw", [
    dict(temperature=0.7),
    dict(top_k=3),
    dict(top_p=0.7),
    dict(min_p=0.2),
    dict(top_k=4, top_p=0.6, temperature=1.5),
])
@pytest.mark.parametrize("candidates", [2, 4, 512])
def test_truncated_sampling_matches_the_renormalized_distribution(kw, candidates):
    torch.manual_seed(2024)
    n = 20000
    logits = torch.tensor(LOGITS).expand(n, -1).contiguous()
    ids = Sampler(candidates).forward(logits, build([SP(**kw)] * n, len(LOGITS))).next_ids
    counts = torch.bincount(ids, minlength=len(LOGITS)).tolist()
    expected = expected_dist(LOGITS, **kw)
    assert chi_square_passes(counts, expected), (counts, [round(e * n) for e in expected])
    # the same test rejects a wrong target: the untruncated softmax, or two kept tokens' masses swapped
    assert not chi_square_passes(counts, expected_dist(LOGITS))
    kept = sorted((i for i, e in enumerate(expected) if e > 0), key=lambda i: -expected[i])
    wrong = list(expected)
    wrong[kept[0]], wrong[kept[-1]] = expected[kept[-1]], expected[kept[0]]
    assert not chi_square_passes(counts, wrong)


def test_truncation_keeps_exactly_the_expected_support_on_a_large_vocab():
    torch.manual_seed(4)
    vocab = 5000
    base = torch.randn(vocab) * 3
    probs = torch.softmax(base.double(), -1)
    order = probs.argsort(descending=True)
    csum = probs[order].cumsum(0)
    nucleus = set(order[: int((csum < 0.6).sum()) + 1].tolist())
    logits = base.expand(1500, -1).contiguous()
    for candidates in (16, 512):
        ids = set(Sampler(candidates).forward(logits.clone(), build([SP(top_p=0.6)] * 1500, vocab))
                  .next_ids.tolist())
        assert ids <= nucleus and len(ids) > len(nucleus) // 2
        ids = set(Sampler(candidates).forward(logits.clone(), build([SP(top_k=40)] * 1500, vocab))
                  .next_ids.tolist())
        assert ids == set(order[:40].tolist())


# --- penalties -------------------------------------------------------------------------------------------

def test_penalties_adjust_logits_exactly():
    logits = torch.tensor([
        [1.0, 2.0, -1.0, 0.5, 3.0, -2.0],
        [1.0, 2.0, -1.0, 0.5, 3.0, -2.0],
        [1.0, 2.0, -1.0, 0.5, 3.0, -2.0],
        [1.0, 2.0, -1.0, 0.5, 3.0, -2.0],
    ])
    params = [
        SP(frequency_penalty=0.5, presence_penalty=0.25),
        SP(repetition_penalty=2.0),
        SP(),
        SP(frequency_penalty=-0.5, presence_penalty=1.0, repetition_penalty=1.5),
    ]
    outputs = [[1, 1, 3, 1], [2, 4], [1, 2, 3], [0, 0, 2]]
    prompts = [[5, 0], [0, 2], [4], [1, 5]]
    batch = build(params, 6, outputs=outputs, prompts=prompts)
    adjusted = logits.clone()
    apply_penalties(adjusted, batch.penalties)
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)
    expected = logits.clone()
    # row 0: output counts {1: 3, 3: 1}; prompt tokens do not count
    expected[0, 1] = f32(2.0) - (f32(0.5) * 3 + f32(0.25))
    expected[0, 3] = f32(0.5) - (f32(0.5) * 1 + f32(0.25))
    # row 1: tokens {0, 2, 4} seen in prompt or output: positive / 2, negative * 2
    expected[1, 0], expected[1, 2], expected[1, 4] = 0.5, -2.0, 1.5
    # row 3: repetition over {0, 1, 2, 5}, then frequency/presence over output counts {0: 2, 2: 1}
    expected[3, 1] = f32(2.0) / 1.5
    expected[3, 5] = f32(-2.0) * 1.5
    expected[3, 0] = f32(1.0) / 1.5 - (f32(-0.5) * 2 + f32(1.0))
    expected[3, 2] = f32(-1.0) * 1.5 - (f32(-0.5) * 1 + f32(1.0))
    assert torch.equal(adjusted, expected)
    assert build([SP(), SP(temperature=0.0)], 6).penalties is None


def test_logit_bias_is_added_after_the_penalties_and_decides_choices():
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.6], [0.0, 3.0, 2.5, 1.6]])
    params = [SP(temperature=0.0, logit_bias={"1": -100, 3: 1.5}),
              SP(temperature=0.0, frequency_penalty=1.0, logit_bias={1: 0.25})]
    assert SP(logit_bias={"7": 2}).logit_bias == {7: 2} and SP(logit_bias={}).logit_bias is None
    batch = build(params, 4, outputs=[[], [1]])
    adjusted = logits.clone()
    apply_penalties(adjusted, batch.penalties)
    expected = logits.clone()
    expected[0, 1], expected[0, 3] = 3.0 - 100, 1.6 + 1.5
    expected[1, 1] = (3.0 - 1.0) + 0.25
    assert torch.equal(adjusted, expected)
    assert sample(logits, params, outputs=[[], [1]]).tolist() == [3, 2]
    # +100 all but forces a token even under sampling
    forced = [SP(temperature=1.0, seed=s, logit_bias={0: 100}) for s in range(8)]
    gens = [make_generator(s) for s in range(8)]
    assert sample(logits[:1].expand(8, 4).contiguous(), forced, generators=gens).tolist() == [0] * 8
    with pytest.raises(ValueError, match="logit_bias"):
        build([SP(logit_bias={4: 1.0})], 4)


def test_penalties_change_the_greedy_choice_and_reject_bad_ids():
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.6]])
    params = [SP(temperature=0.0, frequency_penalty=1.0)]
    assert sample(logits, params, outputs=[[]]).tolist() == [1]
    assert sample(logits, params, outputs=[[1]]).tolist() == [2]
    assert sample(logits, [SP(temperature=0.0, presence_penalty=2.0)], outputs=[[1, 2]]).tolist() == [3]
    assert sample(logits, [SP(temperature=0.0, repetition_penalty=2.0)], prompts=[[1, 2]]).tolist() == [3]
    with pytest.raises(ValueError, match="output_ids"):
        build([SP(frequency_penalty=1.0)], 4, outputs=[[4]])
    with pytest.raises(ValueError, match="prompt_ids"):
        build([SP(repetition_penalty=1.2)], 4, prompts=[[-1]])


# --- masks -----------------------------------------------------------------------------------------------

def test_vocab_masks_bool_packed_and_callable():
    torch.manual_seed(5)
    vocab = 70
    logits = torch.randn(64, vocab)
    allowed = torch.rand(64, vocab) < 0.2
    allowed[:, 0] = True
    params = [SP(temperature=0.0), SP(), SP(top_p=0.9), SP(top_k=3)] * 16
    batch = build(params, vocab)
    ids = Sampler().forward(logits.clone(), batch, vocab_mask=allowed).next_ids
    assert bool(allowed.gather(1, ids[:, None]).all())
    greedy = torch.where(allowed, logits, float("-inf")).argmax(-1)
    assert ids[::4].tolist() == greedy[::4].tolist()

    # xgrammar's packed int32 layout: bit b of word w allows token 32 * w + b
    words = torch.zeros(64, 3, dtype=torch.int64)
    for j in range(vocab):
        words[:, j // 32] |= allowed[:, j].long() << (j % 32)
    packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    masked = logits.clone()
    sampler_mod.apply_vocab_mask(masked, packed)
    assert torch.equal(torch.isfinite(masked), allowed)
    xgr = pytest.importorskip("xgrammar")
    reference = logits.clone()
    xgr.apply_token_bitmask_inplace(reference, packed)
    assert torch.equal(torch.isfinite(reference), allowed)

    calls = []

    def only_token_7(x):
        calls.append(x.shape)
        x[:, :7] = float("-inf")
        x[:, 8:] = float("-inf")

    ids = Sampler().forward(logits.clone(), batch, apply_mask=only_token_7).next_ids
    assert calls == [(64, vocab)] and ids.tolist() == [7] * 64
    # a row with nothing allowed: token 0 as a placeholder, and the row is reported for the caller to fail
    none_allowed = allowed.clone()
    none_allowed[5] = False
    out = Sampler().forward(logits.clone(), batch, vocab_mask=none_allowed)
    assert out.failed_rows == (5,) and int(out.next_ids[5]) == 0
    assert bool(allowed.gather(1, out.next_ids[:, None])[torch.arange(64) != 5].all())


# --- logprobs --------------------------------------------------------------------------------------------

def test_logprobs_are_those_of_the_raw_logits():
    torch.manual_seed(6)
    vocab = 200
    logits = torch.randn(5, vocab) * 2
    params = [SP(temperature=0.0, frequency_penalty=2.0), SP(temperature=0.3, top_k=5), SP(top_p=0.5),
              SP(repetition_penalty=2.0), SP(temperature=1.7)]
    batch = build(params, vocab, outputs=[[1, 2]] * 5, prompts=[[3]] * 5)
    out = Sampler().forward(logits.clone(), batch, return_logprob=True, top_logprobs_num=[3, 0, 1, 10, 200])
    raw = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.next_ids[:, None]).squeeze(1))
    for row, (top, k) in enumerate(zip(out.top_logprobs, [3, 0, 1, 10, 200], strict=True)):
        values, ids = raw[row].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.int64))
        assert len(top.logprobs) == len(top.token_ids) == k
        assert top.logprobs == sorted(top.logprobs, reverse=True)
        torch.testing.assert_close(torch.tensor(top.logprobs), values)
        torch.testing.assert_close(raw[row, top.token_ids], values)
    plain = Sampler().forward(logits.clone(), batch)
    assert plain.logprobs is None and plain.top_logprobs is None
    only_top = Sampler().forward(logits.clone(), batch, top_logprobs_num=2)
    assert only_top.logprobs is None and all(len(t.token_ids) == 2 for t in only_top.top_logprobs)
    with pytest.raises(ValueError, match="top_logprobs_num"):
        Sampler().forward(logits.clone(), batch, top_logprobs_num=[1, 2])


def test_prompt_logprobs_against_a_direct_computation(monkeypatch):
    torch.manual_seed(7)
    t, vocab, width = 37, 90, 96
    logits = torch.randn(t, width) * 3
    targets = torch.randint(0, vocab, (t,))
    direct = torch.log_softmax(logits[:, :vocab].double(), -1)
    # a small chunk so the prompt is processed in several pieces
    monkeypatch.setattr(prompt_logprobs_mod, "CHUNK_ELEMENTS", 10 * vocab)
    res = prompt_logprobs(logits, targets, top_k=4, vocab_size=vocab)
    torch.testing.assert_close(res.logprobs, direct[torch.arange(t), targets].float())
    values, ids = direct.topk(4, -1)
    torch.testing.assert_close(res.top.values, values.float())
    assert torch.equal(res.top.ids, ids)
    half = prompt_logprobs(logits.bfloat16(), targets, vocab_size=vocab)
    assert half.top is None and half.logprobs.dtype == torch.float32
    torch.testing.assert_close(
        half.logprobs, torch.log_softmax(logits.bfloat16()[:, :vocab].float(), -1)[torch.arange(t), targets])
    with pytest.raises(ValueError, match="target_ids"):
        prompt_logprobs(logits, torch.full((t,), vocab), vocab_size=vocab)


# --- input checks ----------------------------------------------------------------------------------------

def test_bad_inputs_are_rejected():
    batch = build([SP(), SP()], 10)
    with pytest.raises(ValueError, match="float32"):
        Sampler().forward(torch.zeros(2, 10, dtype=torch.bfloat16), batch)
    with pytest.raises(ValueError, match="rows"):
        Sampler().forward(torch.zeros(3, 10), batch)
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler().forward(torch.zeros(2, 8), batch)
    with pytest.raises(ValueError, match="generators"):
        SamplingBatch.build([SP()], [[]], [[]], [], 10)
    with pytest.raises(ValueError, match="candidates"):
        Sampler(0)
