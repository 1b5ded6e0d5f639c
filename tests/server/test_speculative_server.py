"""A real server with speculative decoding on (SGLang's flag spellings): per-request meta_info in SGLang's
names, the counters of /get_server_info and /metrics, streaming, n > 1, and greedy output that does not change
when the drafts come from the radix tree (the second of two identical requests)."""

from __future__ import annotations

import json

import pytest
from server_proc import start_server, stop_server

from radixgen.kernels import cpu

pytestmark = pytest.mark.slow
# Outputs equal token for token whatever the drafts were only where a verification's rows compute as single
# decode rows do: in the deterministic mode, which the server runs wherever the C kernels build. Outside it the
# default model's kernels round a row by how many rows share the call (the GGUF int4 layout's one-row path, oneDNN's
# blocking), and a request whose drafts differ may part from its twin.
EXACT = cpu.available()

PROMPT = "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    srv = start_server("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4",
                       *(["--deterministic"] if EXACT else []))
    yield srv
    assert stop_server(srv) == 0, srv.log_tail()


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


def generate(http, **body) -> dict:
    r = http.post("/generate", json={"text": PROMPT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def metric(http, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_meta_info_server_info_and_metrics_report_the_drafts(http):
    # The prompt's KV into the tree first, so that both requests below find the same cached prefix and compute the
    # same suffix (a prefill's bits follow the number of rows computed: on AMX CPUs a cold prompt runs on the tile
    # GEMM, a short suffix on the C kernels). What is compared is then the drafts' effect alone.
    generate(http, sampling_params={"max_new_tokens": 1, "temperature": 0})
    first = generate(http, sampling_params=GREEDY)
    second = generate(http, sampling_params=GREEDY)  # its drafts: the tree's continuation (the first's output)
    if EXACT:
        assert second["output_ids"] == first["output_ids"]
    meta = second["meta_info"]
    assert meta["completion_tokens"] == 24
    assert 0 < meta["spec_verify_ct"] < 23  # fewer decode steps than tokens after the first
    assert 0 < meta["spec_accept_token_num"] <= meta["spec_draft_token_num"]
    assert meta["spec_accept_length"] == pytest.approx(24 / meta["spec_verify_ct"])
    assert meta["spec_accept_rate"] == pytest.approx(meta["spec_accept_token_num"] / meta["spec_draft_token_num"])
    info = http.get("/get_server_info").json()
    spec = info["speculative"]
    assert spec["algorithm"] == "ngram" and spec["num_speculative_tokens"] == 4
    assert spec["accepted_tokens"] >= meta["spec_accept_token_num"] > 0
    assert info["stats"]["spec_draft_tokens"] == spec["draft_tokens"]
    assert info["invariant_ok"] is True
    assert metric(http, "radixgen_spec_accepted_tokens_total") >= meta["spec_accept_token_num"]
    assert metric(http, "radixgen_spec_draft_tokens_total") >= meta["spec_draft_token_num"]
    assert metric(http, "radixgen_spec_verify_steps_total") >= meta["spec_verify_ct"]


def test_streaming_gives_the_same_text(http):
    want = generate(http, sampling_params=GREEDY)["text"]
    with http.stream("POST", "/generate", json={"text": PROMPT, "sampling_params": GREEDY, "stream": True}) as r:
        assert r.status_code == 200
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    assert chunks[-1]["text"] == want
    assert chunks[-1]["meta_info"]["spec_verify_ct"] > 0


def test_n_samples_and_the_openai_api(http, server):
    out = generate(http, sampling_params={"max_new_tokens": 16, "temperature": 0.8, "n": 3, "seed": 5})
    assert len(out) == 3 and all(o["meta_info"]["completion_tokens"] > 0 for o in out)
    again = generate(http, sampling_params={"max_new_tokens": 16, "temperature": 0.8, "n": 3, "seed": 5})
    assert len(again) == 3
    if EXACT:  # seeded: reproducible
        assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]
    r = http.post("/v1/completions", json={"model": server.model, "prompt": PROMPT, "max_tokens": 12,
                                           "temperature": 0, "n": 2})
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(texts) == 2 and (texts[0] == texts[1] or not EXACT)
