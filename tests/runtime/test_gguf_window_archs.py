"""GGUF files of gpt-oss, Gemma 2, Gemma 3 and SmolLM3 as llama.cpp writes them, made here with the `gguf`
package from tiny random checkpoints built with transformers' own classes: loaded (converted, and for gpt-oss also
from the file's own blocks), our logits equal transformers' on the HF folder of the same weights.

- gpt-oss: the post-attention norm, o's bias, the sinks, the router's bias, and the experts split by llama.cpp
  into gate / up / down stacks ((E, I, hidden) and (E, hidden, I)) of MXFP4 blocks with a bias each; the HF
  folder holds the MXFP4 blocks' exact values, so the file and the folder are one model;
- Gemma: the norms stored as 1 + w; the query scale and window pattern llama.cpp implies;
- SmolLM3: Llama's layout (Q / K rows interleaved), every 4th layer without rotary; the tokenizer read from the
  file's fields (transformers refuses the file).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_gguf_more import mapped
from test_model_forward import Driver, prompts, ref_logits, rel_err
from test_moe_gguf import byte_tokens, permute_rope
from tiny_models import WINDOW, copy_default_tokenizer, hf_config

from radixgen.kernels import cpu
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ModelRunner

gguf = pytest.importorskip("gguf")
MXFP4 = gguf.GGMLQuantizationType.MXFP4
TOL = 1e-4

BLOCK = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
         "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
         "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
         "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
         "self_attn.o_proj.bias": "attn_output.bias", "self_attn.sinks": "attn_sinks.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
         "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight"}
POST_ATTENTION = {"gpt_oss": "post_attention_norm.weight", "gemma2": "post_attention_norm.weight",
                  "gemma3": "post_attention_norm.weight", "smollm3": "ffn_norm.weight"}
GEMMA_NORMS = {"pre_feedforward_layernorm.weight": "ffn_norm.weight",
               "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


def mxfp4_exact(t: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """(the values of `t`'s MXFP4 blocks along its last dim, the blocks as the gguf package writes them)."""
    blocks = gguf.quants.quantize(np.ascontiguousarray(t.float().numpy()), MXFP4)
    return torch.from_numpy(gguf.quants.dequantize(blocks, MXFP4).copy()), blocks


def tiny_folder(arch: str, tmp_path):
    """A tiny random checkpoint of `arch` (tests/tiny_models.py's config; Gemma's query scale the head size, as
    llama.cpp's files imply), every vector drawn at random too; gpt-oss's experts rounded to MXFP4 values."""
    import transformers as tf

    cfg = hf_config(arch)
    if arch.startswith("gemma"):
        cfg.query_pre_attn_scalar = cfg.head_dim
    torch.manual_seed(99)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08 if p.dim() >= 2 else 0.2)
    folder = tmp_path / arch
    model.save_pretrained(folder)
    copy_default_tokenizer(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    if arch == "gpt_oss":  # the experts' values exactly what the MXFP4 blocks hold
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            tensors[name] = mxfp4_exact(tensors[name].transpose(1, 2))[0].transpose(1, 2).contiguous()
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, tensors


def write_gguf(arch: str, folder, tensors: dict, path) -> None:
    import json

    hf = json.loads((folder / "config.json").read_text())
    g_arch = {"gpt_oss": "gpt-oss"}.get(arch, arch)
    w = gguf.GGUFWriter(str(path), g_arch)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    if arch != "smollm3":
        w.add_sliding_window(WINDOW)
    rope = hf["rope_parameters"]
    if arch == "gpt_oss":
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_expert_count(hf["num_local_experts"])
        w.add_expert_used_count(hf["num_experts_per_tok"])
        w.add_expert_feed_forward_length(hf["intermediate_size"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif arch in ("gemma2", "smollm3"):
        w.add_rope_freq_base(rope["rope_theta"])
    if arch == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", hf["attn_logit_softcapping"])
        w.add_float32("gemma2.final_logit_softcapping", hf["final_logit_softcapping"])
    if arch == "gemma3":  # the global layers' base and scaling; the local base llama.cpp's default (10k)
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["full_attention"]["factor"])
        w.add_array("gemma3.attention.sliding_window_pattern", [t == "sliding_attention" for t in hf["layer_types"]])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    ends = ["<|return|>", "<|call|>"] if arch == "gpt_oss" else []  # harmony's ends of a turn (control tokens)
    w.add_token_list([*byte_tokens(), "!!", *ends])
    w.add_token_types([1] * 257 + [3] * len(ends))
    w.add_token_merges(["! !"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    plus = 1.0 if arch.startswith("gemma") else 0.0  # llama.cpp stores Gemma's norms as 1 + w

    def add(name: str, t: torch.Tensor) -> None:
        w.add_tensor(name, np.ascontiguousarray(t.float().numpy()))

    add("token_embd.weight", tensors["model.embed_tokens.weight"])
    add("output_norm.weight", tensors["model.norm.weight"] + plus)
    if "lm_head.weight" in tensors:
        add("output.weight", tensors["lm_head.weight"])
    for name, t in sorted(tensors.items()):
        if not name.startswith("model.layers."):
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        blk = f"blk.{layer}."
        if rest == "post_attention_layernorm.weight":
            add(blk + POST_ATTENTION[arch], t + plus)
        elif rest in GEMMA_NORMS:
            add(blk + GEMMA_NORMS[rest], t + plus)
        elif rest == "input_layernorm.weight" or rest.endswith(("q_norm.weight", "k_norm.weight")):
            add(blk + BLOCK[rest], t + plus)
        elif rest == "mlp.experts.gate_up_proj":  # (E, hidden, 2I), gate / up interleaved -> (E, I, hidden) each
            for part, cols in (("gate", t[..., 0::2]), ("up", t[..., 1::2])):
                blocks = mxfp4_exact(cols.transpose(1, 2))[1]
                w.add_tensor(f"{blk}ffn_{part}_exps.weight", blocks, raw_dtype=MXFP4)
        elif rest == "mlp.experts.down_proj":  # (E, I, hidden) -> (E, hidden, I)
            w.add_tensor(f"{blk}ffn_down_exps.weight", mxfp4_exact(t.transpose(1, 2))[1], raw_dtype=MXFP4)
        elif rest == "mlp.experts.gate_up_proj_bias":
            add(f"{blk}ffn_gate_exps.bias", t[:, 0::2])
            add(f"{blk}ffn_up_exps.bias", t[:, 1::2])
        elif rest == "mlp.experts.down_proj_bias":
            add(f"{blk}ffn_down_exps.bias", t)
        elif arch == "smollm3" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            heads = hf["num_attention_heads" if "q_proj" in rest else "num_key_value_heads"]
            add(blk + BLOCK[rest], permute_rope(t, heads))  # llama.cpp's interleaved rotary rows
        else:
            add(blk + BLOCK[rest], t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _runner(path, **kw) -> ModelRunner:
    return ModelRunner(RuntimeConfig(model=str(path), dtype="float32", max_total_tokens=128, max_running_requests=2,
                                     **kw))


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma2", "gemma3", "smollm3"])
def test_llama_cpp_layout_gives_transformers_logits(arch, tmp_path, monkeypatch):
    import transformers as tf

    folder, tensors = tiny_folder(arch, tmp_path)  # (its tokenizer: the default model's, in the shared cache)
    monkeypatch.setenv("RADIXGEN_CACHE", str(tmp_path / "cache"))  # the GGUF's converted folders
    path = tmp_path / f"{arch}.gguf"
    write_gguf(arch, folder, tensors, path)
    ref = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    a, b = prompts(2, [2 * WINDOW + 3, 4], seed=5)  # past the window
    runner = _runner(path)
    windows = () if arch == "smollm3" else tuple(WINDOW if t == "sliding_attention" else 0
                                                 for t in ref.config.layer_types)
    assert runner.model_config.sliding_windows == windows
    out = Driver(runner).step({"a": a, "b": b})
    # gpt-oss's MXFP4 experts run from their blocks on the C kernels (auto): their inputs rounded to int8 per 32
    tol = 3e-3 if arch == "gpt_oss" and cpu.available() else TOL
    assert rel_err(out["a"], ref_logits(ref, a)) < tol and rel_err(out["b"], ref_logits(ref, b)) < tol
    if arch == "gpt_oss":  # the eos token and harmony's ends of a turn stop generation
        assert runner.model_config.eos_token_ids == (2, 257, 258)
    if arch == "gpt_oss":  # from the file's own blocks: the MXFP4 stacks as stored, one matmul per expert
        native = _runner(path, quantization="gguf")
        experts = native.model.layers[0].mlp.experts
        if cpu.available():
            assert experts.gate_up.method.name == experts.down.method.name == "gguf MXFP4 (per expert, C)"
            ranges = mapped(path.resolve())  # the blocks are views of the file's map: nothing copied
            assert all(any(lo <= w.data.data_ptr() < hi for lo, hi in ranges)
                       for ws in experts.down.gguf_experts for w in ws)
        assert rel_err(Driver(native).step({"a": a})["a"], ref_logits(ref, a)) < 3e-3
