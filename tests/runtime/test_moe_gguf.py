"""GGUF files with expert blocks, written here from the tiny HF checkpoints with the `gguf` package under llama.cpp's
names (ffn_gate_inp, ffn_{gate,up,down}_exps stacked over the experts, Qwen2-MoE's ffn_*_shexp and
ffn_gate_inp_shexp; Mixtral as llama.cpp writes it: architecture "llama" with an expert count, Q / K rows in its
interleaved rotary order): loaded through the converted folder, our logits equal transformers' on the HF folder.
Run from the file's own blocks (quantization="gguf"), expert blocks are refused naming the combination."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_model_forward import Driver, prompts, ref_logits, rel_err
from tiny_models import tiny_model_dir

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


def write_moe_gguf(arch: str, folder, path) -> None:
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

    def add(name, t: torch.Tensor):
        w.add_tensor(name, np.ascontiguousarray(t.float().numpy()))

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
        add(f"blk.{layer}.{BLOCK[rest]}", t.reshape(-1) if rest == "mlp.shared_expert_gate.weight" else t)
    for name, experts in stacks.items():
        add(name, torch.stack([experts[e] for e in sorted(experts)]))  # (E, out, in)
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
    runner = ModelRunner(RuntimeConfig(model=str(path), dtype="float32", max_total_tokens=1024,
                                       max_running_requests=4))
    assert type(runner.model).__name__ == {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                                           "mixtral": "MixtralForCausalLM"}[arch]
    assert runner.model_config.moe == ModelConfig.from_hf(read_hf_config(folder)).moe
    ref = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ps = prompts(2, [11, 4], seed=4)
    out = Driver(runner).step({"a": ps[0], "b": ps[1]})
    assert rel_err(out["a"], ref_logits(ref, ps[0])) < 1e-4 and rel_err(out["b"], ref_logits(ref, ps[1])) < 1e-4
    if arch == "qwen2_moe":
        with pytest.raises(ValueError, match="expert blocks: quantization 'gguf' has no grouped-expert form"):
            ModelRunner(RuntimeConfig(model=str(path), quantization="gguf", max_total_tokens=256))
