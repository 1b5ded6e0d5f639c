"""The offline API's vLLM-shaped parameters map onto the runtime's native ones (no model needed)."""

import json

import pytest

from radixgen.common.sampling_params import SamplingParams as NativeParams
from radixgen.offline import GuidedDecodingParams, SamplingParams
from radixgen.offline.llm import engine_options


def test_defaults_and_mapping_are_valid_native_params():
    p = SamplingParams()
    native = p.native(prompt_len=5, context_length=100)
    assert native["max_new_tokens"] == 16 and native["top_k"] == -1  # vLLM's defaults
    NativeParams.from_dict(native)  # the runtime accepts every field
    unbounded = SamplingParams(max_tokens=None, stop="x", include_stop_str_in_output=True)
    n = unbounded.native(prompt_len=30, context_length=100)
    assert n["max_new_tokens"] == 70 and n["stop"] == "x" and n["no_stop_trim"] is True
    assert NativeParams.from_dict(n).stop == ["x"]


@pytest.mark.parametrize(
    "guided, native",
    [
        (GuidedDecodingParams(json={"type": "object"}), {"json_schema": json.dumps({"type": "object"})}),
        (GuidedDecodingParams(json='{"type": "string"}'), {"json_schema": '{"type": "string"}'}),
        (GuidedDecodingParams(json_object=True), {"json_schema": json.dumps({"type": "object"})}),
        (GuidedDecodingParams(regex="[a-z]+"), {"regex": "[a-z]+"}),
        (GuidedDecodingParams(choice=["yes", "no"]), {"choices": ["yes", "no"]}),
        (GuidedDecodingParams(grammar='root ::= "a"'), {"ebnf": 'root ::= "a"'}),
    ],
)
def test_guided_decoding_maps_to_one_native_constraint(guided, native):
    for params in (SamplingParams(guided_decoding=guided), SamplingParams(structured_outputs=guided)):
        out = params.native(1, 100)
        assert {k: out[k] for k in native} == native
        assert NativeParams.from_dict(out).constraint is not None


def test_pydantic_model_as_schema():
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str

    out = SamplingParams(guided_decoding={"json": City}).native(1, 100)
    assert json.loads(out["json_schema"])["properties"]["name"]["type"] == "string"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: SamplingParams(allowed_token_ids=[3]), "allowed_token_ids"),
        (lambda: SamplingParams(best_of=3), "best_of"),
        (lambda: SamplingParams(detokenize=False), "detokenize"),
        (lambda: SamplingParams(logprobs=-1), "logprobs"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(guided_decoding=GuidedDecodingParams(regex="a"),
                                structured_outputs=GuidedDecodingParams(regex="b")), "not both"),
        (lambda: GuidedDecodingParams(), "exactly one"),
        (lambda: GuidedDecodingParams(regex="a", choice=["a"]), "exactly one"),
        (lambda: GuidedDecodingParams(choice="ab"), "choice"),
        (lambda: GuidedDecodingParams(regex="a", backend="outlines"), "backend"),
    ],
)
def test_unsupported_options_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_vllm_engine_argument_names():
    assert engine_options({"max_model_len": 2048, "enforce_eager": True, "enable_prefix_caching": False,
                           "max_num_seqs": 8, "trust_remote_code": True, "tensor_parallel_size": 2,
                           "pipeline_parallel_size": 1}) == {
        "context_length": 2048, "disable_cuda_graph": True, "disable_radix_cache": True, "max_running_requests": 8,
        "tp_size": 2, "pp_size": 1}
