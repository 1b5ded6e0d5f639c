"""Embed and score requests against transformers on tiny random models: our vectors and scores against the same
weights run by transformers' own classes, with sentence-transformers' pooling rules applied by hand."""

from __future__ import annotations

import pytest
import torch
from pooling_models import bert_embed_dir, qwen3_embed_dir, qwen3_reranker_dir, xlmr_embed_dir

from radixgen.runtime.engine.core import Engine, RequestError

TEXTS = ["the cat sat on the mat", "what is the capital of france and of germany, and which river", "hello world"]
ATOL = 1e-4


def _engine(folder):
    return Engine(str(folder), dtype="float32", max_total_tokens=4096, max_running_requests=8)


def _normalize(v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(v, dim=-1)


@pytest.fixture(scope="module")
def qwen3_embed():
    # prompts of more than 8 tokens are computed in chunks: an embed request pools when its last chunk is done
    with Engine(str(qwen3_embed_dir()), dtype="float32", max_total_tokens=4096, chunked_prefill_size=8) as eng:
        yield eng


def test_bert_mean_pooling_matches_transformers():
    import transformers as tf

    folder = bert_embed_dir()
    ref = tf.BertModel.from_pretrained(folder, dtype=torch.float32).eval()
    with _engine(folder) as eng:
        got = eng.embed(TEXTS)
        with pytest.raises(RequestError, match="Matryoshka"):
            eng.embed("hello", dimensions=4)
        with pytest.raises(RequestError, match="scores"):
            eng.score("hello", ["world"])
        with pytest.raises(RequestError, match="text generation"):
            eng.generate("hello", {"max_new_tokens": 2})
    for text, out in zip(TEXTS, got, strict=True):
        enc = eng.tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            hidden = ref(**enc).last_hidden_state[0]
        want = _normalize(hidden.mean(dim=0))  # mean over the tokens, then sentence-transformers' Normalize
        assert out["prompt_tokens"] == enc["input_ids"].shape[1]
        torch.testing.assert_close(torch.tensor(out["embedding"]), want, atol=ATOL, rtol=0)


def test_xlm_roberta_cls_pooling_matches_transformers():
    import transformers as tf

    folder = xlmr_embed_dir()
    ref = tf.XLMRobertaModel.from_pretrained(folder, dtype=torch.float32).eval()
    with _engine(folder) as eng:
        got = eng.embed(TEXTS)
        tok = eng.tokenizer
    for text, out in zip(TEXTS, got, strict=True):
        with torch.no_grad():
            want = ref(**tok(text, return_tensors="pt")).last_hidden_state[0, 0]  # CLS, not normalised
        torch.testing.assert_close(torch.tensor(out["embedding"]), want, atol=ATOL, rtol=0)


def test_qwen3_embedding_last_token_matches_transformers(qwen3_embed):
    import transformers as tf

    ref = tf.Qwen3Model.from_pretrained(qwen3_embed_dir(), dtype=torch.float32).eval()
    got = qwen3_embed.embed(TEXTS)
    for text, out in zip(TEXTS, got, strict=True):
        ids = qwen3_embed.tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            want = _normalize(ref(input_ids=ids).last_hidden_state[0, -1])
        torch.testing.assert_close(torch.tensor(out["embedding"]), want, atol=ATOL, rtol=0)
    # Matryoshka: the first 8 dimensions, renormalised
    short = qwen3_embed.embed(TEXTS[0], dimensions=8)["embedding"]
    torch.testing.assert_close(torch.tensor(short), _normalize(torch.tensor(got[0]["embedding"][:8])), atol=ATOL,
                               rtol=0)
    # the sentence-transformers prompt is an instruction prefix
    q = qwen3_embed.embed("the cat", prompt_name="query")
    assert q["embedding"] == pytest.approx(qwen3_embed.embed("Instruct: find the answer\nQuery:the cat")["embedding"],
                                           abs=ATOL)
    with pytest.raises(RequestError, match="prompt_name"):
        qwen3_embed.embed("x", prompt_name="nope")
    with pytest.raises(RequestError, match="text generation"):
        qwen3_embed.generate("hello", {"max_new_tokens": 2})


def test_token_arrays_and_the_radix_cache(qwen3_embed):
    ids = qwen3_embed.tokenize(["the cat sat on the mat and the dog sat too"])[0]
    first = qwen3_embed.embed(input_ids=ids)
    again = qwen3_embed.embed(input_ids=[ids, ids[:-2]])
    assert again[0]["cached_tokens"] == len(ids) - 1  # the whole prompt but its last token from the tree
    assert again[0]["embedding"] == pytest.approx(first["embedding"], abs=ATOL)
    assert again[1]["prompt_tokens"] == len(ids) - 2


def test_decoder_reranker_scores_generates_and_embeds_over_one_cache():
    """A Qwen3-Reranker-style causal LM: yes/no scores as transformers computes them; it generates too, and its
    embed requests reuse generation's prompt from the radix cache."""
    import transformers as tf

    folder = qwen3_reranker_dir()
    ref = tf.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    docs = ["paris is the capital of france", "bread and apples"]
    prompt = "the cat sat on the mat and looked at the dog"
    with _engine(folder) as eng:
        got = eng.score("capital of france?", docs, instruction="find the city")
        no, yes = eng.pooling.score_tokens
        prompts = [r.input_ids for r in eng._pooling.score_requests("capital of france?", docs, "find the city",
                                                                     None, None)[1]]
        eng.generate(prompt, {"max_new_tokens": 2, "temperature": 0})
        emb = eng.embed(prompt)
        ids = eng.tokenizer(prompt, return_tensors="pt").input_ids
    assert got[1]["cached_tokens"] > 0  # the instruction and query prefix: once in the radix cache
    for i, p in enumerate(prompts):
        with torch.no_grad():
            logits = ref(input_ids=torch.tensor([p])).logits[0, -1]
        want = torch.softmax(logits[[no, yes]], dim=0)[1].item()
        assert got[i]["score"] == pytest.approx(want, abs=ATOL)
    assert emb["cached_tokens"] == ids.shape[1] - 1  # generation's prompt, reused
    with torch.no_grad():
        want = _normalize(ref.model(input_ids=ids).last_hidden_state[0, -1])
    torch.testing.assert_close(torch.tensor(emb["embedding"]), want, atol=ATOL, rtol=0)


def test_dsl_embed_on_the_engine_backend(qwen3_embed):
    import radixgen as rg
    from radixgen.lang.backend_engine import EngineBackend

    @rg.function
    def doc(s, topic):
        s += "the " + topic + " sat on the mat"
        s += rg.embed("vec")
        s += rg.embed("short", dimensions=8)

    state = doc.run(topic="cat", backend=EngineBackend(qwen3_embed))
    want = qwen3_embed.embed("the cat sat on the mat")["embedding"]
    assert state["vec"] == pytest.approx(want, abs=ATOL)
    assert len(state["short"]) == 8
    assert state.get_meta_info("vec")["prompt_tokens"] > 0
    with pytest.raises(ValueError, match="name"):
        rg.embed(None)
