"""GGUF files with expert blocks, written here from the tiny HF checkpoints with the `gguf` package under llama.cpp's
names (ffn_gate_inp, ffn_{gate,up,down}_exps stacked over the experts, Qwen2-MoE's ffn_*_shexp and
ffn_gate_inp_shexp; Mixtral as llama.cpp writes it: architecture "llama" with an expert count, Q / K rows in its
interleaved rotary order): loaded through the converted folder, our logits equal transformers' on the HF folder.
Run from the file's own blocks (quantization="gguf"), Q4_0 / Q4_1 / Q8_0 expert stacks stay in their blocks (the
grouped C layouts hold their exact values): the logits equal the dequantized file's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_model_forward import Driver, prompts, ref_logits, rel_err
from tiny_models import tiny_model_dir

from radixgen.kernels import cpu
from radixgen.runtime.config import ModelConfig, RuntimeConfig
from radixgen.runtime.executor.model_runner import ModelRunner
from radixgen.runtime.loader import read_hf_config

gguf = pytest.importorskip("gguf")

GGUF_ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama"}
BLOCK = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
         "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
         "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
         "block_sparse_moe.gate.weight": "ffn_gate_inp.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
         "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
         "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
         "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
         "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
         "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}
EXPERTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's rotary halves -> llama.cpp's interleaved pairs (what its converter does to llama Q / K rows)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_tokens() -> list[str]:
    """The 256 byte-level BPE symbols (printable bytes as themselves, the others shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def write_moe_gguf(arch: str, folder, path, types: dict | None = None) -> None:
    """`types`: (layer, projection gate / up / down / shexp) -> the GGML type its tensor is quantized to by the
    gguf package (others float32)."""
    types = types or {}
    hf, tensors = read_hf_config(folder), load_file(str(folder / "model.safetensors"))
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), GGUF_ARCH[arch])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(hf.get("head_dim") or hf["hidden_size"] // heads)
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    w.add_expert_count(hf.get("num_experts") or hf["num_local_experts"])
    w.add_expert_used_count(hf["num_experts_per_tok"])
    if arch != "mixtral":
        w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
        w.add_expert_weights_norm(hf["norm_topk_prob"])
    if arch == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(hf["shared_expert_intermediate_size"])
    # a byte-level BPE of the 256 byte tokens and one merge: reading a real 49k-token vocabulary out of a GGUF
    # takes seconds each time, and the test feeds token ids
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([*byte_tokens(), "!!"])
    w.add_token_types([1] * 257)
    w.add_token_merges(["! !"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add(name, t: torch.Tensor, kind=None):
        values = np.ascontiguousarray(t.float().numpy())
        if kind is None:
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    add("token_embd.weight", tensors["model.embed_tokens.weight"])
    add("output_norm.weight", tensors["model.norm.weight"])
    add("output.weight", tensors["lm_head.weight"])
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in sorted(tensors.items()):
        if not name.startswith("model.layers."):
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        if ".experts." in rest:
            _, e, proj, _ = rest.rsplit(".", 3)
            stacks.setdefault(f"blk.{layer}.ffn_{EXPERTS[proj]}_exps.weight", {})[int(e)] = t
            continue
        if arch == "mixtral" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            t = permute_rope(t, heads if "q_proj" in rest else kv_heads)
        shexp = types.get((int(layer), "shexp")) if rest.startswith("mlp.shared_expert.") and t.shape[-1] % 32 == 0 \
            else None  # (Q8_0 blocks of 32: the shared expert's down, 48 columns, stays float)
        add(f"blk.{layer}.{BLOCK[rest]}", t.reshape(-1) if rest == "mlp.shared_expert_gate.weight" else t, shexp)
    for name, experts in stacks.items():
        kind = types.get((int(name.split(".")[1]), name.split("_")[1]))  # blk.N.ffn_<proj>_exps.weight
        add(name, torch.stack([experts[e] for e in sorted(experts)]), kind)  # (E, out, in)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_gguf_experts_round_trip(arch, tmp_path, monkeypatch):
    import transformers as tf

    folder = tiny_model_dir(arch)  # in the shared cache; the GGUF's converted folders go beside the file
    monkeypatch.setenv("RADIXGEN_CACHE", str(tmp_path / "cache"))
    path = tmp_path / f"{arch}.gguf"
    write_moe_gguf(arch, folder, path)
    runner = ModelRunner(RuntimeConfig(model=str(path), dtype="float32", quantization="none", max_total_tokens=1024,
                                       max_running_requests=4))
    assert type(runner.model).__name__ == {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                                           "mixtral": "MixtralForCausalLM"}[arch]
    assert runner.model_config.moe == ModelConfig.from_hf(read_hf_config(folder)).moe
    ref = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ps = prompts(2, [11, 4], seed=4)
    out = Driver(runner).step({"a": ps[0], "b": ps[1]})
    assert rel_err(out["a"], ref_logits(ref, ps[0])) < 1e-4 and rel_err(out["b"], ref_logits(ref, ps[1])) < 1e-4
    if arch == "qwen2_moe":  # float stacks from the file itself: dense experts, the same logits
        native = ModelRunner(RuntimeConfig(model=str(path), dtype="float32", quantization="gguf",
                                           max_total_tokens=1024, max_running_requests=4))
        assert rel_err(Driver(native).step({"a": ps[0]})["a"], ref_logits(ref, ps[0])) < 1e-4


Q = gguf.GGMLQuantizationType
QUANTIZED_EXPERTS = {  # (layer, projection) -> type; what each expert GroupedLinear's method then is
    "qwen3_moe": ({(0, "gate"): Q.Q4_1, (0, "up"): Q.Q4_1, (0, "down"): Q.Q4_0, (1, "gate"): Q.Q4_0,
                   (1, "up"): Q.Q4_0, (1, "down"): Q.Q8_0},
                  ["gguf Q4_1 (grouped, C)", "gguf Q4_0 (grouped, C)", "gguf Q4_0 (grouped, C)",
                   "gguf Q8_0 (grouped, C)"]),
    # gate Q4_0 and up Q4_1 differ in kind: per expert on the block kernels (each part in its kind; dequantized with a
    # log line without the C kernels); the shared expert's in Q8_0 blocks
    "qwen2_moe": ({(0, "gate"): Q.Q4_0, (0, "up"): Q.Q4_1, (0, "down"): Q.Q4_1, (0, "shexp"): Q.Q8_0},
                  ["gguf Q4_0/Q4_1 (per expert, C)", "gguf Q4_1 (grouped, C)"]),
}


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_quantized_gguf_experts_run_from_their_blocks(arch, tmp_path, monkeypatch, caplog):
    """quantization="gguf": Q4_0 / Q4_1 / Q8_0 expert stacks in the grouped C layouts, their exact values (the
    logits equal the dequantized file's, float32, up to the kernels' summation order) in a fraction of the bytes."""
    import logging

    from test_gguf_native import logits_of, rel

    from radixgen.runtime.layers.quantization.experts import GroupedLinear

    folder = tiny_model_dir(arch)  # in the shared cache; the GGUF's converted folders go beside the file
    monkeypatch.setenv("RADIXGEN_CACHE", str(tmp_path / "cache"))
    path = tmp_path / f"{arch}-q.gguf"
    types, want = QUANTIZED_EXPERTS[arch]
    write_moe_gguf(arch, folder, path, types)
    kw = {"dtype": "float32", "max_total_tokens": 1024, "max_running_requests": 4}
    with caplog.at_level(logging.INFO, logger="radixgen.runtime.layers.quantization.gguf"):
        native = ModelRunner(RuntimeConfig(model=str(path), quantization="gguf", **kw))
    ref = ModelRunner(RuntimeConfig(model=str(path), quantization="none", **kw))  # dequantized at conversion
    experts = [m for m in native.model.modules() if isinstance(m, GroupedLinear)]
    got = [m.method.name for m in experts]
    if cpu.available():
        assert [("dense" if "gguf" not in g else g) for g in got] == want
    if arch == "qwen2_moe" and not cpu.available():
        assert any("ffn_gate_exps" in r.getMessage() and "dequantized" in r.getMessage() for r in caplog.records)
    if arch == "qwen2_moe" and cpu.available():
        assert "gguf Q8_0 (C)" in native.ops.linear_methods(native.model)
    # (the block kernels round their inputs to int8 per 32 values)
    assert rel(logits_of(native), logits_of(ref)) < (3e-2 if arch == "qwen2_moe" and cpu.available() else 1e-4)
    held = [m.method.nbytes(m) for m in experts]
    dense = [m.method.nbytes(m) for m in ref.model.modules() if isinstance(m, GroupedLinear)]
    assert all(h < 0.4 * d for h, d, g in zip(held, dense, got, strict=True) if "gguf" in g)  # int4: ~1/6 of f32
    if arch == "qwen3_moe":  # the torch reference of the same layouts
        torch_path = ModelRunner(RuntimeConfig(model=str(path), quantization="gguf", disable_cpu_kernels=True, **kw))
        assert rel(logits_of(torch_path), logits_of(ref)) < 1e-4
    if arch == "qwen3_moe" and cpu.available() and cpu.lib().has_decode_step:  # bf16: inside the fused step
        kw["dtype"] = "bfloat16"
        native, ref = (ModelRunner(RuntimeConfig(model=str(path), quantization=q, **kw)) for q in ("gguf", "none"))
        assert native.fused_decode is not None
        a, b = logits_of(native), logits_of(ref)  # the reference's weights rounded to bf16, ours exact: a token
        rows = sorted(rel(a[i], b[i]) for i in range(len(a)))  # near a routing tie may take another expert
        assert rows[-2] < 2e-2, rows
