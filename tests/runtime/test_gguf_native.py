"""quantization="gguf": GGUF files run from their own blocks, against the dequantized path (the default for a .gguf
file) on the same file. A tiny GGUF written here holds every native type (Q4_0, Q4_1, Q8_0 and Q6_K; Q6_K's
blocks random bytes, the rest quantized by the gguf package) and a merged projection whose parts differ (dequantized
as a whole); the block decoders are
checked against the gguf package's own dequantization. The default model (Q4_1 and Q8_0) is checked the same
way, and a type nothing can read is an error naming its tensor."""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest
import torch
from test_model_forward import Driver, prompts

from radixgen.kernels import _cpu_build, cpu
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.gguf_index import GGUFIndex
from radixgen.runtime.executor.model_runner import ModelRunner
from radixgen.runtime.layers.quantization import gguf as qgguf
from radixgen.runtime.layers.quantization import gguf_int8
from radixgen.runtime.loader import default_gguf_path, model_path_for, resolve_model_path, runs_gguf_blocks

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
HIDDEN, INTER, HEADS, KV_HEADS = 256, 512, 4, 2  # Q6_K blocks are 256 values: K a multiple of 256
LAYER_TYPES = [  # (q, k, v, output, gate, up, down) per layer
    (T.Q6_K, T.Q6_K, T.Q6_K, T.Q8_0, T.Q4_0, T.Q4_0, T.Q4_1),
    (T.Q4_0, T.Q4_1, T.Q4_0, T.Q8_0, T.Q4_1, T.Q4_1, T.Q6_K),  # q/k/v mixed int4 kinds (Q5_0: test_gguf_more)
]
NAMES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def blocks(t, rows: int, cols: int, gen: np.random.Generator) -> np.ndarray:
    """A (rows, cols) tensor of type t as stored: quantized from random values, or random bytes for the types
    the gguf package cannot quantize (Q6_K's with sane fp16 scales)."""
    if t == T.Q8_1:
        size, nbytes = gguf.GGML_QUANT_SIZES[t]
        return gen.integers(0, 256, (rows, cols // size * nbytes), dtype=np.uint8)
    if t in (T.Q4_K, T.Q5_K):  # d and dmin = 7.5 d: weights about zero-mean
        raw = gen.integers(0, 256, (rows, cols // 256, gguf.GGML_QUANT_SIZES[t][1]), dtype=np.uint8)
        raw[..., 0:2] = np.full((rows, cols // 256, 1), 1e-4, np.float16).view(np.uint8)
        raw[..., 2:4] = np.full((rows, cols // 256, 1), 7.5e-4, np.float16).view(np.uint8)
        return raw.reshape(rows, -1)
    if t == T.Q6_K:
        raw = gen.integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
        raw[..., 192:208] = gen.integers(-40, 40, (rows, cols // 256, 16)).astype(np.int8).view(np.uint8)
        raw[..., 208:210] = np.full((rows, cols // 256, 1), 2e-4, np.float16).view(np.uint8)
        return raw.reshape(rows, -1)
    values = (gen.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    return values if t == T.F32 else gguf.quants.quantize(values, t)


@functools.cache
def tokenizer_fields() -> dict:
    """The default model's tokenizer fields, read once per session (parsing its 49k tokens takes seconds)."""
    src = GGUFIndex(default_gguf_path())  # GGUFReader takes seconds over the tokenizer's strings
    return {k: src.fields[k].contents() for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                                                  "tokenizer.ggml.eos_token_id", "tokenizer.ggml.pre")}


def write_tiny_gguf(path, extra: tuple[str, object] | None = None, layer_types=LAYER_TYPES) -> None:
    """A two-layer llama GGUF with the default model's tokenizer; `extra`: (tensor name, type) replacing one."""
    gen = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(len(layer_types))
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    fields = tokenizer_fields()
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
    for i, types in enumerate(layer_types):
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


@pytest.mark.parametrize("t", sorted(gguf_int8.SCALES))
def test_types_without_a_kernel_run_as_exact_int8(t, monkeypatch, caplog):
    monkeypatch.setattr(gguf_int8, "_logged", set())
    size, nbytes = gguf.GGML_QUANT_SIZES[T[t]]
    raw = np.random.default_rng(int(T[t])).integers(0, 256, (6, 512 // size, nbytes), dtype=np.uint8)
    if t == "MXFP4":
        raw[..., 0] = np.random.default_rng(0).integers(110, 140, raw.shape[:2])
    else:  # d, at the end of a Q3_K block, the start of the others
        at = nbytes - 2 if t == "Q3_K" else 0
        raw[..., at:at + 2] = np.full(raw.shape[:2] + (1,), 3e-3, np.float16).view(np.uint8)
    raw = raw.reshape(6, -1)
    tensor = qgguf.GGUFTensor("w", t, torch.from_numpy(raw), 512)
    with caplog.at_level(logging.INFO, logger="radixgen.runtime.layers.quantization.gguf"):
        qw, again = tensor.quantized(), tensor.quantized()
    assert qw is not None and qw.bits == 8 and qw.q.dtype == torch.int8 and again is not None
    assert torch.equal(qw.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, T[t])).float())
    assert sum(f"GGUF {t} has no kernel" in r.getMessage() for r in caplog.records) == 1  # once per type


@pytest.mark.parametrize("path", ["c", "torch"])
def test_tiny_gguf_native_matches_dequantized(tiny_gguf, path, caplog):
    with caplog.at_level(logging.INFO, logger="radixgen.runtime.layers.quantization.gguf"):
        native = runner(tiny_gguf, quantization="gguf", disable_cpu_kernels=path == "torch")
    methods = native.ops.linear_methods(native.model)
    assert {"gguf Q4_0 (C)", "gguf Q6_K (C)", "gguf Q8_0 (C)", "gguf Q4_1 (C)"} <= set(methods) or path == "torch"
    dequantized_logs = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert any("Q4_1" in m and "attn_k" in m for m in dequantized_logs), dequantized_logs  # mixed qkv
    ref = runner(tiny_gguf, quantization="none")  # dequantized by name, float32
    assert ref.quantization.method == "none"
    assert rel(logits_of(native), logits_of(ref)) < 1e-4


@pytest.mark.skipif(not (cpu.available() and cpu.lib().has_decode_step), reason="needs AVX512-BF16")
def test_tiny_gguf_native_bf16_fused_step(tiny_gguf):
    native, ref = runner(tiny_gguf, "bfloat16"), runner(tiny_gguf, "bfloat16", quantization="none")  # auto: gguf
    assert native.fused_decode is not None
    assert rel(logits_of(native), logits_of(ref)) < 2e-2


@pytest.mark.skipif(not cpu.available() or _cpu_build.missing_flags("x86-64-v3") != [], reason="needs an AVX2 CPU")
def test_avx2_build_runs_the_blocks_on_the_block_kernels(tiny_gguf, monkeypatch):
    """Without the fused decode step (the x86-64-v3 build) Q4_0, Q4_1, Q8_0 and Q6_K layers, merged kinds mixed
    included, run on cpu_gguf's kernels from the file's bytes (int8 inputs): within their rounding of the
    dequantized float32 path; the exact-int8 Q5_0 keeps the int8 layout."""
    monkeypatch.setattr(cpu, "_lib", cpu.load("x86-64-v3"))
    native = runner(tiny_gguf, quantization="gguf")
    assert native.fused_decode is None
    kinds = {type(m.method).__name__: m.method.name for m in native.model.modules() if hasattr(m, "method")}
    assert kinds.get("GGUFPartsLinear"), kinds
    parts = {w.type_name for m in native.model.modules() for w in getattr(m, "gguf_weights", ())}
    assert {"Q4_0", "Q4_1", "Q8_0", "Q6_K"} <= parts, parts
    assert rel(forced_logits(native), forced_logits(runner(tiny_gguf, quantization="none"))) < 3e-2


K_M_TYPES = [  # like a Q4_K_M file: Q4_K with Q6_K for v and down; and Q5_K beside Q4_K in one merged layer
    (T.Q4_K, T.Q4_K, T.Q6_K, T.Q4_K, T.Q4_K, T.Q4_K, T.Q6_K),
    (T.Q5_K, T.Q4_K, T.Q5_K, T.Q5_K, T.Q5_K, T.Q4_K, T.Q4_K),
]


def test_k_quant_file_runs_from_its_own_bits(tmp_path, monkeypatch):
    """Q4_K / Q5_K (and the tied LM head in Q4_K) on the K-quant kernels, every part in its own kind: nothing
    dequantized at load, the logits within the kernels' int8 inputs of the dequantized float32 path's."""
    monkeypatch.setenv("RADIXGEN_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "q4_k_m.gguf"
    write_tiny_gguf(path, extra=("token_embd.weight", T.Q4_K), layer_types=K_M_TYPES)
    native = runner(path, quantization="gguf")
    methods = set(native.ops.linear_methods(native.model))
    assert {"gguf Q4_K/Q6_K (C)", "gguf Q4_K (C)", "gguf Q4_K/Q5_K (C)", "gguf Q5_K (C)"} <= methods, methods
    assert not any(isinstance(p, torch.Tensor) and p.dtype.is_floating_point and p.dim() == 2
                   for m in native.model.modules() if hasattr(m, "gguf_weights")
                   for p in m.parameters(recurse=False))
    a, b = forced_logits(native), forced_logits(runner(path, quantization="none"))
    assert rel(a, b) < 3e-2, [rel(x, y) for x, y in zip(a, b, strict=True)]


@pytest.mark.skipif(not (cpu.available() and cpu.lib().has_decode_step), reason="needs AVX512-BF16")
def test_a_layer_the_fused_step_cannot_read_takes_the_per_layer_path(tmp_path, monkeypatch):
    """bf16 on a build with the fused decode step: a Q4_K_M-like file's K-quant layers have no layout the step
    reads, so the model decodes on the per-layer path (auto: its own blocks), within the kernels' int8 inputs and
    bf16 rounding of the dequantized bf16 path (which does take the fused step)."""
    monkeypatch.setenv("RADIXGEN_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "q4_k_m.gguf"
    write_tiny_gguf(path, layer_types=K_M_TYPES)
    native, ref = runner(path, "bfloat16"), runner(path, "bfloat16", quantization="none")
    assert native.fused_decode is None and ref.fused_decode is not None
    assert "gguf Q4_K (C)" in native.ops.linear_methods(native.model)
    assert rel(forced_logits(native), forced_logits(ref)) < 5e-2


def forced_logits(r: ModelRunner) -> torch.Tensor:
    """logits_of with the same decode tokens whatever the logits (greedy tokens of close logits may differ)."""
    d = Driver(r, seed=1)
    ps = prompts(2, [9, 30], seed=5)
    out = d.step({"a": ps[0], "b": ps[1]})
    rows = [out["a"][-1], out["b"][-1]]
    for tok in (17, 401, 5000):
        out = d.step({"a": [tok], "b": [tok + 1]})
        rows += [out["a"][-1], out["b"][-1]]
    return torch.stack(rows)


def test_an_unknown_type_is_an_error_naming_the_tensor():
    tensor = qgguf.GGUFTensor("blk.0.ffn_up.weight", "Q9_Z", torch.zeros(4, 64, dtype=torch.uint8), 256)
    with pytest.raises(qgguf.GGUFError, match=r"'blk\.0\.ffn_up\.weight' has type Q9_Z"):
        tensor.narrow(1, 0, 256)
    with pytest.raises(qgguf.GGUFError, match=r"'blk\.0\.ffn_up\.weight' has type Q9_Z"):
        tensor.dense()


def test_a_type_nothing_reads_is_an_error_naming_the_tensor(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXGEN_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "q8_1.gguf"
    write_tiny_gguf(path, extra=("blk.1.ffn_down.weight", T.Q8_1))
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_down\.weight' has type Q8_1"):
        runner(path, quantization="gguf")


def test_auto_runs_a_gguf_from_its_blocks_on_the_cpu():
    """quantization auto on a .gguf: its own blocks on the CPU with the C kernels; dequantized on CUDA, in the
    deterministic mode and without the kernels; `none` dequantizes by name."""
    assert runs_gguf_blocks("auto") and runs_gguf_blocks("gguf") and not runs_gguf_blocks("none")
    assert not runs_gguf_blocks("auto", "cuda")
    assert not runs_gguf_blocks("auto", cpu_kernels=False) and not runs_gguf_blocks("int8")
    cfg = RuntimeConfig()
    assert model_path_for(cfg).name.endswith("-native") and model_path_for(cfg) == resolve_model_path(None, "gguf")
    assert model_path_for(RuntimeConfig(quantization="none")) == resolve_model_path(None)


def test_default_model_native_matches_dequantized():
    """The bundled Q4_1 / Q8_0 model from its own blocks: the prefill exactly the dequantized bf16 path's (each
    weight dequantized to bf16 once, the same GEMM), decode steps within bf16 rounding."""
    native, ref = runner(None, "bfloat16", quantization="gguf"), runner(None, "bfloat16", quantization="none")
    assert native.model_path != ref.model_path and native.model_path.name.endswith("-native")
    assert ref.model_path == resolve_model_path(None)  # the dequantized cache folder is unchanged
    assert native.ops.linear_methods(native.model) == ["gguf Q4_1 (C)", "gguf Q8_0 (C)"]
    a, b = logits_of(native), logits_of(ref)
    assert torch.equal(a[:2], b[:2]) if cpu.lib().has_decode_step else rel(a[:2], b[:2]) < 1e-2
    assert rel(a, b) < 2e-2
