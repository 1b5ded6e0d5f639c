"""`radixgen.LLM` with vLLM's LoRARequest, on the tiny Llama: an adapter loads on first use, prompts of one call
may use different adapters (and none), outputs equal PEFT's greedy ones; bad requests are refused by name."""

import pytest
from lora_helpers import base_model, greedy, make_adapter
from tiny_models import tiny_model_dir

from radixgen.offline import LLM, LoRARequest, SamplingParams

PROMPTS = [[5, 9, 13, 17, 21], [11, 12, 13, 14], [31, 32, 33]]
NEW = 5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("offline-lora")
    models = {"sql": make_adapter("llama", root / "sql", rank=4, seed=1),
              "chat": make_adapter("llama", root / "chat", rank=8, seed=2)}
    want = {None: [greedy(base_model("llama"), p, NEW) for p in PROMPTS]}
    want.update({n: [greedy(m, p, NEW) for p in PROMPTS] for n, m in models.items()})
    with LLM(str(tiny_model_dir("llama")), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
             max_model_len=512) as llm:
        yield llm, root, want


def test_lora_requests_per_prompt_equal_peft(setup):
    llm, root, want = setup
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    sql = LoRARequest("sql", 1, str(root / "sql"))
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, lora_request=sql, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want["sql"]
    chat = LoRARequest("chat", 2, str(root / "chat"))
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, lora_request=[chat, None, sql],
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [want["chat"][0], want[None][1], want["sql"][2]]
    assert set(llm.engine.lora_adapters) == {"sql", "chat"}
    outs = llm.chat([{"role": "user", "content": "hi"}], params, lora_request=sql, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == NEW


def test_bad_lora_requests_are_refused(setup):
    llm, root, _ = setup
    sql = LoRARequest("sql", 1, str(root / "sql"))
    llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=SamplingParams(max_tokens=1), lora_request=sql,
                 use_tqdm=False)
    cases = [
        (LoRARequest("other", 1, str(root / "chat")), "lora_int_id 1 is already 'sql'"),
        (LoRARequest("sql", 9, str(root / "chat")), "is loaded from"),
        (LoRARequest("new", 5), "is not loaded and has no lora_path"),
        (LoRARequest("broken", 6, str(root / "nowhere")), "no adapter_config.json"),
        ("sql", "expected a LoRARequest"),
        ([sql, sql], "got 2 for 1 prompts"),
    ]
    for lora_request, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=SamplingParams(max_tokens=1),
                         lora_request=lora_request, use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id: must be a positive integer"):
        LoRARequest("x", 0, "/p")
    out = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


def test_lora_request_without_lora_enabled():
    with LLM(str(tiny_model_dir("llama")), dtype="float32", max_model_len=256) as llm:
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            llm.generate(prompt_token_ids=PROMPTS[:1], lora_request=LoRARequest("x", 1, "/p"), use_tqdm=False)


def test_frontend_program_on_an_in_process_engine(setup):
    """The frontend's run(lora_name=...) through EngineBackend: the gen is Engine.generate's with that adapter,
    and the select's scoring runs on it too (its prefill of the prompt is a cache hit of the gen's, which only
    the adapter's own namespace holds)."""
    import radixgen as rg

    llm, root, _ = setup
    llm.generate(prompt_token_ids=PROMPTS[:1], lora_request=LoRARequest("sql", 1, str(root / "sql")), use_tqdm=False)
    engine = llm.engine
    text = engine.tokenizer.decode(PROMPTS[0])

    @rg.function
    def prog(s):
        s += text
        s += rg.gen("x", max_tokens=NEW, temperature=0, ignore_eos=True)
        s += rg.select("pick", choices=[" yes", " no"])

    sp = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    for lora in ("sql", None):
        engine.flush_cache()
        state = prog.run(backend=rg.EngineBackend(engine), lora_name=lora)
        assert state["x"] == engine.generate(text, sp, lora_path=lora)["text"]
        assert state.get_meta_info("pick")["cached_tokens"] > 0
