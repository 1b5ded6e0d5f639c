"""A mixture of experts with the rest of the runtime: through the Engine (scheduler, paged KV, radix cache) with
ngram speculation, the scheduler with a draft model (the MoE itself drafting) and with shared prefixes and
chunked prefill (Qwen2-MoE), greedy tokens equal transformers'; over an 8-bit KV cache the logits stay near the
float pool's."""

from __future__ import annotations

import pytest
import torch
from test_model_forward import Driver, prompts, rel_err
from test_scheduler import run
from tiny_models import tiny_model_dir

from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.engine import Engine
from radixgen.runtime.executor.model_runner import ModelRunner


@pytest.fixture(scope="module")
def reference():
    """Prompts (two share a prefix) and transformers' 24 greedy tokens after each."""
    import transformers as tf

    folder = tiny_model_dir("qwen3_moe")
    gen = torch.Generator().manual_seed(21)
    shared = torch.randint(3, 49152, (10,), generator=gen).tolist()
    ps = [shared + [7, 7, 9, 7, 7, 9], shared + torch.randint(3, 49152, (5,), generator=gen).tolist()]
    ref = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [ref.generate(torch.tensor([p]), max_new_tokens=24, min_new_tokens=24, do_sample=False)[0][len(p):]
                .tolist() for p in ps]
    return folder, ps, want


def test_ngram_speculation_gives_transformers_greedy_tokens(reference):
    folder, ps, want = reference
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    with Engine(model=str(folder), dtype="float32", max_total_tokens=1024, max_running_requests=4,
                speculative_algorithm="ngram") as e:
        # the first prompt again last: ngram drafts it from what the first request generated
        got = [e.generate(input_ids=p, sampling_params=params)["output_ids"] for p in (*ps, ps[0])]
        info = e.get_server_info()["speculative"]
    assert got == [*want, want[0]]
    assert info["draft_tokens"] > 0 and info["accepted_tokens"] > 0


def test_the_moe_as_its_own_draft_model_gives_transformers_greedy_tokens(reference):
    from test_speculative import spec, spec_scheduler

    from radixgen.common.sampling_params import SamplingParams
    from radixgen.runtime.loader import load_tokenizer
    from radixgen.runtime.scheduler.request import GenerateRequest

    folder, ps, want = reference
    sched = spec_scheduler(folder, load_tokenizer(str(folder)), "draft", draft=folder, max_total_tokens=1024,
                           max_running_requests=4)  # its draft forwards counted free, so that it drafts
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    got = run(sched, [GenerateRequest(f"r{i}", p, params) for i, p in enumerate(ps)])
    assert [got[f"r{i}"]["ids"] for i in range(len(ps))] == want
    assert spec(sched)[0] > 0 and spec(sched)[1] > 0


def test_qwen2_moe_through_the_scheduler_gives_transformers_greedy_tokens():
    """Shared prefixes (radix-cache hits), chunked prefill and batched decode over the shared expert's model."""
    import transformers as tf
    from test_scheduler import make_scheduler

    from radixgen.common.sampling_params import SamplingParams
    from radixgen.runtime.loader import load_tokenizer
    from radixgen.runtime.scheduler.request import GenerateRequest

    folder = tiny_model_dir("qwen2_moe")
    gen = torch.Generator().manual_seed(31)
    head = torch.randint(3, 49152, (20,), generator=gen).tolist()
    ps = [head + torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (2, 9, 5)]
    sched = make_scheduler(folder, load_tokenizer(str(folder)), chunked_prefill_size=16, max_total_tokens=1024,
                           max_running_requests=4)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    first = run(sched, [GenerateRequest("r0", ps[0], params)])
    rest = run(sched, [GenerateRequest(f"r{i}", p, params) for i, p in enumerate(ps) if i])
    ref = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for i, p in enumerate(ps):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False)[0]
        assert ({**first, **rest}[f"r{i}"]["ids"]) == want[len(p):].tolist()
    assert all(rest[f"r{i}"]["cached"] >= 20 for i in (1, 2))


def test_an_8bit_kv_cache_stays_near_the_float_pool():
    folder = tiny_model_dir("qwen3_moe")
    runners = [ModelRunner(RuntimeConfig(model=str(folder), dtype="float32", max_total_tokens=512,
                                         max_running_requests=2, kv_cache_dtype=kv)) for kv in ("auto", "int8")]
    ps = prompts(1, [14], seed=8)
    a, b = (Driver(r).step({"a": ps[0]})["a"] for r in runners)
    assert 0 < rel_err(b, a) < 0.05


def test_a_draft_model_the_targets_weight_format_cannot_load_is_refused_naming_the_draft():
    """The draft takes the target's config (quantization included): an MoE run from a .gguf file's blocks with a
    safetensors draft is refused at start naming the draft, not as if the target's checkpoint were wrong."""
    import dataclasses

    from radixgen.runtime.loader import load_tokenizer
    from radixgen.runtime.scheduler.speculative.draft_model import DraftModelDrafter

    folder, draft = tiny_model_dir("qwen3_moe"), tiny_model_dir("llama")
    cfg = RuntimeConfig(model=str(folder), dtype="float32", max_total_tokens=256, max_running_requests=2,
                        speculative_algorithm="draft", speculative_draft_model=str(draft))
    target = ModelRunner(cfg)
    with pytest.raises(ValueError, match=r"speculative_draft_model .*quantization='gguf'.*needs a \.gguf file"):
        DraftModelDrafter(dataclasses.replace(cfg, quantization="gguf"), target, load_tokenizer(str(folder)), None,
                          lambda req: ())
