"""PEFT adapter folders load into per-layer (A, B) pairs; each kind of broken folder is refused by name."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from radixgen.runtime.config import ModelConfig
from radixgen.runtime.lora import LoRAAdapterError, check_adapter_fits, load_lora_adapter


def _write(folder, cfg, tensors):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def _tensors(r=4, modules=("q_proj", "v_proj"), layers=2):
    out = {}
    for i in range(layers):
        for m in modules:
            p = f"base_model.model.model.layers.{i}.self_attn.{m}"
            out[f"{p}.lora_A.weight"] = torch.randn(r, 64)
            out[f"{p}.lora_B.weight"] = torch.randn(32, r)
    return out


CFG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def test_loads_pairs_and_scale(tmp_path):
    t = _tensors()
    a = load_lora_adapter("x", _write(tmp_path / "x", CFG, t), max_lora_rank=8)
    assert a.rank == 4 and a.scale == 2.0 and set(a.weights) == {(0, "q_proj"), (0, "v_proj"),
                                                                   (1, "q_proj"), (1, "v_proj")}
    A, B = a.weights[(1, "v_proj")]
    assert torch.equal(A, t["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"])
    assert B.shape == (32, 4)
    rs = load_lora_adapter("y", _write(tmp_path / "y", {**CFG, "use_rslora": True}, t))
    assert rs.scale == pytest.approx(8 / math.sqrt(4))


@pytest.mark.parametrize("cfg,tensors,match", [
    ({**CFG, "r": 16}, _tensors(r=16), "rank 16 exceeds max_lora_rank 8"),
    ({**CFG, "target_modules": ["q_proj", "lm_head"]}, _tensors(), "unknown target modules"),
    ({**CFG, "r": 8}, _tensors(r=4), "do not match rank 8"),
    (CFG, {k: v for k, v in _tensors().items() if "lora_B" not in k or "layers.0" not in k}, "lacks lora_B"),
    ({**CFG, "target_modules": ["q_proj"]}, _tensors(), "not in target_modules"),
    ({**CFG, "peft_type": "IA3"}, _tensors(), "not LORA"),
])
def test_refuses_bad_adapters(tmp_path, cfg, tensors, match):
    with pytest.raises(LoRAAdapterError, match=match):
        load_lora_adapter("bad", _write(tmp_path / "bad", cfg, tensors), max_lora_rank=8)


def test_refuses_missing_and_broken_files(tmp_path):
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        load_lora_adapter("m", tmp_path)
    folder = _write(tmp_path / "b", CFG, _tensors())
    (folder / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LoRAAdapterError, match="broken adapter_model.safetensors"):
        load_lora_adapter("b", folder)
    (folder / "adapter_config.json").write_text("{oops")
    with pytest.raises(LoRAAdapterError, match="unreadable adapter_config.json"):
        load_lora_adapter("b", folder)


def test_reads_a_real_peft_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=16, target_modules=targets))
    lora.save_pretrained(str(tmp_path / "a"))
    a = load_lora_adapter("a", tmp_path / "a", max_lora_rank=4)
    assert a.scale == 4.0 and sorted(a.target_modules) == sorted(targets)
    assert set(a.weights) == {(i, m) for i in range(2) for m in targets}
    A, B = a.weights[(1, "down_proj")]
    assert A.shape == (4, 64) and B.shape == (32, 4)
    ref = lora.base_model.model.model.layers[1].mlp.down_proj.lora_A["default"].weight
    assert torch.equal(A, ref.detach())
    hf = {**model.config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    check_adapter_fits(a, ModelConfig.from_hf(hf))
    with pytest.raises(LoRAAdapterError, match="down_proj maps 64 -> 32, the model's maps 128 -> 32"):
        check_adapter_fits(a, ModelConfig.from_hf({**hf, "intermediate_size": 128}))
    with pytest.raises(LoRAAdapterError, match="layer 1 but the model has 1 layers"):
        check_adapter_fits(a, ModelConfig.from_hf({**hf, "num_hidden_layers": 1}))
