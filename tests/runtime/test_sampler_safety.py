"""The sampler under hostile values (real tensors): NaN / inf logits, tiny temperatures, extreme penalties and
magnitudes. It must never crash, never return a token outside [0, vocab_size), and report finite logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from radixgen.common.sampling_params import MAX_SEED, MIN_SEED
from radixgen.common.sampling_params import SamplingParams as SP
from radixgen.runtime.executor.logits_processors import LOGPROB_FLOOR
from radixgen.runtime.executor.prompt_logprobs import prompt_logprobs
from radixgen.runtime.executor.sampler import Sampler, SamplingBatch, make_generator

NAN, INF = math.nan, math.inf

# every kind of row: greedy, plain sampling, each truncation, a tiny (greedy) and the smallest sampling temperature
KINDS = [SP(temperature=0.0), SP(), SP(temperature=1e-300), SP(temperature=1e-5), SP(top_k=3), SP(top_p=0.5),
         SP(min_p=0.2), SP(temperature=1e-5, top_p=0.9, top_k=10, min_p=0.05), SP(temperature=100.0),
         SP(seed=7), SP(repetition_penalty=0.01), SP(repetition_penalty=2.0, frequency_penalty=2.0,
                                                     presence_penalty=-2.0)]


def run(logits, params, vocab, outputs=None, **kw):
    n = len(params)
    gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
    batch = SamplingBatch.build(params, outputs or [[0, 1, 2]] * n, [[3, 4]] * n, gens, vocab)
    return Sampler().forward(logits.clone(), batch, **kw)


def assert_sane(out, vocab):
    assert int(out.next_ids.min()) >= 0 and int(out.next_ids.max()) < vocab
    if out.logprobs is not None:
        assert bool(torch.isfinite(out.logprobs).all()) and bool((out.logprobs <= 0).all())
    for top in out.top_logprobs or []:
        assert all(math.isfinite(v) for v in top.logprobs)


def test_tiny_temperatures_are_greedy_and_never_leave_the_vocabulary():
    torch.manual_seed(0)
    vocab = 300
    logits = torch.randn(8, vocab) * 5
    for t in (1e-300, 1e-45, 1e-38, 1e-10, 1e-6):
        out = run(logits, [SP(temperature=t)] * 8, vocab, return_logprob=True, top_logprobs_num=2)
        assert out.next_ids.tolist() == logits.argmax(-1).tolist() and out.failed_rows == ()
        assert_sane(out, vocab)
    # the smallest sampling temperature is effectively greedy too, and well defined
    out = run(logits, [SP(temperature=1e-5)] * 8, vocab, return_logprob=True)
    assert out.next_ids.tolist() == logits.argmax(-1).tolist()
    assert_sane(out, vocab)


def test_nan_and_inf_logits_never_crash_nor_escape_the_vocabulary():
    torch.manual_seed(1)
    vocab, width = 200, 256
    rows = []
    for kind in range(len(KINDS)):
        row = torch.randn(width) * 3
        row[torch.randperm(vocab)[:50]] = NAN  # a quarter of the tokens are NaN
        row[kind % vocab] = -INF
        rows.append(row)
    logits = torch.stack(rows)
    for _ in range(5):
        out = run(logits, KINDS, vocab, return_logprob=True, top_logprobs_num=5)
        assert_sane(out, vocab)
        assert out.failed_rows == ()
        assert not bool(torch.isnan(logits[torch.arange(len(KINDS)), out.next_ids]).any())  # NaN is never chosen

    plus_inf = torch.randn(len(KINDS), vocab)
    plus_inf[:, 17] = INF
    plus_inf[:, 18] = 1e38
    out = run(plus_inf, KINDS, vocab, return_logprob=True, top_logprobs_num=3)
    assert_sane(out, vocab)
    # +inf wins wherever the penalties leave it on top (rows without penalties)
    for i, p in enumerate(KINDS):
        if p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0:
            assert int(out.next_ids[i]) == 17


def test_a_row_with_no_finite_logit_gets_a_placeholder_and_is_reported():
    torch.manual_seed(2)
    vocab = 50
    logits = torch.randn(len(KINDS), vocab)
    logits[2] = NAN
    logits[5] = -INF
    logits[7, :] = NAN
    logits[7, 3] = -INF
    out = run(logits, KINDS, vocab, return_logprob=True, top_logprobs_num=vocab)
    assert out.failed_rows == (2, 5, 7)
    assert out.next_ids[[2, 5, 7]].tolist() == [0, 0, 0]
    assert_sane(out, vocab)
    assert out.logprobs[[2, 5, 7]].tolist() == [LOGPROB_FLOOR] * 3
    ok = [i for i in range(len(KINDS)) if i not in (2, 5, 7)]
    assert bool(torch.isfinite(logits[ok, out.next_ids[ok]]).all())


def test_extreme_magnitudes_and_penalties_stay_finite():
    torch.manual_seed(3)
    vocab = 400
    for scale in (1e30, 3e38):
        logits = (torch.rand(len(KINDS), vocab) * 2 - 1) * scale  # up to +-3e38: the penalties overflow float32
        for _ in range(3):
            out = run(logits, KINDS, vocab, outputs=[list(range(0, 400, 3))] * len(KINDS), return_logprob=True,
                      top_logprobs_num=4)
            assert_sane(out, vocab)
            assert out.failed_rows == ()


def test_random_hostile_batches():
    gen = torch.Generator().manual_seed(4)
    specials = torch.tensor([NAN, INF, -INF, 3e38, -3e38, 1e-45, 0.0])
    for trial in range(30):
        b, vocab = 1 + trial % 9, 1 + (trial * 37) % 300
        logits = torch.randn(b, vocab, generator=gen) * 10 ** (trial % 5)
        hit = torch.rand(b, vocab, generator=gen) < 0.3
        picks = specials[torch.randint(0, len(specials), (b, vocab), generator=gen)]
        logits = torch.where(hit, picks, logits)
        params = [KINDS[(trial + i) % len(KINDS)] for i in range(b)]
        out = run(logits, params, vocab, outputs=[[0]] * b, return_logprob=True, top_logprobs_num=min(3, vocab))
        assert_sane(out, vocab)
        for i in range(b):
            row = torch.nan_to_num(logits[i], nan=-INF)
            if bool(torch.isneginf(row).all()):
                assert i in out.failed_rows
            elif p_has_no_penalty(params[i]):
                assert i not in out.failed_rows and not math.isnan(float(logits[i, out.next_ids[i]]))


def p_has_no_penalty(p: SP) -> bool:
    return p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0


def test_prompt_logprobs_are_finite_with_hostile_logits():
    logits = torch.randn(6, 40)
    logits[1, 5] = NAN
    logits[2, 7] = INF
    logits[3] = -INF
    logits[4] = NAN
    targets = torch.tensor([1, 5, 7, 2, 3, 4])
    res = prompt_logprobs(logits, targets, top_k=3)
    assert bool(torch.isfinite(res.logprobs).all()) and bool(torch.isfinite(res.top.values).all())
    assert float(res.logprobs[1]) == LOGPROB_FLOOR  # the NaN token is impossible
    assert float(res.logprobs[2]) == 0.0  # the +inf token is certain
    assert float(res.logprobs[3]) == float(res.logprobs[4]) == LOGPROB_FLOOR
    clean = torch.log_softmax(logits[[0, 5]], -1)
    torch.testing.assert_close(res.logprobs[[0, 5]], clean[[0, 1], targets[[0, 5]]])


def test_seeds_across_the_whole_64_bit_range():
    for seed in (MIN_SEED, -1, 0, 2**63, MAX_SEED):
        make_generator(seed)
    for bad in (MAX_SEED + 1, MIN_SEED - 1, True, 1.0):
        with pytest.raises(ValueError, match="seed"):
            make_generator(bad)
