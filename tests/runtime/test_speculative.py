"""Speculative decoding on tiny random models, in-process: greedy outputs never change (n-gram drafts, a draft
model that is the target itself, a different draft model), the sampled distribution is exactly the target's,
grammars, stop conditions at the boundary, logprobs, penalties, retraction and chunked prefill; the KV invariant
holds after every run (`run` checks it). Plus the parts alone: the radix tree's continuations, the suffix
index, the adaptive draft lengths, and the fused CPU step verifying several rows of a request."""

from __future__ import annotations

import json
import re

import pytest
import torch
from kv_helpers import kv_of
from test_scheduler import make_scheduler, outputs, run, workload
from tiny_models import perturbed_model_dir, tiny_model_dir

from radixgen.common.sampling_params import SamplingParams
from radixgen.kernels import cpu
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ForwardInput, ModelRunner
from radixgen.runtime.grammar import make_backend
from radixgen.runtime.scheduler import Scheduler
from radixgen.runtime.scheduler.radix import RadixCache, views
from radixgen.runtime.scheduler.request import FinishReason, GenerateRequest
from radixgen.runtime.scheduler.speculative import adaptive
from radixgen.runtime.scheduler.speculative.adaptive import Acceptance, draft_lengths
from radixgen.runtime.scheduler.speculative.ngram import NgramIndex


def spec_scheduler(model_dir, tokenizer, algo: str = "ngram", draft=None, **kw):
    s = make_scheduler(model_dir, tokenizer, speculative_algorithm=algo,
                       speculative_draft_model=None if draft is None else str(draft), **kw)
    if algo == "draft":
        # a draft model as large as its target never pays for itself, and the adaptive lengths know it: the
        # tests make its forwards free so that it drafts
        s.spec.drafter.forward_cost = 0.0
    return s


def again(reqs: list[GenerateRequest], tag: str = "again") -> list[GenerateRequest]:
    """The same requests under new ids: run after the first ones, their contexts' continuations are in the tree."""
    return [GenerateRequest(f"{r.rid}-{tag}", r.input_ids, r.params, r.return_logprob, r.logprob_start_len,
                            r.top_logprobs_num, r.cache_salt) for r in reqs]


def run_twice(sched, reqs) -> dict:
    first = run(sched, reqs)
    second = {rid.removesuffix("-again"): o for rid, o in run(sched, again(reqs)).items()}
    return {"first": first, "again": second}


def spec(sched) -> tuple[int, int]:
    return sched.stats["spec_draft_tokens"], sched.stats["spec_accepted_tokens"]


# ---------------------------------------------------------------- greedy outputs never change


@pytest.fixture(scope="module")
def reference(model_dir, tokenizer):
    """Per config: the outputs without speculation and their decode steps."""
    cache = {}

    def get(config: str):
        if config not in cache:
            sched = make_scheduler(model_dir, tokenizer, **CONFIGS[config])
            res = run_twice(sched, workload())
            cache[config] = {k: outputs(v) for k, v in res.items()}, sched.stats["decode_passes"]
        return cache[config]

    return get


CONFIGS = {
    "plain": {},
    "cache-off": dict(disable_radix_cache=True),
    "chunked": dict(chunked_prefill_size=8, max_prefill_tokens=24),
    "page-4": dict(page_size=4),
    "tiny-pool": dict(max_total_tokens=330),  # eviction and retraction
    "kv-int8": dict(kv_cache_dtype="int8"),
}
DRAFTERS = {
    "ngram": ("ngram", None),
    "draft-self": ("draft", "llama"),  # the target as its own draft: every draft is accepted
    "draft-other": ("draft", "perturbed"),  # another model of the same vocabulary: some drafts are
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_outputs_are_the_target_models(model_dir, tokenizer, reference, drafter, config):
    if drafter != "ngram" and config in ("cache-off", "page-4", "kv-int8"):
        pytest.skip("covered by the n-gram drafter")
    algo, which = DRAFTERS[drafter]
    draft = {None: None, "llama": model_dir, "perturbed": perturbed_model_dir("llama", 0.01)}[which]
    want, decode_passes = reference(config)
    sched = spec_scheduler(model_dir, tokenizer, algo, draft, **CONFIGS[config])
    res = run_twice(sched, workload())
    assert {k: outputs(v) for k, v in res.items()} == want
    proposed, accepted = spec(sched)
    assert proposed > 0 and accepted > 0
    if drafter == "draft-self":
        assert accepted == proposed  # also shows the draft's KV right in every slot the tree hands out
    if drafter == "draft-other":
        assert accepted < proposed
    if config == "tiny-pool":  # the tree keeps little of the first outputs here
        assert sched.stats["retractions"] > 0
    elif config != "cache-off" or drafter != "ngram":
        assert sched.stats["decode_passes"] < decode_passes  # several tokens kept per verification


def test_draft_model_must_share_the_vocabulary(model_dir, tokenizer, tmp_path):
    import shutil

    other = tmp_path / "other-vocab"
    shutil.copytree(model_dir, other)
    vocab_file = other / "tokenizer.json"
    vocab_file.write_text(vocab_file.read_text().replace('"<|endoftext|>"', '"<|end-of-text|>"', 1))
    with pytest.raises(ValueError, match="vocabulary"):
        spec_scheduler(model_dir, tokenizer, "draft", other)


# ---------------------------------------------------------------- sampling is exact


def _target_distribution(model_dir, prompt: list[int], p: SamplingParams, steps: int) -> dict[tuple, float]:
    """The exact joint distribution of the first `steps` sampled tokens (transformers' forward on the same
    weights): presence penalty over the output so far, temperature, top-k."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    dist = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for out, prob in dist.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(out)])).logits[0, -1].double()
            logits[list(set(out))] -= p.presence_penalty
            top = torch.topk(logits / p.temperature, p.top_k)
            for q, tok in zip(torch.softmax(top.values, -1).tolist(), top.indices.tolist(), strict=True):
                nxt[out + (tok,)] = prob * q
        dist = nxt
    return dist


def _chi_square_p(counts: dict[tuple, int], expected_prob: dict[tuple, float]) -> float:
    n = sum(counts.values())
    cells, rest_obs, rest_exp = [], 0, 0.0
    for outcome, prob in expected_prob.items():
        if prob * n >= 5:
            cells.append((counts.get(outcome, 0), prob * n))
        else:  # cells expected under 5 times are pooled
            rest_obs, rest_exp = rest_obs + counts.get(outcome, 0), rest_exp + prob * n
    rest_obs += sum(c for o, c in counts.items() if o not in expected_prob)  # outcomes the target cannot make
    if rest_exp > 0 or rest_obs:
        cells.append((rest_obs, max(rest_exp, 1e-9)))
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


def test_sampled_distribution_is_exactly_the_targets(model_dir, tokenizer):
    """1200 samples of 3 tokens of one prompt, with and without speculation, against the exact distribution.
    The drafts are what earlier samples of the prompt generated (the tree's continuations), so they are both
    accepted and rejected. Seeded (torch.manual_seed before each run): the test is deterministic. Threshold: under
    an exact sampler the statistic is chi-square distributed, so p > 1e-3 fails for one seed in a thousand; a
    sampler that keeps drafts it should not (or draws a rejected draft's replacement from p without removing the
    draft) moves several percent of the mass between cells, which over 1200 samples gives p far below 1e-6."""
    prompt = torch.randint(3, 49152, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    p = SamplingParams(max_new_tokens=3, temperature=0.9, top_k=3, presence_penalty=0.7, ignore_eos=True)
    exact = _target_distribution(model_dir, prompt, p, 3)
    samples = {}
    for label, algo in (("off", "none"), ("on", "ngram")):
        sched = make_scheduler(model_dir, tokenizer, speculative_algorithm=algo)
        torch.manual_seed(11)
        counts: dict[tuple, int] = {}
        for wave in range(150):  # batches of 8: larger ones rarely draft (their rows cost more than they save)
            res = run(sched, [GenerateRequest(f"{wave}-{i}", prompt, p) for i in range(8)])
            for o in res.values():
                counts[tuple(o["ids"])] = counts.get(tuple(o["ids"]), 0) + 1
        samples[label] = counts
        if algo == "ngram":
            proposed, accepted = spec(sched)
            assert 0 < accepted < proposed  # drafts kept and drafts rejected
    for label, counts in samples.items():
        assert sum(counts.values()) == 1200
        assert _chi_square_p(counts, exact) > 1e-3, (label, counts)


def test_seeded_requests_are_reproducible_and_as_without_speculation(model_dir, tokenizer):
    """A seeded request draws once per kept token, in order, as it does without speculation: its output is the
    same with drafts or without (each position's token is the target's inverse CDF at the same draw)."""
    reqs = [GenerateRequest(f"s{i}", r.input_ids, SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9,
                                                                 seed=100 + i, ignore_eos=True))
            for i, r in enumerate(workload(n=6))]
    want = {k: outputs(v) for k, v in run_twice(make_scheduler(model_dir, tokenizer), reqs).items()}
    for algo, draft in (("ngram", None), ("draft", model_dir)):
        for _ in range(2):
            sched = spec_scheduler(model_dir, tokenizer, algo, draft)
            assert {k: outputs(v) for k, v in run_twice(sched, reqs).items()} == want
            # the tree's continuations are the seeds' own tokens; a greedy draft model's rarely are
            assert spec(sched)[1 if algo == "ngram" else 0] > 0


# ---------------------------------------------------------------- everything else still holds


def _variants(ref_ids: list[int], tokenizer) -> dict[str, dict]:
    """Stop conditions that fall inside a run of kept drafts (the reference output is 24 tokens)."""
    text = tokenizer.decode(ref_ids[6:10])
    return {
        **{f"max-{n}": dict(max_new_tokens=n) for n in (1, 2, 3, 5, 8, 13)},
        "stop-id": dict(max_new_tokens=24, stop_token_ids=[ref_ids[7]]),
        "stop-id-min-new": dict(max_new_tokens=24, stop_token_ids=[ref_ids[3]], min_new_tokens=9),
        "stop-string": dict(max_new_tokens=24, stop=[text[len(text) // 2:]] if len(text) > 1 else [text]),
        "stop-regex": dict(max_new_tokens=24, stop_regex=re.escape(text[-3:])),
    }


def test_stop_conditions_hold_at_the_boundary_when_several_tokens_are_kept(model_dir, tokenizer):
    prompt = workload()[3].input_ids
    base = dict(temperature=0.0, ignore_eos=True)
    ref = run(make_scheduler(model_dir, tokenizer),
              [GenerateRequest("r", prompt, SamplingParams(max_new_tokens=24, **base))])["r"]["ids"]
    variants = _variants(ref, tokenizer)
    plain = make_scheduler(model_dir, tokenizer)
    sched = spec_scheduler(model_dir, tokenizer)
    run(sched, [GenerateRequest("fill", prompt, SamplingParams(max_new_tokens=24, **base))])  # tree: the answer
    for name, extra in variants.items():
        req = GenerateRequest(name, prompt, SamplingParams(**base, **extra))
        want = run(plain, [req])[name]
        passes = sched.stats["decode_passes"]
        got = run(sched, [req])[name]
        assert (got["ids"], got["finish"]) == (want["ids"], want["finish"]), name
        if len(want["ids"]) >= 4:
            assert sched.stats["decode_passes"] - passes < len(want["ids"]) - 1, name  # several kept at once
    assert sched.stats["spec_accepted_tokens"] > 0


def test_logprobs_of_kept_tokens(model_dir, tokenizer):
    reqs = [GenerateRequest(r.rid, r.input_ids, r.params, return_logprob=True, top_logprobs_num=3)
            for r in workload(n=4)]

    def logprobs(sched):
        return {**run_with_logprobs(sched, reqs), **run_with_logprobs(sched, again(reqs))}

    want = logprobs(make_scheduler(model_dir, tokenizer))
    sched = spec_scheduler(model_dir, tokenizer)
    got = logprobs(sched)
    assert spec(sched)[1] > 0
    for rid, (ids, lps, tops) in want.items():
        g_ids, g_lps, g_tops = got[rid]
        assert g_ids == ids and len(g_lps) == len(ids) and len(g_tops) == len(ids)
        assert g_lps == pytest.approx(lps, abs=1e-4)
        assert [t[1] for t in g_tops] == [t[1] for t in tops]
        assert [t[0] for t in g_tops] == [pytest.approx(t[0], abs=1e-4) for t in tops]


def run_with_logprobs(sched, reqs) -> dict[str, tuple[list, list, list]]:
    for r in reqs:
        sched.handle_message(r)
    got: dict[str, tuple[list, list, list]] = {r.rid: ([], [], []) for r in reqs}
    while not sched.is_idle():
        sched.step()
        for msg in sched.outbox:
            ids, lps, tops = got[msg.rid]
            ids += msg.new_ids
            lps += msg.output_logprobs
            tops += msg.output_top
        sched.outbox.clear()
    assert sched.invariant_holds()
    return got


def test_penalties_see_the_drafts_before_each_row(model_dir, tokenizer):
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True, frequency_penalty=1.5,
                            presence_penalty=0.5, repetition_penalty=1.6)
    reqs = [GenerateRequest(r.rid, r.input_ids, params) for r in workload(n=6)]
    want = {k: outputs(v) for k, v in run_twice(make_scheduler(model_dir, tokenizer), reqs).items()}
    for algo, draft in (("ngram", None), ("draft", model_dir)):
        sched = spec_scheduler(model_dir, tokenizer, algo, draft)
        assert {k: outputs(v) for k, v in run_twice(sched, reqs).items()} == want
        assert spec(sched)[1] > 0


def grammar_scheduler(model_dir, tokenizer, **kw) -> Scheduler:
    cfg = RuntimeConfig(model=str(model_dir), dtype="float32", max_total_tokens=4096, max_running_requests=16, **kw)
    runner = ModelRunner(cfg)
    sched = Scheduler(cfg, runner, tokenizer, make_backend(cfg, tokenizer, runner.vocab_size))
    if cfg.speculative_algorithm == "draft":
        sched.spec.drafter.forward_cost = 0.0  # as in spec_scheduler
    return sched


@pytest.mark.parametrize("jump_forward", [False, True])
@pytest.mark.parametrize("algo", ["ngram", "draft"])
def test_grammar_constrained_outputs_are_valid_and_unchanged(model_dir, tokenizer, algo, jump_forward):
    regex = r"(ab|cd)[a-z]{2,8}-[0-9]{3}( ok| fine){1,3}\."
    schema = ('{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, '
              '"n": {"enum": [1, 22, 333]}}, "required": ["name", "n"], "additionalProperties": false}')
    reqs = []
    for i, r in enumerate(workload(n=6)):
        constraint = {"regex": regex} if i % 2 else {"json_schema": schema}
        reqs.append(GenerateRequest(r.rid, r.input_ids, SamplingParams(max_new_tokens=60, temperature=0.0,
                                                                       **constraint)))
    draft = dict(speculative_draft_model=str(model_dir)) if algo == "draft" else {}
    want = run_twice(grammar_scheduler(model_dir, tokenizer, enable_jump_forward=jump_forward), reqs)
    sched = grammar_scheduler(model_dir, tokenizer, enable_jump_forward=jump_forward, speculative_algorithm=algo,
                              **draft)
    got = run_twice(sched, reqs)
    for phase in ("first", "again"):
        assert outputs(got[phase]) == outputs(want[phase])
        for i, r in enumerate(reqs):
            o = got[phase][r.rid]
            assert o["finish"].kind == "stop"
            text = tokenizer.decode(o["ids"][:-1])
            if i % 2:
                assert re.fullmatch(regex, text)
            else:
                value = json.loads(text)
                assert set(value) == {"name", "n"} and value["n"] in (1, 22, 333) and len(value["name"]) <= 12
    assert spec(sched)[1] > 0
    assert (sched.stats["jump_forward_tokens"] > 0) == jump_forward


def test_proposals_stop_at_a_stop_token_and_at_what_the_grammar_refuses(model_dir, tokenizer):
    sched = grammar_scheduler(model_dir, tokenizer, speculative_algorithm="ngram")
    a, b, dash = (tokenizer.encode(t, add_special_tokens=False) for t in ("ab", "b", "-"))
    sched.handle_message(GenerateRequest("g", [5, 6, 7], SamplingParams(max_new_tokens=8, regex=r"(ab)+-")))
    req = sched.rids["g"]
    while req.grammar is None:
        sched.poll_waits()
    assert sched.spec.allowed(req, a + a + b + a) == a + a  # "abab" then "b" breaks the pattern
    assert req.grammar.num_accepted == 0  # checking drafts leaves the matcher as it was
    assert sched.spec.allowed(req, a + dash + a) == a + dash  # "-" ends the match: nothing follows
    req.grammar = None
    eos = sorted(sched.output.stop_token_ids(req))[0]
    assert sched.spec.allowed(req, [9, eos, 10]) == [9, eos]


def test_a_failing_proposal_only_costs_its_request_the_drafts(model_dir, tokenizer, monkeypatch):
    reqs = workload(n=4)
    want = outputs(run_twice(make_scheduler(model_dir, tokenizer), reqs)["again"])
    sched = spec_scheduler(model_dir, tokenizer)
    real = sched.spec.drafter.propose

    def propose(req, max_tokens):
        if req.rid.startswith("r1"):
            raise RuntimeError("injected failure")
        return real(req, max_tokens)

    monkeypatch.setattr(sched.spec.drafter, "propose", propose)
    got = run_twice(sched, reqs)["again"]
    assert outputs(got) == want
    assert all(o["finish"] == FinishReason.length_limit(len(o["ids"])) for o in got.values())
    assert spec(sched)[1] > 0


def test_low_acceptance_stops_drafting_and_probes_now_and_then(model_dir, tokenizer):
    """A draft model that never agrees with the target: after its first rejections it drafts only when its
    estimate has drifted back up, a small share of the steps."""
    sched = spec_scheduler(model_dir, tokenizer, "draft", tiny_model_dir("qwen2"))
    req = GenerateRequest("r", workload()[0].input_ids, SamplingParams(max_new_tokens=120, temperature=0.0,
                                                                       ignore_eos=True))
    run(sched, [req])
    proposed, accepted = spec(sched)
    assert accepted == 0 and 0 < proposed < 0.25 * sched.stats["decode_passes"]


# ---------------------------------------------------------------- the parts


def test_adaptive_lengths_follow_the_acceptance_and_the_batch():
    costs = [adaptive.ROW_COST] * 8
    assert draft_lengths([0.9], [7], costs[:1], 64) == [7]
    assert draft_lengths([0.5], [7], costs[:1], 64) == [3]  # 0.5^3 = 0.125 still pays at batch 1, 0.5^4 not
    assert draft_lengths([0.2], [7], costs[:1], 64) == [1]
    assert draft_lengths([0.01], [7], costs[:1], 64) == [0]
    assert draft_lengths([0.9], [2], costs[:1], 64) == [2]  # never past what there is to draft
    assert draft_lengths([0.9] * 8, [7] * 8, costs, 20) == [2, 2, 2, 2, 1, 1, 1, 1]  # the row budget
    assert draft_lengths([0.5] * 8, [7] * 8, costs, 64) == [1] * 8  # at batch 8 only likelier drafts pay
    assert draft_lengths([0.2] * 8, [7] * 8, costs, 64) == [0] * 8
    assert draft_lengths([0.9, 0.2], [7, 7], costs[:2], 64) == [7, 1]
    assert draft_lengths([0.9], [7], costs[:1], 64, draft_forward_cost=1.0) == [0]  # a draft model's forwards
    assert 0 < draft_lengths([0.9], [7], costs[:1], 64, draft_forward_cost=0.3)[0] < 7


def test_rejected_drafts_make_a_request_rest_longer_each_time():
    acc = Acceptance()
    drafted = []
    for step in range(100):
        proposes = not acc.resting
        drafted += [step] * proposes
        acc.update(1 if proposes else 0, 0)
    assert drafted[:5] == [0, 2, 5, 10, 19]  # rests of 1, 2, 4, 8 steps
    assert len(drafted) <= 8 and drafted[-1] > 60
    while acc.resting:
        acc.update(0, 0)
    acc.update(2, 1)  # a probe with an accepted draft: no more rests
    assert not acc.resting and acc.backoff == 0
    acc.update(1, 0)
    assert acc.rest == 1  # they start short again
    for _ in range(5):
        acc.update(3, 3)
    assert acc.rate > 0.8


def test_suffix_index_is_incremental_and_prefers_the_longest_latest_match():
    index = NgramIndex()
    seq = [1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3]
    index.extend(seq[:5])
    index.extend(seq[5:])
    whole = NgramIndex()
    whole.extend(seq)
    assert index.tables == whole.tables
    assert index.propose(3) == [4, 9, 2]  # "1 2 3" (3 tokens) matched at the start, not "2 3" (latest: 5)
    index.extend([8])
    assert index.propose(3) == []  # "3 8" never occurred; the suffix never matches itself
    index.extend([2, 3])
    assert index.propose(2) == [8, 2]  # "2 3" last occurred right before the 8


def test_tree_continuations_are_read_only_and_namespaced():
    tree = RadixCache()
    tree.insert([1, 2, 3, 4, 5, 6], torch.arange(1, 7))
    tree.insert([1, 2, 3, 9, 9], torch.arange(7, 12))
    tree.insert([1, 2, 7], torch.arange(12, 15), namespace="other")
    before = (views.pretty_print(tree), tree.evictable_size())
    assert views.continuation(tree, [1, 2], max_tokens=8) == [3, 9, 9]  # the most recent branch
    assert views.continuation(tree, [1, 2, 3, 4], max_tokens=1) == [5]
    assert views.continuation(tree, [1, 2, 3, 4, 5, 6]) == []  # nothing follows
    assert views.continuation(tree, [2, 3]) == []  # not a prefix the tree holds
    assert views.continuation(tree, [1, 2], namespace="other") == [7]
    assert views.continuation(tree, [1, 2, 7]) == []
    assert (views.pretty_print(tree), tree.evictable_size()) == before  # no split, no refresh
    tree.match_prefix([1, 2, 3, 4])  # now the more recent branch
    assert views.continuation(tree, [1, 2], max_tokens=8) == [3, 4, 5, 6]
    paged = RadixCache(page_size=2)
    paged.insert([1, 2, 3, 4, 5, 6], torch.arange(1, 7))
    assert views.continuation(paged, [1, 2, 3]) == [4, 5, 6]  # a context ending inside a page


@pytest.mark.skipif(not (cpu.available() and cpu.lib().has_decode_step),
                    reason="the fused decode step needs the CPU kernels built with AVX512-BF16")
def test_fused_verification_is_its_decode_steps_bit_for_bit(model_dir):
    """The fused bf16 step over a verification (two requests, their last token and 5 drafts each) gives the
    logits and K/V of 6 decode steps of those tokens, bit for bit (the contexts stay split alike), and matches
    the unfused extend path."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (100, 90)]
    rows = [torch.randint(3, 49152, (6,), generator=gen).tolist() for _ in prompts]  # last token + 5 drafts

    def runner():
        return ModelRunner(RuntimeConfig(model=str(model_dir), dtype="bfloat16", max_total_tokens=1024,
                                         max_running_requests=4))

    def prefilled(r):
        kv = kv_of(r)
        for row, p in enumerate(prompts):
            kv.table.write(row, 0, kv.allocator.allocate(len(p) + 6))
        lens = [len(p) for p in prompts]
        slots = torch.cat([kv.table.table[row, :n] for row, n in enumerate(lens)])
        r.forward(ForwardInput(torch.tensor(sum(prompts, [])), torch.cat([torch.arange(n) for n in lens]), slots,
                               torch.tensor([0, 1]), [0, 0], lens, torch.tensor([lens[0] - 1, sum(lens) - 1])))
        return kv, lens

    def verify(r):
        kv, lens = prefilled(r)
        slots = torch.cat([kv.table.table[row, n:n + 6] for row, n in enumerate(lens)])
        pos = torch.cat([torch.arange(n, n + 6) for n in lens])
        logits = r.forward(ForwardInput(torch.tensor(sum(rows, [])), pos, slots, torch.tensor([0, 1]), lens, [6, 6],
                                        torch.arange(12), verify=True))
        return logits, [k.clone() for k in r.kv_pool.k_buffers]

    fused, k_fused = verify(runner())
    stepped = runner()
    kv, lens = prefilled(stepped)
    steps = []
    for j in range(6):
        slots = torch.tensor([kv.table.table[row, n + j] for row, n in enumerate(lens)])
        steps.append(stepped.forward(ForwardInput(torch.tensor([rows[0][j], rows[1][j]]),
                                                  torch.tensor([n + j for n in lens]), slots, torch.tensor([0, 1]),
                                                  [n + j for n in lens], [1, 1], torch.arange(2))))
    assert torch.equal(fused, torch.stack(steps, 1).reshape(12, -1))
    assert all(torch.equal(a, b) for a, b in zip(k_fused, stepped.kv_pool.k_buffers, strict=True))
    unfused = runner()
    unfused.fused_decode = None
    plain, _ = verify(unfused)
    assert ((fused - plain).norm() / plain.norm()).item() < 1e-2
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.9


def test_options_take_sglang_and_vllm_spellings_and_refuse_the_rest():
    import argparse

    from radixgen.common.flags import add_dataclass_flags, values_of

    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, RuntimeConfig)

    def parsed(*argv: str) -> RuntimeConfig:
        return RuntimeConfig(**values_of(RuntimeConfig, parser.parse_args(list(argv))))

    cfg = parsed("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "/m",
                 "--speculative-num-draft-tokens", "3")
    assert (cfg.speculative_algorithm, cfg.speculative_draft_model, cfg.num_speculative_tokens) == ("draft", "/m", 3)
    cfg = parsed("--speculative-algorithm", "NGRAM", "--num-speculative-tokens", "5")
    assert (cfg.speculative_algorithm, cfg.num_speculative_tokens) == ("ngram", 5)
    assert RuntimeConfig.from_kwargs(speculative_algorithm="draft_model",
                                     speculative_draft_model="/m").speculative_algorithm == "draft"
    assert RuntimeConfig().speculative_algorithm == "none"
    assert RuntimeConfig(speculative_draft_model="/m").speculative_algorithm == "draft"  # implied, as in vLLM
    for kw, message in ((dict(speculative_algorithm="eagle"), "speculative_algorithm must be one of"),
                        (dict(speculative_algorithm="draft"), "needs speculative_draft_model"),
                        (dict(speculative_algorithm="ngram", speculative_draft_model="/m"), "only used with"),
                        (dict(speculative_algorithm="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
                        (dict(speculative_algorithm="ngram", num_speculative_tokens=17), "num_speculative_tokens"),
                        (dict(speculative_algorithm="ngram", pp_size=2), "pp_size > 1"),
                        (dict(speculative_draft_model="/m", tp_size=2), "tp_size > 1")):
        with pytest.raises(ValueError, match=message):
            RuntimeConfig(**kw)


def test_the_offline_api_takes_vllms_speculative_config():
    from radixgen.offline.llm import engine_options

    assert engine_options({"speculative_config": {"method": "ngram", "num_speculative_tokens": 5}}) == {
        "speculative_algorithm": "ngram", "num_speculative_tokens": 5}
    assert engine_options({"speculative_config": {"model": "/small"}}) == {
        "speculative_algorithm": "draft_model", "speculative_draft_model": "/small"}
    assert RuntimeConfig(**engine_options({"speculative_config": {"model": "/small"}})).speculative_algorithm == \
        "draft"
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        engine_options({"speculative_config": {"method": "ngram", "prompt_lookup_max": 3}})
    with pytest.raises(ValueError, match="give a method"):
        engine_options({"speculative_config": {"num_speculative_tokens": 3}})
