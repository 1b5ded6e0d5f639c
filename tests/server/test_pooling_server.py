"""The pooling routes on a real server subprocess: the openai client's embeddings.create, /v1/rerank and
/v1/score with httpx, Ollama's /api/embed, the docs' client example, and bad bodies -> 400 in each API's shape."""

from __future__ import annotations

import math
import re
from pathlib import Path

import httpx
import pytest
from pooling_models import bert_cross_dir, qwen3_embed_dir
from server_proc import start_server, stop_server

DOC = Path(__file__).resolve().parents[2] / "docs" / "api-embeddings.md"


@pytest.fixture(scope="module")
def embed_server():
    srv = start_server("--model", str(qwen3_embed_dir()), "--max-total-tokens", "4096", "--dtype", "float32",
                       "--shutdown-grace-s", "1", api_key=None)
    yield srv
    assert stop_server(srv) == 0, srv.log_tail()


@pytest.fixture(scope="module")
def rerank_server():
    srv = start_server("--model", str(bert_cross_dir()), "--dtype", "float32", "--shutdown-grace-s", "1",
                       api_key=None)
    yield srv
    assert stop_server(srv) == 0, srv.log_tail()


def _openai_error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_openai_client_embeddings(embed_server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{embed_server.url}/v1", api_key="none")
    out = client.embeddings.create(model=embed_server.model, input=["the cat sat", "hello world"])  # base64
    floats = client.embeddings.create(model=embed_server.model, input=["the cat sat", "hello world"],
                                      encoding_format="float")
    assert [d.index for d in out.data] == [0, 1]
    for a, b in zip(out.data, floats.data, strict=True):
        assert len(a.embedding) == 64
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)  # float32 on the wire vs JSON floats
        assert math.isclose(sum(x * x for x in b.embedding), 1.0, rel_tol=1e-4)  # normalised
    assert out.usage.prompt_tokens == out.usage.total_tokens > 0
    short = client.embeddings.create(model=embed_server.model, input="the cat sat", dimensions=16,
                                     encoding_format="float")
    assert len(short.data[0].embedding) == 16
    ids = client.embeddings.create(model=embed_server.model, input=[[5, 6, 7], [8, 9]], encoding_format="float")
    assert len(ids.data) == 2 and ids.usage.prompt_tokens == 5


def test_bad_embedding_bodies(embed_server):
    with embed_server.client() as c:
        assert _openai_error(c.post("/v1/embeddings", json={"model": "m"}))["param"] == "input"
        _openai_error(c.post("/v1/embeddings", json={"input": "x", "encoding_format": "int8"}))
        _openai_error(c.post("/v1/embeddings", json={"input": "x", "dimensions": 0}))
        _openai_error(c.post("/v1/embeddings", json={"input": "x", "dimensions": 65}))
        _openai_error(c.post("/v1/embeddings", json={"input": []}))
        _openai_error(c.post("/v1/embeddings", json={"input": [[1, 10**9]]}))
        _openai_error(c.post("/v1/embeddings", json={"input": "x", "bogus": 1}))
        # an embedding model refuses generation and rerank clearly
        err = _openai_error(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}))
        assert "does not generate" in err["message"] and "/v1/embeddings" in err["message"]
        _openai_error(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}))
        assert "scores" in _openai_error(c.post("/v1/rerank", json={"query": "q", "documents": ["d"]}))["message"]
        assert c.get("/health").status_code == 200
        assert c.get("/health_generate").json() == {"status": "ok"}  # an embed request end to end


def test_ollama_embed(embed_server):
    with embed_server.client() as c:
        r = c.post("/api/embed", json={"model": "m", "input": ["the cat", "a dog"]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "m" and len(body["embeddings"]) == 2 and len(body["embeddings"][0]) == 64
        oa = c.post("/v1/embeddings", json={"input": "the cat"}).json()["data"][0]["embedding"]
        assert body["embeddings"][0] == pytest.approx(oa, abs=1e-6)
        bad = c.post("/api/embed", json={"input": "x"})
        assert bad.status_code == 400 and "model" in bad.json()["error"]
        long = "the cat sat on the mat " * 400  # past the context length: cut to fit, or refused
        assert len(c.post("/api/embed", json={"model": "m", "input": long}).json()["embeddings"]) == 1
        refused = c.post("/api/embed", json={"model": "m", "input": long, "truncate": False})
        assert refused.status_code == 400 and "context length" in refused.json()["error"]


def test_rerank_and_score(rerank_server):
    docs = ["paris is the capital of france", "the dog sat on the mat", "rain and sun"]
    with rerank_server.client() as c:
        r = c.post("/v1/rerank", json={"query": "what capital france", "documents": docs, "top_n": 2})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert len(results) == 2
        assert results[0]["relevance_score"] >= results[1]["relevance_score"]
        assert results[0]["document"]["text"] == docs[results[0]["index"]]
        full = c.post("/v1/rerank", json={"query": "what capital france", "documents": [{"text": d} for d in docs],
                                          "return_documents": False}).json()["results"]
        assert sorted(x["index"] for x in full) == [0, 1, 2] and "document" not in full[0]
        s = c.post("/v1/score", json={"text_1": "what capital france", "text_2": docs})
        assert s.status_code == 200, s.text
        by_index = {x["index"]: x["relevance_score"] for x in full}
        _against_transformers("what capital france", docs, by_index)
        assert [d["score"] for d in s.json()["data"]] == pytest.approx([by_index[i] for i in range(3)], abs=1e-6)
        pairs = c.post("/v1/score", json={"text_1": ["q one", "q two"], "text_2": ["d one", "d two"]}).json()
        assert [d["index"] for d in pairs["data"]] == [0, 1]
        _openai_error(c.post("/v1/rerank", json={"query": "q", "documents": []}))
        _openai_error(c.post("/v1/rerank", json={"query": "q", "documents": ["d"], "top_n": 0}))
        _openai_error(c.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}))
        assert "embeddings" in _openai_error(c.post("/v1/embeddings", json={"input": "x"}))["message"]
        _openai_error(c.post("/generate", json={"text": "hi"}))
        assert c.get("/health_generate").json() == {"status": "ok"}  # a score request end to end


def _against_transformers(query: str, docs: list[str], scores: dict[int, float]) -> None:
    """The cross-encoder's scores: the sigmoid of transformers' BertForSequenceClassification logit."""
    import torch
    import transformers as tf

    folder = bert_cross_dir()
    ref = tf.BertForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tok = tf.AutoTokenizer.from_pretrained(folder)
    for i, doc in enumerate(docs):
        with torch.no_grad():
            logit = ref(**tok(query, doc, return_tensors="pt")).logits[0, 0]
        assert scores[i] == pytest.approx(torch.sigmoid(logit).item(), abs=1e-4)
    assert len({round(s, 6) for s in scores.values()}) > 1  # the documents are told apart


def test_generative_model_embeds_and_refuses_rerank(server):
    """The session's server (the default generative model): it embeds, and it is no reranker."""
    with server.client() as c:
        out = c.post("/v1/embeddings", json={"input": ["hello", "hello world"]})
        assert out.status_code == 200, out.text
        assert len(out.json()["data"]) == 2 and len(out.json()["data"][0]["embedding"]) == 576
        err = _openai_error(c.post("/v1/rerank", json={"query": "q", "documents": ["d"]}))
        assert "scores (rerank)" in err["message"]
        _openai_error(c.post("/v1/score", json={"text_1": "q", "text_2": "d"}))


def test_docs_client_examples(embed_server, rerank_server, capsys):
    embed_code, rerank_code = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    exec(compile(embed_code.replace("http://127.0.0.1:30000", embed_server.url), str(DOC), "exec"), {})
    lines = capsys.readouterr().out.split("\n")
    assert lines[0].split()[:2] == ["2", "64"] and lines[1] == "64" and lines[2] == "64"
    exec(compile(rerank_code.replace("http://127.0.0.1:30000", rerank_server.url), str(DOC), "exec"), {})
    index, score, text = capsys.readouterr().out.strip().split(" ", 2)
    assert index in ("0", "1") and 0.0 <= float(score) <= 1.0 and text.endswith(("france", "mat"))


def test_dsl_embed_over_http(embed_server):
    import radixgen as rg

    @rg.function
    def doc(s):
        s += "the cat sat on the mat"
        s += rg.embed("vec", dimensions=16)

    state = doc.run(backend=rg.RuntimeEndpoint(embed_server.url))
    with embed_server.client() as c:
        want = c.post("/v1/embeddings", json={"input": "the cat sat on the mat", "dimensions": 16}).json()
    assert state["vec"] == pytest.approx(want["data"][0]["embedding"], abs=1e-6)
    assert state.get_meta_info("vec")["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert want["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the program's text, from the radix cache
