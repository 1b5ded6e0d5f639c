"""quantization="gguf": GGUF files run from their own blocks, against the dequantized path (the default for a .gguf
file) on the same file. A tiny GGUF written here holds every native type (Q4_0, Q4_1, Q8_0 and Q6_K; Q6_K's
blocks random bytes, the rest quantized by the gguf package), a type without a native kernel (Q5_0, dequantized
with a log line), and a merged projection whose parts differ (dequantized as a whole); the block decoders are
checked against the gguf package's own dequantization. The default model (Q4_1 and Q8_0) is checked the same
way, and a type nothing can read is an error naming its tensor."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from test_model_forward import Driver, prompts

from radixgen.kernels import cpu
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ModelRunner
from radixgen.runtime.layers.quantization import gguf as qgguf
from radixgen.runtime.loader import default_gguf_path, resolve_model_path

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
HIDDEN, INTER, HEADS, KV_HEADS = 256, 512, 4, 2  # Q6_K blocks are 256 values: K a multiple of 256
LAYER_TYPES = [  # (q, k, v, output, gate, up, down) per layer
    (T.Q6_K, T.Q6_K, T.Q6_K, T.Q8_0, T.Q4_0, T.Q4_0, T.Q4_1),
    (T.Q4_0, T.Q4_1, T.Q4_0, T.Q5_0, T.Q4_1, T.Q4_1, T.Q6_K),  # q/k/v mixed int4 kinds; a Q5_0 output
]
NAMES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def blocks(t, rows: int, cols: int, gen: np.random.Generator) -> np.ndarray:
    """A (rows, cols) tensor of type t as stored: quantized from random values, or random bytes for the types
    the gguf package cannot quantize (Q6_K's with sane fp16 scales)."""
    if t == T.Q8_1:
        size, nbytes = gguf.GGML_QUANT_SIZES[t]
        return gen.integers(0, 256, (rows, cols // size * nbytes), dtype=np.uint8)
    if t == T.Q6_K:
        raw = gen.integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
        raw[..., 192:208] = gen.integers(-40, 40, (rows, cols // 256, 16)).astype(np.int8).view(np.uint8)
        raw[..., 208:210] = np.full((rows, cols // 256, 1), 2e-4, np.float16).view(np.uint8)
        return raw.reshape(rows, -1)
    values = (gen.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    return values if t == T.F32 else gguf.quants.quantize(values, t)


def write_tiny_gguf(path, extra: tuple[str, object] | None = None) -> None:
    """A two-layer llama GGUF with the default model's tokenizer; `extra`: (tensor name, type) replacing one."""
    src = gguf.GGUFReader(str(default_gguf_path()))
    gen = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(len(LAYER_TYPES))
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    fields = {k: src.fields[k].contents() for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                                      "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                                                      "tokenizer.ggml.eos_token_id", "tokenizer.ggml.pre")}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    w.add_token_list(fields["tokenizer.ggml.tokens"])
    w.add_token_types(fields["tokenizer.ggml.token_type"])
    w.add_token_merges(fields["tokenizer.ggml.merges"])
    w.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    vocab = len(fields["tokenizer.ggml.tokens"])

    def add(name, t, rows, cols):
        if extra is not None and extra[0] == name:
            t = extra[1]
        data = blocks(t, rows, cols, gen)
        w.add_tensor(name, data, raw_dtype=t)

    add("token_embd.weight", T.Q8_0, vocab, HIDDEN)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    hd = HIDDEN // HEADS
    shapes = [(HIDDEN, HIDDEN), (KV_HEADS * hd, HIDDEN), (KV_HEADS * hd, HIDDEN), (HIDDEN, HIDDEN),
              (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
    for i, types in enumerate(LAYER_TYPES):
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * gen.standard_normal(HIDDEN)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * gen.standard_normal(HIDDEN)).astype(np.float32))
        for name, t, (rows, cols) in zip(NAMES, types, shapes, strict=True):
            add(f"blk.{i}.{name}.weight", t, rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture
def tiny_gguf(tiny_file, monkeypatch):
    """The tiny GGUF, its cached folders (native and dequantized) beside it rather than in the shared cache."""
    monkeypatch.setenv("RADIXGEN_CACHE", str(tiny_file.parent / "cache"))
    return tiny_file


def runner(model, dtype="float32", **kw) -> ModelRunner:
    return ModelRunner(RuntimeConfig(model=None if model is None else str(model), dtype=dtype, max_total_tokens=2048,
                                     max_running_requests=4, **kw))


def logits_of(r: ModelRunner, decode_steps: int = 3) -> torch.Tensor:
    """A prefill of unequal prompts then greedy decode steps: the logits of every step, stacked."""
    d = Driver(r, seed=1)
    ps = prompts(2, [9, 30], seed=5)
    out = d.step({"a": ps[0], "b": ps[1]})
    rows = [out["a"][-1], out["b"][-1]]
    for _ in range(decode_steps):
        out = d.step({"a": [int(rows[0].argmax())], "b": [int(rows[1].argmax())]})
        rows += [out["a"][-1], out["b"][-1]]
    return torch.stack(rows)


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("t", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q6_K])
def test_block_decoders_match_the_gguf_package(t):
    raw = blocks(t, 24, 512, np.random.default_rng(int(t)))
    tensor = qgguf.GGUFTensor("w", t.name, torch.from_numpy(raw), 512)
    ours = tensor.quantized().dequantize()
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, t)).float()
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0), (ours - theirs).abs().max()


@pytest.mark.parametrize("path", ["c", "torch"])
def test_tiny_gguf_native_matches_dequantized(tiny_gguf, path, caplog):
    with caplog.at_level(logging.INFO, logger="radixgen.runtime.layers.quantization.gguf"):
        native = runner(tiny_gguf, quantization="gguf", disable_cpu_kernels=path == "torch")
    methods = native.ops.linear_methods(native.model)
    assert {"gguf Q4_0 (C)", "gguf Q6_K (C)", "gguf Q8_0 (C)", "gguf Q4_1 (C)"} <= set(methods) or path == "torch"
    dequantized_logs = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert any("Q5_0" in m for m in dequantized_logs), dequantized_logs  # no native kernel
    assert any("Q4_1" in m and "attn_k" in m for m in dequantized_logs), dequantized_logs  # mixed qkv
    ref = runner(tiny_gguf)  # the default for a .gguf file: dequantized, float32
    assert ref.quantization.method == "none"
    assert rel(logits_of(native), logits_of(ref)) < 1e-4


@pytest.mark.skipif(not (cpu.available() and cpu.lib().has_decode_step), reason="needs AVX512-BF16")
def test_tiny_gguf_native_bf16_fused_step(tiny_gguf):
    native, ref = runner(tiny_gguf, "bfloat16", quantization="gguf"), runner(tiny_gguf, "bfloat16")
    assert native.fused_decode is not None
    assert rel(logits_of(native), logits_of(ref)) < 2e-2


def test_a_type_nothing_reads_is_an_error_naming_the_tensor(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXGEN_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "q8_1.gguf"
    write_tiny_gguf(path, extra=("blk.1.ffn_down.weight", T.Q8_1))
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_down\.weight' has type Q8_1"):
        runner(path, quantization="gguf")


def test_default_model_native_matches_dequantized():
    """The bundled Q4_1 / Q8_0 model from its own blocks: the prefill exactly the dequantized bf16 path's (each
    weight dequantized to bf16 once, the same GEMM), decode steps within bf16 rounding."""
    native, ref = runner(None, "bfloat16", quantization="gguf"), runner(None, "bfloat16")
    assert native.model_path != ref.model_path and native.model_path.name.endswith("-native")
    assert ref.model_path == resolve_model_path(None)  # the dequantized cache folder is unchanged
    assert native.ops.linear_methods(native.model) == ["gguf Q4_1 (C)", "gguf Q8_0 (C)"]
    a, b = logits_of(native), logits_of(ref)
    assert torch.equal(a[:2], b[:2]) if cpu.lib().has_decode_step else rel(a[:2], b[:2]) < 1e-2
    assert rel(a, b) < 2e-2
