"""The newer architectures (sliding windows, soft-caps, sinks, sandwich norms, fused projections, layers without
rotary): tiny random checkpoints written by transformers' own classes, our float32 forward over the paged pool
against transformers' (a prompt longer than the window prefilled in two chunks, the second after a cached prefix
longer than the window; batched greedy decode past the window), and through the scheduler with a shared prefix
longer than the window (radix-cache hits), chunk boundaries inside the window, and greedy ids equal to
transformers' generate one prompt at a time."""

from __future__ import annotations

import pytest
import torch
from test_model_forward import Driver, prompts, ref_logits, rel_err
from test_scheduler import make_scheduler, run
from tiny_models import WINDOW, tiny_window_model_dir

from radixgen.common.sampling_params import SamplingParams
from radixgen.kernels import cpu
from radixgen.runtime.config import ModelConfig, RuntimeConfig
from radixgen.runtime.executor.cpu_decode import FusedDecode
from radixgen.runtime.executor.cuda_graph_runner import graph_unsafe
from radixgen.runtime.executor.model_runner import ModelRunner
from radixgen.runtime.loader import load_tokenizer, read_hf_config
from radixgen.runtime.scheduler.request import GenerateRequest

ARCHS = ["mistral-window", "qwen2-window", "gemma2", "gemma3", "phi3", "smollm3", "gpt_oss", "deepseek_v2"]
# each layer's window as our config reads it from the transformers-written config.json
WINDOWS = {"mistral-window": (WINDOW, WINDOW), "qwen2-window": (0, WINDOW), "gemma2": (WINDOW, 0),
           "gemma3": (WINDOW, 0), "phi3": (), "smollm3": (), "gpt_oss": (WINDOW, 0),
           "deepseek_v2": ()}
TOL = 1e-4
STEPS = WINDOW + 2  # greedy decode steps: the shorter prompt (WINDOW - 2 tokens) ends past its window


def reference(folder):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def greedy_ref(ref, p: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return ref.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0][len(p):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_each_layers_window_read_from_the_config(arch):
    mc = ModelConfig.from_hf(read_hf_config(tiny_window_model_dir(arch)))
    assert mc.sliding_windows == WINDOWS[arch]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    folder = tiny_window_model_dir(request.param)
    runner = ModelRunner(RuntimeConfig(model=str(folder), dtype="float32", max_total_tokens=1024,
                                       max_running_requests=4))
    return runner, reference(folder)


def test_logits_and_batched_greedy_match_transformers(pair):
    runner, ref = pair
    if runner.model_config.sliding_windows:  # the masked path: no fused decode step, no CUDA graphs
        why = FusedDecode.supports(runner.model.decoder_structure(), 1024)
        assert why is not None and graph_unsafe(runner.model) is not None
        if runner.model_config.architecture == "llama":  # Mistral's layer 0: nothing else stops it
            assert "a sliding window of 6" in why and "a sliding window of 6" in graph_unsafe(runner.model)
    d = Driver(runner, seed=3)
    a, b = prompts(2, [3 * WINDOW + 3, WINDOW - 2], seed=7)
    cut = 2 * WINDOW - 1  # a's second chunk starts after a prefix longer than the window, mid-window
    out = d.step({"a": a[:cut], "b": b})
    out.update(d.step({"a": a[cut:]}))
    assert rel_err(out["a"], ref_logits(ref, a)[cut:]) < TOL and rel_err(out["b"], ref_logits(ref, b)) < TOL
    seqs, last = {"a": list(a), "b": list(b)}, {"a": out["a"][-1], "b": out["b"][-1]}
    rows = {"a": [], "b": []}
    for _ in range(STEPS):  # b's decode slides past its window too
        last = d.greedy(last, seqs)
        for k in seqs:
            rows[k].append(last[k])
    for k, p in (("a", a), ("b", b)):
        assert seqs[k][len(p):] == greedy_ref(ref, p, STEPS)
        # each decode step's logits against transformers' over the whole sequence, in one forward
        assert rel_err(torch.stack(rows[k]), ref_logits(ref, seqs[k])[len(p):]) < TOL


def test_deepseek_v2_pool_holds_the_compressed_latent():
    """One KV "head" per token and layer: kv_lora_rank + qk_rope_head_dim values, half in K and half in V."""
    runner = ModelRunner(RuntimeConfig(model=str(tiny_window_model_dir("deepseek_v2")), dtype="float32",
                                       max_total_tokens=64, max_running_requests=1))
    hf = runner.hf_config
    k = runner.kv_pool.k_buffers[0]
    assert k.shape[1:] == (1, (hf["kv_lora_rank"] + hf["qk_rope_head_dim"]) // 2)
    assert runner.kv_pool.v_buffers[0].shape == k.shape


def test_only_the_rows_that_become_logits(pair):
    """The last layer computes only the kept rows (ctx.keep_rows): the masked path's rows are the same."""
    runner, ref = pair
    d = Driver(runner, seed=5)
    (a,) = prompts(1, [2 * WINDOW + 1], seed=9)
    kept = d.step({"a": a}, keep=[3, 2 * WINDOW])["kept"]
    want = ref_logits(ref, a)
    assert rel_err(kept, want[[3, 2 * WINDOW]]) < TOL


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v2"])
def test_through_the_scheduler_with_cache_hits_and_chunks_inside_the_window(arch):
    """A shared head longer than the window (cached after the first request), prefill chunks of 5 (boundaries
    inside the window), requests diverging after the window slid: greedy ids equal transformers' one at a time.
    (DeepSeek-V2: the same over its cached latents.)"""
    folder = tiny_window_model_dir(arch)
    gen = torch.Generator().manual_seed(31)
    head = torch.randint(3, 49152, (3 * WINDOW + 2,), generator=gen).tolist()
    ps = [head + torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (2, 9)]
    sched = make_scheduler(folder, load_tokenizer(str(folder)), chunked_prefill_size=5, max_total_tokens=512,
                           max_running_requests=4)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    first = run(sched, [GenerateRequest("r0", ps[0], params)])
    rest = run(sched, [GenerateRequest(f"r{i}", p, params) for i, p in enumerate(ps) if i])
    ref = reference(folder)
    for i, p in enumerate(ps):
        assert {**first, **rest}[f"r{i}"]["ids"] == greedy_ref(ref, p, 8)
    assert rest["r1"]["cached"] >= len(head)


def test_mxfp4_codes_dequantize_to_their_values():
    from radixgen.runtime.models.gpt_oss import FP4_VALUES, dequantize_mxfp4

    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 2, 32), generator=gen)  # (rows, groups, 32 codes)
    exps = torch.randint(120, 134, (3, 2), generator=gen)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # the low nibble first
    want = torch.tensor(FP4_VALUES)[codes] * torch.exp2(exps.float() - 127).unsqueeze(-1)
    got = dequantize_mxfp4(blocks, exps.to(torch.uint8), torch.float32)
    assert torch.equal(got, want.reshape(3, 64))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, exps[:, :1].to(torch.uint8), torch.float32)


def test_gpt_oss_mxfp4_experts_from_their_blocks(tmp_path):
    """A checkpoint whose experts are MXFP4 blocks (the published layout: (E, out, G, 16) and (E, out, G), with
    quantization_config mxfp4) gives the logits of the same values in the bf16 layout: exactly under the torch ops
    (dequantized at load); on the C kernels kept in their blocks, within the int8 rounding of the inputs."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from radixgen.runtime.models.gpt_oss import FP4_VALUES

    src = tiny_window_model_dir("gpt_oss")
    gen = torch.Generator().manual_seed(4)
    dense, packed = tmp_path / "dense", tmp_path / "mxfp4"
    for d in (dense, packed):
        shutil.copytree(src, d)
    (f,) = src.glob("*.safetensors")
    tensors = load_file(f)
    dense_t, packed_t = dict(tensors), dict(tensors)
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, n_in, n_out = t.shape  # (E, in, out): the blocks run along `in`
            codes = torch.randint(0, 16, (e, n_out, n_in), generator=gen)
            exps = torch.randint(122, 128, (e, n_out, n_in // 32), generator=gen)
            scale = torch.exp2(exps.float() - 127)[..., None]
            values = torch.tensor(FP4_VALUES)[codes].view(e, n_out, n_in // 32, 32) * scale
            dense_t[name] = values.view(e, n_out, n_in).transpose(1, 2).contiguous()
            grouped = codes.view(e, n_out, n_in // 32, 32)
            packed_t[name + "_blocks"] = (grouped[..., 0::2] | (grouped[..., 1::2] << 4)).to(torch.uint8)
            packed_t[name + "_scales"] = exps.to(torch.uint8)
            del packed_t[name]
    save_file(dense_t, dense / f.name, metadata={"format": "pt"})
    save_file(packed_t, packed / f.name, metadata={"format": "pt"})
    cfg = json.loads((packed / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (packed / "config.json").write_text(json.dumps(cfg))
    (a,) = prompts(1, [9], seed=2)
    runners = [ModelRunner(RuntimeConfig(model=str(d), dtype="float32", max_total_tokens=64, max_running_requests=1,
                                         **kw)) for d in (dense, packed) for kw in ({}, {"disable_cpu_kernels": True})]
    logits = [Driver(r).step({"a": a})["a"] for r in runners]
    assert torch.equal(logits[3], logits[1])  # the torch ops: the blocks dequantized at load, the same values
    if not cpu.available():
        return
    # the C kernels: the blocks kept (repacked into GGUF's layout), one matmul per expert on int8 inputs
    for ours, theirs in zip(runners[2].model.layers, runners[0].model.layers, strict=True):
        for g, ref in ((ours.mlp.experts.gate_up, theirs.mlp.experts.gate_up),
                       (ours.mlp.experts.down, theirs.mlp.experts.down)):
            assert g.method.name == "gguf MXFP4 (per expert, C)"
            assert g.method.nbytes(g) == g.num_experts * g.out_features * g.in_features // 32 * 17
            x, counts = torch.randn(7, g.in_features, generator=gen), [2, 0, 4, 1]
            want = torch.cat([x[s:s + n] @ ref.method.dequantize(ref, e).T
                              for e, (s, n) in enumerate(zip([0, 2, 2, 6], counts, strict=True))])
            assert rel_err(g(x, counts), want) < 2e-2  # the inputs' int8 rounding
            assert all(torch.equal(g.method.dequantize(g, e), ref.method.dequantize(ref, e)) for e in range(4))
    assert rel_err(logits[2], logits[0]) < 6e-2


# HF names -> llama.cpp's block names (its phi3 files keep the fused projections)
GGUF_BLOCK = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.o_proj.weight": "attn_output.weight", "mlp.down_proj.weight": "ffn_down.weight",
              "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",
              "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
              "mlp.up_proj.weight": "ffn_up.weight"}


@pytest.mark.parametrize("arch", ["phi3"])
def test_gguf_files_in_llama_cpps_layout(arch, tmp_path, monkeypatch):
    """A GGUF file as llama.cpp writes the architecture (Phi-3: fused qkv and gate_up tensors) gives transformers'
    logits of the folder."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    from safetensors.torch import load_file
    from test_moe_gguf import byte_tokens

    folder = tiny_window_model_dir(arch)
    monkeypatch.setenv("RADIXGEN_CACHE", str(tmp_path / "cache"))
    hf, tensors = read_hf_config(folder), load_file(str(folder / "model.safetensors"))
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([*byte_tokens(), "!!"])
    w.add_token_types([1] * 257)
    w.add_token_merges(["! !"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, gname in (("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"),
                        ("lm_head.weight", "output.weight")):
        w.add_tensor(gname, np.ascontiguousarray(tensors[name].numpy()))
    for name, t in sorted(tensors.items()):
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            w.add_tensor(f"blk.{layer}.{GGUF_BLOCK[rest]}", np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    runner = ModelRunner(RuntimeConfig(model=str(path), dtype="float32", quantization="none", max_total_tokens=64,
                                       max_running_requests=1))
    (a,) = prompts(1, [11], seed=6)
    assert rel_err(Driver(runner).step({"a": a})["a"], ref_logits(reference(folder), a)) < TOL


def _cfg(**kw) -> dict:
    return {"architectures": ["MistralForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "max_position_embeddings": 4096, **kw}


def test_window_fields_of_older_configs_and_what_is_refused():
    """transformers 4's fields (no layer_types): Gemma 2's even layers, Gemma 3's pattern, Qwen2's
    max_window_layers, Mistral's every layer; a window no context fills is none; unknown kinds are refused."""
    def windows(**kw):
        return ModelConfig.from_hf(_cfg(**kw)).sliding_windows

    assert windows(sliding_window=8) == (8, 8, 8, 8)
    assert windows(sliding_window=4096) == windows(sliding_window=None) == ()
    assert windows(sliding_window=8, architectures=["Gemma2ForCausalLM"], model_type="gemma2") == (8, 0, 8, 0)
    assert windows(sliding_window=8, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                   sliding_window_pattern=2) == (8, 0, 8, 0)
    assert windows(sliding_window=8, architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                   max_window_layers=3) == (0, 0, 0, 8)
    assert windows(sliding_window=8, architectures=["Qwen2ForCausalLM"], use_sliding_window=False) == ()
    with pytest.raises(ValueError, match="chunked_attention"):
        windows(sliding_window=8, layer_types=["chunked_attention"] * 4)
    with pytest.raises(ValueError, match="layer_types has 2 entries"):
        windows(sliding_window=8, layer_types=["full_attention"] * 2)
    with pytest.raises(ValueError, match="'longrope'"):
        ModelConfig.from_hf(_cfg(rope_scaling={"rope_type": "longrope", "factor": 2.0}))


def test_the_triton_wired_runner_with_a_window_layer_matches_the_cpu_runner():
    """The CUDA path's wiring (TritonOps; under the interpreter without a GPU): Qwen2's full layer 0 on the Triton
    kernels, its window layer 1 on the masked path, prefill and decode."""
    pytest.importorskip("triton")
    from radixgen.runtime.layers.ops import TritonOps

    cfg = RuntimeConfig(model=str(tiny_window_model_dir("qwen2-window")), dtype="float32", max_total_tokens=256,
                        max_running_requests=2)
    drivers = [Driver(ModelRunner(cfg, ops=TritonOps())), Driver(ModelRunner(cfg))]
    a, b = prompts(2, [WINDOW + 3, 3], seed=11)
    steps = [{"a": a, "b": b}] + [{"a": [t], "b": [t + 1]} for t in (5, 6, 7)]  # then three decode steps
    for step in steps:
        got, want = (d.step(step) for d in drivers)
        for k in step:
            assert rel_err(got[k], want[k]) < TOL
