"""The native API speaks SGLang's wire protocol: every field of SGLang's `/generate` is accepted (those of
features radixgen lacks only when empty), types are strict, batches and n > 1 have SGLang's shapes, streams
carry per-chunk output logprobs, and the routes SGLang's clients call exist. Against a real server."""

from __future__ import annotations

import json

import pytest

from radixgen.runtime.server.native_api import space_special_tokens, special_tokens_pattern
from radixgen.runtime.server.native_protocol import GenerateRequest, is_empty, parse_sampling_params

pytestmark = pytest.mark.slow

PROMPT = "Count: 1, 2, 3,"
GREEDY = {"max_new_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


def events(http, body: dict) -> list:
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [x[len("data: "):] for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def error_of(r) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


# ---------------------------------------------------------------- the protocol's fields


def test_every_sglang_field_is_accepted_at_its_default(http):
    """All of SGLang's GenerateReqInput and SamplingParams fields, at SGLang's own defaults, in one body."""
    sampling = pytest.importorskip("sglang.srt.sampling.sampling_params", reason="sglang is not installed")
    internal = {"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized",
                "ebnf_full_assistant"}  # SamplingParams' own state, not API fields
    params = {}
    for name in sampling.SamplingParams.__struct_fields__:
        if name not in internal:
            params[name] = _default_of(sampling.SamplingParams, name)
    params.update(max_new_tokens=2, temperature=0.0)
    body = _generate_req_input_defaults()
    assert len(body) > 50 and "lora_path" in body and "return_routed_experts" in body
    body.update(text=PROMPT, sampling_params=params)
    body = json.loads(json.dumps(body, default=list))  # sets (stop_token_ids) as JSON lists
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 2


def _generate_req_input_defaults() -> dict:
    """GenerateReqInput's fields and defaults, read from SGLang's source: its module imports the whole
    multimodal server stack (torchvision...), which the compatibility install leaves out."""
    import ast
    import importlib.util
    from pathlib import Path

    origin = Path(importlib.util.find_spec("sglang").origin).parent / "srt" / "managers" / "io_struct.py"
    tree = ast.parse(origin.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput")
    out = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            value = node.value
            if isinstance(value, ast.Call):  # field(default=..., kw_only=True)
                value = next((k.value for k in value.keywords if k.arg == "default"), None)
            try:
                out[node.target.id] = ast.literal_eval(value) if value is not None else None
            except ValueError:
                out[node.target.id] = None
    return out


def _default_of(struct, name: str):
    i = struct.__struct_fields__.index(name)
    defaults = struct.__struct_defaults__
    value = defaults[i - (len(struct.__struct_fields__) - len(defaults))]
    return None if type(value).__name__ == "_Nothing" or callable(value) else value


def test_what_the_sglang_client_sends(http):
    body = {
        "text": PROMPT,
        "sampling_params": {"skip_special_tokens": True, "spaces_between_special_tokens": True,
                            "max_new_tokens": 3, "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [],
                            "stop_regex": [], "temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                            "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False,
                            "regex": None, "json_schema": None},
        "return_logprob": None, "logprob_start_len": None, "top_logprobs_num": None, "lora_path": None,
        "session_id": None, "return_routed_experts": False,
    }
    out = http.post("/generate", json=body).json()
    assert out["meta_info"]["completion_tokens"] == 3 and out["meta_info"]["e2e_latency"] > 0


@pytest.mark.parametrize(
    "body,feature",
    [
        ({"image_data": "data:image/png;base64,AAAA"}, "image"),
        ({"lora_path": "my-adapter"}, "LoRA"),
        ({"lora_path": [None, "a"], "text": ["x", "y"]}, "LoRA"),
        ({"return_hidden_states": True}, "hidden states"),
        ({"custom_logit_processor": "{}"}, "custom logit processor"),
        ({"session_params": {"id": "s"}}, "sessions"),
        ({"token_ids_logprob": [1, 2]}, "token_ids_logprob"),
        ({"sampling_params": {"custom_params": {"k": 1}}}, "custom_params"),
        ({"sampling_params": {"structural_tag": "{}"}}, "structural tags"),
        ({"sampling_params": {"beam_width": 4}}, "beam search"),
        ({"data_parallel_rank": 1}, "data-parallel"),
    ],
)
def test_a_missing_feature_is_named(http, body, feature):
    err = error_of(http.post("/generate", json={"text": "x", **body}))
    assert feature in err["message"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"text": "x", "sampling_params": {"max_new_tokens": "10"}}, "max_new_tokens"),
        ({"text": "x", "sampling_params": {"temperature": "0.5"}}, "temperature"),
        ({"text": "x", "sampling_params": {"ignore_eos": 1}}, "ignore_eos"),
        ({"input_ids": [True, 5]}, "input_ids"),
        ({"text": "x", "return_logprob": "yes"}, "return_logprob"),
        ({"text": "x", "stream": 1}, "stream"),
        ({"text": 5}, "text"),
        ({"text": "x", "sampling_params": {"n": 129}}, "n"),  # capped as the OpenAI API caps it
        ({"text": "x", "no_such_field": 1}, "no_such_field"),  # in no version of the protocol
        ({"text": "x", "sampling_params": {"no_such_param": 1}}, "no_such_param"),
    ],
)
def test_strict_types_and_unknown_fields(http, body, param):
    err = error_of(http.post("/generate", json=body))
    assert err["param"] == param, err
    assert http.get("/health").status_code == 200


def test_empty_values_and_the_model():
    assert is_empty(None) and is_empty([None, None]) and is_empty(False) and is_empty({}) and is_empty([])
    assert not is_empty("x") and not is_empty([None, "a"]) and not is_empty(0.5)
    with pytest.raises(ValueError, match="list needs a batch"):
        GenerateRequest.model_validate({"text": "a", "rid": ["a", "b"]})
    with pytest.raises(ValueError, match="distinct"):
        GenerateRequest.model_validate({"text": ["a", "b"], "rid": ["r", "r"]})
    p = parse_sampling_params({"stop_regex": ["a+", "b"], "sampling_seed": 7, "regex": ""})
    d = p.to_engine(None, 100)
    assert d["stop_regex"] == ["a+", "b"] and d["seed"] == 7 and "regex" not in d
    assert "stop_regex" not in parse_sampling_params({"stop_regex": []}).to_engine(None, 100)
    assert parse_sampling_params({"max_new_tokens": None}).to_engine(30, 100)["max_new_tokens"] == 70
    with pytest.raises(ValueError, match="same parameter"):
        parse_sampling_params({"seed": 1, "sampling_seed": 2})


# ---------------------------------------------------------------- behaviour of the implemented fields


def test_spaces_between_special_tokens():
    from radixgen.runtime.loader import load_tokenizer

    tok = load_tokenizer()
    pattern = special_tokens_pattern(tok)
    ids = tok("<|im_start|>user\nhi<|im_end|><|im_end|>").input_ids
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == "<|im_start|>user\nhi<|im_end|><|im_end|>"  # the fast tokenizer joins them as they are
    spaced = space_special_tokens(pattern, text)
    assert spaced == "<|im_start|> user\nhi <|im_end|> <|im_end|>"
    for cut in range(len(ids)):  # streamed text grows by whole tokens: its prefixes stay prefixes
        head = tok.decode(ids[:cut], skip_special_tokens=False)
        assert spaced.startswith(space_special_tokens(pattern, head))


def test_stop_regex_list(http):
    out = http.post("/generate", json={"text": PROMPT, "sampling_params": {
        **GREEDY, "max_new_tokens": 8, "stop_regex": ["[0-9]", "zzz"]}}).json()
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "stop" and reason["matched"].isdigit(), out


def test_batch_shapes_rids_and_per_prompt_values(http):
    out = http.post("/generate", json={
        "text": [PROMPT, "Hello"], "rid": ["first-rid", "second-rid"], "return_logprob": [True, False],
        "sampling_params": [{**GREEDY, "max_new_tokens": 2}, {**GREEDY, "max_new_tokens": 3}],
    }).json()
    assert [o["meta_info"]["id"] for o in out] == ["first-rid", "second-rid"]
    assert [o["meta_info"]["completion_tokens"] for o in out] == [2, 3]
    assert len(out[0]["meta_info"]["output_token_logprobs"]) == 2
    assert out[0]["meta_info"]["output_token_logprobs_length"] == 2
    assert "output_token_logprobs" not in out[1]["meta_info"]
    n = http.post("/generate", json={"text": [PROMPT, "Hi"], "sampling_params": {"max_new_tokens": 2, "n": 3}})
    assert len(n.json()) == 6  # prompt-major, then the samples


def test_stream_chunks_carry_new_logprobs_only(http):
    chunks = events(http, {"text": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
                           "sampling_params": {**GREEDY, "max_new_tokens": 8}})
    total, prev = 0, 0
    for c in chunks:
        meta = c["meta_info"]
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - prev
        assert len(meta["output_top_logprobs"]) == len(meta["output_token_logprobs"])
        total += len(meta["output_token_logprobs"])
        prev = meta["completion_tokens"]
    assert total == chunks[-1]["meta_info"]["completion_tokens"] == 8
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert chunks[-1]["meta_info"]["e2e_latency"] > 0


def test_stream_interval_and_batched_streams(http):
    chunks = events(http, {"text": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 7,
                                                               "ignore_eos": True, "stream_interval": 3}})
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts[-1] == 7 and all(b - a >= 3 for a, b in zip([0, *counts[:-2]], counts[:-1], strict=True))
    many = events(http, {"text": [PROMPT, "Hello"], "sampling_params": {**GREEDY, "n": 2}})
    finals = {c["index"]: c for c in many if c["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2, 3]
    assert finals[0]["text"] == finals[1]["text"]  # greedy: both samples of the first prompt agree


def test_prompt_token_ids_and_open_ended_max_new_tokens(http):
    ids = http.post("/tokenize", json={"text": "Is the sky blue?"}).json()["tokens"]
    out = http.post("/generate", json={"text": "Is the sky blue?", "return_prompt_token_ids": True,
                                       "sampling_params": {"max_new_tokens": None, "regex": "(yes|no)"}}).json()
    assert out["prompt_token_ids"] == ids and out["text"] in ("yes", "no")


def test_extra_key_namespaces_the_cache(http):
    prompt = "A sentence long enough to be cached in the radix tree, about the sea. " * 3
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 1}}
    http.post("/generate", json={**body, "extra_key": "tenant-a"})
    same = http.post("/generate", json={**body, "extra_key": "tenant-a"}).json()["meta_info"]
    other = http.post("/generate", json={**body, "extra_key": "tenant-b"}).json()["meta_info"]
    assert same["cached_tokens"] > 0 and other["cached_tokens"] == 0


# ---------------------------------------------------------------- routes


def test_routes_sglang_clients_call(http):
    for path in ("/server_info", "/get_server_info"):
        info = http.get(path).json()
        assert info["internal_states"][0]["cache"]["total"] > 0 and info["version"]
    assert http.get("/flush_cache").json() == {"success": True}
    assert http.post("/flush_cache?timeout=5").json() == {"success": True}
    load = http.get("/get_load").json()
    assert load[0]["num_reqs"] == 0 and load[0]["dp_rank"] == 0
    info = http.get("/model_info").json()
    assert info["model_path"] == http.get("/get_model_info").json()["model_path"]
    r = http.post("/concate_and_append_request", json={"src_rids": ["a", "b"], "dst_rid": "c"})
    assert r.json()["success"] is True
    assert error_of(http.post("/concate_and_append_request", json={"src_rids": [], "dst_rid": "c"}))
    sg = http.post("/v1/tokenize", json={"prompt": ["a", "b c"], "model": "default"}).json()
    assert sg["count"] == [1, 2] and len(sg["tokens"]) == 2 and sg["max_model_len"] > 0
    text = http.post("/detokenize", json={"tokens": [sg["tokens"][1], sg["tokens"][0]]}).json()
    assert text == {"text": ["b c", "a"]}
    assert http.post("/abort_request", json={"abort_all": True}).json()["aborted"] is False
