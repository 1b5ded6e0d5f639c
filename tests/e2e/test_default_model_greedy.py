"""The bundled default model, dequantized (quantization="none", transformers' weights): our greedy output equals
transformers' greedy generate, token for token. The default (its own blocks) against this:
test_gguf_native_greedy.py."""

from __future__ import annotations

import pytest
import torch

from radixgen.runtime.engine import Engine
from radixgen.runtime.loader import resolve_model_path

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prompt_ids():
    from radixgen.runtime.loader import load_tokenizer

    tok = load_tokenizer(None)
    return [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            for m in PROMPTS]


def test_greedy_matches_transformers_fp32(prompt_ids):
    import transformers as tf

    ref = tf.AutoModelForCausalLM.from_pretrained(resolve_model_path(None), dtype=torch.float32).eval()
    expected = []
    for ids in prompt_ids:
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(ids):].tolist())
    del ref
    with Engine(dtype="float32", quantization="none") as eng:  # the dequantized file: transformers' weights
        got = eng.generate(input_ids=prompt_ids, sampling_params={
            "max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True})
        assert eng.get_server_info()["invariant_ok"]
    for g, e in zip(got, expected, strict=True):
        assert g["output_ids"] == e
        assert g["meta_info"]["completion_tokens"] == NEW_TOKENS
