"""quantization="int4": a float checkpoint's experts and linear layers quantized at load to int4 groups (fp16 scale
and offset). The oracle is the dequantized-weight model: a copy of the tiny Qwen3-MoE whose every quantized weight
is replaced by its int4 values dequantized (QuantizedWeight.int4_from, per tensor row, as the load does), run by
transformers and by us unquantized. int4 at load must give that model's logits (float32: the same weights, only the
C kernels' accumulation order differs) and its greedy tokens, through the Engine, `radixgen serve`'s flags and the
offline LLM; its experts take about a quarter of the bf16 bytes; an attention LoRA adapter over it gives PEFT's
logits on the dequantized model. Where int4 cannot run it is refused at start, as are the checkpoint formats that
have no expert kernel (AWQ, GPTQ, FP8), naming the mixture of experts."""

from __future__ import annotations

import argparse
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_model_forward import Driver, prompts, ref_logits, rel_err
from tiny_models import tiny_model_dir

from radixgen.kernels import cpu
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ModelRunner
from radixgen.runtime.layers.quantization.base import QuantizedWeight
from radixgen.runtime.layers.quantization.experts import GroupedLinear

QUANTIZED = ("_proj.weight",)  # attention q/k/v/o and the experts' gate/up/down (the router and LM head stay)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the tiny Qwen3-MoE, its dequantized-weight copy, the copy for a bf16 load: there the weights are rounded to
    bf16 before they are quantized, as a bf16 model's loaded parameters are)."""
    src = tiny_model_dir("qwen3_moe")
    root = tmp_path_factory.mktemp("int4")
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        folder = root / f"qwen3_moe-int4-dequantized-{dtype}".replace("torch.", "")
        shutil.copytree(src, folder)
        tensors = load_file(str(src / "model.safetensors"))
        for name, t in tensors.items():
            if name.endswith(QUANTIZED):
                tensors[name] = QuantizedWeight.int4_from(t.to(dtype)).dequantize().contiguous()
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        out.append(folder)
    return src, *out


def runner(folder, dtype="float32", **kw) -> ModelRunner:
    return ModelRunner(RuntimeConfig(model=str(folder), dtype=dtype, max_total_tokens=512, max_running_requests=4,
                                     **kw))


def expert_bytes(r: ModelRunner) -> int:
    return sum(m.method.nbytes(m) for m in r.model.modules() if isinstance(m, GroupedLinear))


def test_int4_logits_equal_the_dequantized_models(folders):
    import transformers as tf

    src, deq, _ = folders
    ours = runner(src, quantization="int4")
    assert ours.quantization.method == "int4" and ours.quantization.from_float
    methods = {m.method.name for m in ours.model.modules() if isinstance(m, GroupedLinear)}
    assert methods == ({"int4 (grouped, C)"} if cpu.available() else {"int4 (grouped, torch)"})
    assert "int4 (C)" in ours.ops.linear_methods(ours.model) or not cpu.available()
    ref = tf.AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    orig = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ps = prompts(2, [13, 5], seed=3)
    out = Driver(ours).step({"a": ps[0], "b": ps[1]})
    for key, p in zip("ab", ps, strict=True):
        want = ref_logits(ref, p)
        assert rel_err(out[key], want) < 1e-4
        assert rel_err(ref_logits(orig, p), want) > 1e-3  # int4 changed the weights: the oracle is not the original
    torch_path = runner(src, quantization="int4", disable_cpu_kernels=True)  # the torch reference of the layouts
    assert rel_err(Driver(torch_path).step({"a": ps[0]})["a"], ref_logits(ref, ps[0])) < 1e-4


@pytest.mark.skipif(not (cpu.available() and cpu.lib().has_decode_step), reason="needs AVX512-BF16")
def test_int4_experts_in_bf16_take_a_quarter_of_the_bytes_and_run_in_the_fused_step(folders):
    src, _, deq = folders
    ours, ref = runner(src, "bfloat16", quantization="int4"), runner(deq, "bfloat16")
    assert ours.fused_decode is not None  # the MoE layers' int4 experts inside the one C decode call
    assert expert_bytes(ours) < 0.3 * expert_bytes(ref)
    ps = prompts(1, [11], seed=5)
    a, b = Driver(ours).step({"a": ps[0]})["a"], Driver(ref).step({"a": ps[0]})["a"]
    assert rel_err(a, b) < 2e-2  # bf16 rounding of the activations (the dequantized copy's weights are exact)


def test_int4_greedy_from_serve_flags_through_the_engine_and_llm_equals_the_dequantized_model(folders):
    from radixgen.offline import LLM
    from radixgen.runtime.server.launch import add_server_args, server_args_from

    src, deq, _ = folders
    ps = prompts(2, [9, 14], seed=7)
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    import transformers as tf

    ref = tf.AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [ref.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0][len(p):]
                .tolist() for p in ps]
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = server_args_from(parser.parse_args(["--model-path", str(src), "--quantization", "int4",
                                               "--dtype", "float32", "--max-total-tokens", "512"]))
    assert args.engine["quantization"] == "int4"
    llm = LLM(**{**args.engine, "max_running_requests": 4})  # the Engine `radixgen serve` would start
    try:
        assert "int4 (from a float checkpoint)" in str(llm.engine.get_server_info())
        got = [llm.engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in ps]
        outs = llm.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert got == want
    assert [list(o.outputs[0].token_ids) for o in outs] == want


@pytest.mark.parametrize("case", ["quantized checkpoint", "cuda", "input size"])
def test_int4_is_refused_where_it_cannot_run(case, folders, tmp_path):
    src = folders[0]
    if case == "quantized checkpoint":
        with pytest.raises(ValueError, match="quantization='int4' needs a float checkpoint"):
            from radixgen.runtime.layers.quantization import resolve

            resolve("int4", {"quantization_config": {"quant_method": "awq"}})
    elif case == "cuda":
        from radixgen.runtime.layers.ops import TritonOps

        with pytest.raises(ValueError, match="int4 runs on the CPU"):
            ModelRunner(RuntimeConfig(model=str(src), dtype="float32", quantization="int4", max_total_tokens=256,
                                      max_running_requests=2), ops=TritonOps())
    else:
        with pytest.raises(ValueError, match="int4 needs input sizes that are a multiple of 32, got 129"):
            runner(tiny_model_dir("llama-odd"), quantization="int4")


def test_attention_lora_over_int4_matches_peft_on_the_dequantized_model(folders, tmp_path):
    """An attention adapter over the int4 MoE: the LoRA layers wrap the int4 C matmuls as they wrap any method."""
    import peft
    import transformers as tf
    from kv_helpers import kv_of
    from lora_helpers import make_adapter

    from radixgen.runtime.executor.model_runner import ForwardInput
    from radixgen.runtime.lora.adapter import load_lora_adapter

    src, deq, _ = folders
    make_adapter("qwen3_moe", tmp_path / "attn", targets=("q_proj", "v_proj", "o_proj"), seed=4)
    r = runner(src, quantization="int4", enable_lora=True, max_loras=1, max_lora_rank=8)
    r.lora_pool.write(0, r.lora_pool.stage(load_lora_adapter("attn", tmp_path / "attn")))
    p = prompts(1, [10], seed=9)[0]
    kv = kv_of(r)
    row, slots = kv.table.allocate(), kv.allocator.allocate(len(p))
    kv.table.write(row, 0, slots)
    got = r.forward(ForwardInput(torch.tensor(p), torch.arange(len(p)), slots, torch.tensor([row]), [0], [len(p)],
                                 torch.arange(len(p)), lora_slots=[0]))
    base = tf.AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32)
    ref = peft.PeftModel.from_pretrained(base, str(tmp_path / "attn")).eval()
    with torch.no_grad():
        want = ref(torch.tensor([p])).logits[0]
        with ref.disable_adapter():
            plain = ref(torch.tensor([p])).logits[0]
    assert rel_err(got, want) < 1e-4 and rel_err(plain, want) > 1e-3


@pytest.mark.parametrize("qc", [{"quant_method": "awq", "modules_to_not_convert": ["gate"]},
                                {"quant_method": "gptq", "bits": 4}, {"quant_method": "fp8"}, None],
                         ids=["awq", "gptq", "fp8", "fp8-at-load"])
def test_checkpoint_formats_without_expert_kernels_are_refused_at_start_naming_the_moe(qc, folders, tmp_path):
    """An AWQ / GPTQ / FP8 MoE checkpoint (or fp8 at load) is refused before its weights are read, for its experts
    (an AWQ MoE's unconverted router is not the reason given)."""
    import json

    src = folders[0]
    folder = tmp_path / "moe"
    shutil.copytree(src, folder)
    hf = json.loads((folder / "config.json").read_text())
    if qc is not None:
        hf["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(hf))
    method = (qc or {"quant_method": "fp8"})["quant_method"]
    with pytest.raises(ValueError, match=f"{method}.* of mixture-of-experts models are not supported: the experts "
                                         f"have no grouped {method} kernel"):
        runner(folder, quantization="auto" if qc is not None else "fp8")
