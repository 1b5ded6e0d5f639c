"""Mixtures of experts (models/moe_block.py, layers/moe.py): tiny random Qwen3-MoE, Qwen2-MoE (a shared expert, a
dense layer by mlp_only_layers) and Mixtral checkpoints written by transformers, against transformers' forward in
float32 over the paged KV pool (prefill, a cached prefix, greedy decode); the routing rules against transformers'
router classes; routing edge cases (every token on one expert, experts with no token) against transformers'
expert loop; int8 experts against their dequantized weights; expert-parallel shards summing to the whole block;
the fused checkpoint layout; int8 experts in the deterministic mode; and what is refused with a mixture of experts
(GGUF-block or AWQ experts, MLP LoRA adapters)."""

from __future__ import annotations

import pytest
import torch
from kv_helpers import kv_of
from safetensors.torch import load_file, save_file
from test_model_forward import Driver, prompts, ref_logits, rel_err
from tiny_models import hf_config, tiny_model_dir

from radixgen.kernels import cpu
from radixgen.runtime.config import ModelConfig, RuntimeConfig
from radixgen.runtime.executor.cuda_graph_runner import graph_unsafe
from radixgen.runtime.executor.model_runner import ModelRunner
from radixgen.runtime.ground.parallel_context import ParallelContext
from radixgen.runtime.layers.moe import MoERouting, experts_forward, route
from radixgen.runtime.layers.quantization.experts import GroupedLinear, QuantizedGroupedLinear, grouped_method
from radixgen.runtime.loader import read_hf_config
from radixgen.runtime.lora.adapter import LoRAAdapterError
from radixgen.runtime.models.moe_block import SparseMoEBlock
from radixgen.runtime.models.parts import MOE_GATED_SILU

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]
TOL = 1e-4


def runner_of(folder, **kw) -> ModelRunner:
    return ModelRunner(RuntimeConfig(model=str(folder), dtype="float32", max_total_tokens=2048,
                                     max_running_requests=4, **kw))


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    import transformers as tf

    folder = tiny_model_dir(request.param)
    ref = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return runner_of(folder), ref


def test_logits_and_greedy_match_transformers(pair):
    runner, ref = pair
    layers = runner.model.decoder_structure()
    kinds = [layer.mlp.kind for layer in layers]
    moe = runner.model_config.moe
    assert kinds == [MOE_GATED_SILU if i in moe.sparse_layers else "dense_gated_silu" for i in range(len(layers))]
    assert graph_unsafe(runner.model) is not None and runner.fused_decode is None  # layer by layer
    d = Driver(runner, seed=3)
    a, b = prompts(2, [21, 6], seed=7)
    out = d.step({"a": a[:9], "b": b})  # a's first chunk, then the rest after a cached prefix
    out.update(d.step({"a": a[9:]}))
    assert rel_err(out["a"], ref_logits(ref, a)[9:]) < TOL and rel_err(out["b"], ref_logits(ref, b)) < TOL
    seqs, last = {"a": list(a), "b": list(b)}, {"a": out["a"][-1], "b": out["b"][-1]}
    for _ in range(16):
        last = d.greedy(last, seqs)
        for k in seqs:
            assert rel_err(last[k], ref_logits(ref, seqs[k])[-1]) < TOL
    for k, p in (("a", a), ("b", b)):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, min_new_tokens=16)[0]
        assert seqs[k] == want.tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_routing_rules_match_the_references(arch):
    import transformers as tf

    cfg = hf_config(arch)
    router = {"qwen3_moe": tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter,
              "qwen2_moe": tf.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter,
              "mixtral": tf.models.mixtral.modeling_mixtral.MixtralTopKRouter}[arch](cfg)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    _, want_w, want_ids = router(x)
    moe = ModelConfig.from_hf(cfg.to_dict() | {"architectures": [type(router).__name__.replace("TopKRouter",
                                                                                               "ForCausalLM")]}).moe
    w, ids = route(x @ router.weight.t(), MoERouting(moe.num_experts, moe.top_k, True, moe.norm_topk_prob))
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
    assert torch.allclose(w, want_w.float(), atol=1e-6)
    assert torch.allclose(w.sum(-1), torch.ones(40)) == moe.norm_topk_prob  # Qwen2-MoE's do not sum to 1
    after = route(x @ router.weight.t(), MoERouting(moe.num_experts, moe.top_k, False))  # top-k, then softmax
    assert torch.equal(after[1], ids) and torch.allclose(after[0].sum(-1), torch.ones(40))


def grouped(e: int, h: int, i: int, seed: int) -> tuple[GroupedLinear, GroupedLinear]:
    gen = torch.Generator().manual_seed(seed)
    gate_up, down = GroupedLinear(e, h, 2 * i), GroupedLinear(e, i, h)
    gate_up.weight.data.normal_(0, 0.2, generator=gen)
    down.weight.data.normal_(0, 0.2, generator=gen)
    return gate_up, down


def transformers_experts(gate_up: GroupedLinear, down: GroupedLinear):
    """transformers' Qwen2-MoE expert loop over the same weights (the oracle)."""
    import transformers as tf

    cfg = tf.Qwen2MoeConfig(hidden_size=gate_up.in_features, moe_intermediate_size=down.in_features,
                            num_experts=gate_up.num_experts)
    ex = tf.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeExperts(cfg)
    ex.gate_up_proj.data.copy_(gate_up.weight.data)
    ex.down_proj.data.copy_(down.weight.data)
    return ex


@pytest.mark.parametrize("case", ["one_expert_takes_all", "idle_experts", "one_token"])
def test_routing_edge_cases_match_the_transformers_expert_loop(case):
    gate_up, down = grouped(6, 16, 12, seed=1)
    gen = torch.Generator().manual_seed(2)
    t = 1 if case == "one_token" else 9
    x = torch.randn(t, 16, generator=gen)
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(t)]).to(torch.int32)
    if case == "one_expert_takes_all":  # every token's first choice is expert 4; expert 0 gets none
        ids[:, 0] = 4
        ids[:, 1] = torch.tensor([1, 2, 3, 5] * 3)[:t].to(torch.int32)
    if case == "idle_experts":  # experts 0, 2, 3, 5 get no token
        ids = torch.tensor([[1, 4], [4, 1]] * 4 + [[1, 4]], dtype=torch.int32)
    w = torch.softmax(torch.randn(t, 2, generator=gen), -1)
    got = experts_forward(x, w, ids, gate_up, down)
    with torch.no_grad():
        want = transformers_experts(gate_up, down)(x, ids.long(), w)
    assert got.shape == (t, 16) and torch.allclose(got, want, atol=1e-5)
    # a token's result does not depend on the others routed with it
    assert torch.allclose(experts_forward(x[-1:], w[-1:], ids[-1:], gate_up, down), got[-1:], atol=1e-6)


def test_int8_experts_match_their_dequantized_reference():
    gate_up, down = grouped(4, 32, 24, seed=3)
    q_gate_up, q_down = grouped(4, 32, 24, seed=3)
    for layer in (q_gate_up, q_down):
        layer.method = grouped_method("int8")
        layer.process_weights()
    assert isinstance(q_gate_up.method, QuantizedGroupedLinear) and q_gate_up.weight is None
    for dense, quant in ((gate_up, q_gate_up), (down, q_down)):  # the dequantized reference, as dense weights
        dense.weight.data.copy_(torch.stack([quant.method.dequantize(quant, e) for e in range(4)]))
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(11, 32, generator=gen)
    w, ids = route(torch.randn(11, 4, generator=gen), MoERouting(4, 2, True, True))
    assert torch.allclose(experts_forward(x, w, ids, q_gate_up, q_down), experts_forward(x, w, ids, gate_up, down),
                          atol=1e-5)


def test_bf16_on_the_cpu_kernels_matches_transformers_bf16(pair):
    """The attention, norms and shared expert on the C kernels / packed bf16 weights, the experts in bf16, against
    transformers in bf16 (not float32: bf16 rounding flips near-tied routing choices, the reference's too)."""
    import transformers as tf

    runner, _ = pair
    bf16 = ModelRunner(RuntimeConfig(model=str(runner.model_path), dtype="bfloat16", max_total_tokens=512,
                                     max_running_requests=2))
    ref = tf.AutoModelForCausalLM.from_pretrained(runner.model_path, dtype=torch.bfloat16).eval()
    p = prompts(1, [13], seed=1)[0]
    got, want = Driver(bf16).step({"a": p})["a"].float(), ref_logits(ref, p)
    assert rel_err(got, want) < 0.03 and (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8


def test_int8_experts_through_the_model():
    folder = tiny_model_dir("qwen2_moe")
    plain, q8 = runner_of(folder), runner_of(folder, quantization="int8")
    block = next(m for m in q8.model.modules() if isinstance(m, SparseMoEBlock))
    assert block.experts.gate_up.method.name.startswith("int8")
    from radixgen.runtime.layers.quantization import weight_bytes

    dense_experts = next(m for m in plain.model.modules() if isinstance(m, SparseMoEBlock)).experts
    assert 0 < weight_bytes(block.experts) < 0.3 * weight_bytes(dense_experts)  # int8 values and scales, counted
    ps = prompts(1, [12], seed=2)
    a, b = Driver(plain).step({"a": ps[0]})["a"], Driver(q8).step({"a": ps[0]})["a"]
    assert rel_err(b, a) < 0.05 and (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("tp,ep", [(2, 2), (2, 1), (4, 2)])
def test_expert_parallel_shards_sum_to_the_whole_block(tp, ep):
    """Each rank's experts (1/ep of them, 1/(tp/ep) of their columns) as the layout splits them: their partial
    sums add up to the one-rank block's routed output (what the tp all-reduce combines)."""
    folder = tiny_model_dir("qwen3_moe")
    mc = ModelConfig.from_hf(read_hf_config(folder))
    tensors = load_file(str(folder / "model.safetensors"))
    prefix = "model.layers.0.mlp."

    def block(par: ParallelContext) -> SparseMoEBlock:
        b = SparseMoEBlock(mc, par, 0)
        mapping = runner_arch.weights
        for name, t in tensors.items():
            if name.startswith(prefix + "experts."):
                ours, shard = mapping.parameter(name.removeprefix("model.layers.0."))
                param = dict(b.named_parameters())[ours.removeprefix("mlp.")]
                param.weight_loader(param, t, shard)
        return b

    from radixgen.runtime.models.qwen3_moe import QWEN3_MOE as runner_arch

    whole = block(ParallelContext())
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(13, mc.hidden_size, generator=gen)
    w, ids = route(torch.randn(13, mc.moe.num_experts, generator=gen), whole.routing)
    want = experts_forward(x, w, ids, whole.experts.gate_up, whole.experts.down)
    parts = []
    for r in range(tp):
        par = ParallelContext.layout(r, tp, 1, ep_size=ep)
        b = block(par)
        assert b.experts.gate_up.num_experts == mc.moe.num_experts // ep and b.experts.first == par.ep.rank * (
            mc.moe.num_experts // ep)
        parts.append(experts_forward(x, w, ids, b.experts.gate_up, b.experts.down, first_expert=b.experts.first))
    assert torch.allclose(sum(parts), want, atol=1e-5)
    with pytest.raises(ValueError, match="ep_size=3 must divide tp_size=2"):
        RuntimeConfig(tp_size=2, ep_size=3)
    assert RuntimeConfig.from_kwargs(tensor_parallel_size=4, expert_parallel_size=2).ep_size == 2


def test_the_fused_expert_layout_loads_as_the_per_expert_one(tmp_path):
    """transformers' in-memory layout (experts.gate_up_proj (E, 2I, H), experts.down_proj (E, H, I)), saved as
    such: the same logits as the per-expert checkpoint."""
    import shutil

    folder = tiny_model_dir("mixtral")
    tensors = load_file(str(folder / "model.safetensors"))
    fused, n = {}, 8
    for name, t in tensors.items():
        if ".experts.0.w1." in name:
            base = name.split(".experts.")[0].replace("block_sparse_moe", "mlp")
            def w(k, e, name=name):
                return tensors[name.replace(".experts.0.w1.", f".experts.{e}.{k}.")]

            fused[f"{base}.experts.gate_up_proj"] = torch.stack([torch.cat([w("w1", e), w("w3", e)]) for e in range(n)])
            fused[f"{base}.experts.down_proj"] = torch.stack([w("w2", e) for e in range(n)])
        elif ".experts." not in name:
            fused[name.replace("block_sparse_moe", "mlp")] = t
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    save_file(fused, str(tmp_path / "model.safetensors"))
    ps = prompts(1, [10], seed=9)
    a = Driver(runner_of(folder)).step({"a": ps[0]})["a"]
    assert torch.equal(Driver(runner_of(tmp_path)).step({"a": ps[0]})["a"], a)


def test_combinations_refused_at_start_name_the_problem():
    with pytest.raises(ValueError, match="ep_size=2 splits expert blocks, and llama has none"):
        runner_of(tiny_model_dir("llama"), tp_size=2, ep_size=2)
    folder = tiny_model_dir("qwen3_moe")
    if cpu.available():  # int8 experts in the deterministic mode: per expert, in calls the int8 kernel streams
        det = ModelRunner(RuntimeConfig(model=str(folder), dtype="bfloat16", deterministic=True, quantization="int8",
                                        max_total_tokens=256))
        assert {m.method.name for m in det.model.modules() if isinstance(m, GroupedLinear)} == \
            {"int8 (grouped, C), per expert, 16 rows a call"}
    with pytest.raises(LoRAAdapterError, match=r"targets \['down_proj', 'gate_proj'\].*attention-only"):
        runner_of(folder, enable_lora=True, lora_target_modules=("q_proj", "gate_proj", "down_proj"))
    with pytest.raises(ValueError, match="expert blocks: quantization 'awq' has no grouped-expert form"):
        grouped_or_refused("awq")
    # LoRA with every module by default: the attention's only, and a step runs with the pool attached
    r = runner_of(folder, enable_lora=True)
    assert r.lora_pool.targets == {"q_proj", "k_proj", "v_proj", "o_proj"}
    with pytest.raises(LoRAAdapterError, match="attention-only"):
        from radixgen.runtime.lora.adapter import LoRAAdapter

        r.lora_pool.check(LoRAAdapter("x", "/none", 8, 1.0, ("q_proj", "up_proj")))


def grouped_or_refused(method: str) -> None:
    """The ops' preparation of a MoE model for weight format `method`."""
    from radixgen.runtime.layers.ops import TorchOps
    from radixgen.runtime.layers.quantization import QuantSpec
    from radixgen.runtime.models import model_class

    mc = ModelConfig.from_hf(read_hf_config(tiny_model_dir("qwen3_moe")))
    TorchOps().prepare(model_class(mc.architecture)(mc), QuantSpec(method))


def test_attention_lora_adapters_match_peft_and_expert_adapters_are_refused(tmp_path):
    from lora_helpers import make_adapter

    from radixgen.runtime.executor.model_runner import ForwardInput
    from radixgen.runtime.lora.adapter import load_lora_adapter

    peft_model = make_adapter("qwen2_moe", tmp_path / "attn", targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    r = runner_of(tiny_model_dir("qwen2_moe"), enable_lora=True, max_loras=2, max_lora_rank=8)
    r.lora_pool.write(0, r.lora_pool.stage(load_lora_adapter("attn", tmp_path / "attn")))
    p = prompts(1, [9], seed=6)[0]
    kv = kv_of(r)
    row = kv.table.allocate()
    slots = kv.allocator.allocate(len(p))
    kv.table.write(row, 0, slots)
    got = r.forward(ForwardInput(torch.tensor(p), torch.arange(len(p)), slots, torch.tensor([row]), [0], [len(p)],
                                 torch.arange(len(p)), lora_slots=[0]))
    with torch.no_grad():
        want = peft_model(torch.tensor([p])).logits[0]
        with peft_model.disable_adapter():
            base = peft_model(torch.tensor([p])).logits[0]
    assert rel_err(got, want) < TOL and rel_err(want, base) > 1e-3  # the adapter shows
    make_adapter("qwen2_moe", tmp_path / "mlp", targets=("q_proj", "gate_proj"))  # the shared expert's and layer 1's
    with pytest.raises(LoRAAdapterError, match=r"targets \['gate_proj'\].*attention-only"):
        runner_of(tiny_model_dir("qwen2_moe"), lora_paths=(f"mlp={tmp_path / 'mlp'}",))


def test_which_layers_have_expert_blocks():
    """Qwen's decoder_sparse_step and mlp_only_layers, as transformers' decoder layers read them."""
    from radixgen.runtime.config import MoEConfig

    hf = {"num_hidden_layers": 6, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
          "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert MoEConfig.from_hf("qwen3_moe", hf).sparse_layers == (1, 5)
    assert MoEConfig.from_hf("qwen2_moe", {**hf, "decoder_sparse_step": 1}).sparse_layers == (0, 1, 2, 4, 5)
    assert MoEConfig.from_hf("qwen3_moe", {**hf, "num_experts": 0}) is None  # every layer dense
    assert MoEConfig.from_hf("llama", hf) is None
    with pytest.raises(ValueError, match="num_experts_per_tok=5 must be in"):
        MoEConfig.from_hf("qwen3_moe", {**hf, "num_experts_per_tok": 5})
