"""Random-weight GGUF files of real model shapes, for bench_scale.py: every tensor in the type a real file of that
kind stores it in, its block bytes random with fp16 / E8M0 scales that keep the weights near N(0, 0.02) (no inf or
NaN anywhere), and the bundled SmolLM2-135M GGUF's tokenizer (vocabulary 49152) copied in, so that radixgen and
llama.cpp load the same file. Tensors are streamed to disk one at a time: writing an 8B-shaped file needs the memory
of its largest tensor, not of the file.

    Shape("smollm2-1.7b", ...).plan("Q4_K_M") -> [(tensor name, type, rows, cols)]; write_gguf(path, shape, "Q4_0")
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np

from radixgen.runtime.loader import default_gguf_path

T = gguf.GGMLQuantizationType
VOCAB = 49152  # the bundled model's tokenizer
FILE_TYPES = ("Q4_0", "Q4_K_M", "Q8_0", "MXFP4")


class Shape(NamedTuple):
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool  # the LM head is the token embedding (no output.weight)
    rope_base: float
    context: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def plan(self, file_type: str) -> list[tuple[str, T, int, int]]:
        """(tensor name, GGML type, rows, cols) of every weight, in file order; norms are F32 (rows 1)."""
        if file_type not in FILE_TYPES:
            raise ValueError(f"unknown file type {file_type!r}; choose from {', '.join(FILE_TYPES)}")
        base = {"Q4_0": T.Q4_0, "Q4_K_M": T.Q4_K, "Q8_0": T.Q8_0, "MXFP4": T.MXFP4}[file_type]
        # the LM head: Q6_K in llama.cpp's Q4_0 / Q4_K_M (for a tied model the embedding takes the head's type)
        head = {"Q4_0": T.Q6_K, "Q4_K_M": T.Q6_K, "Q8_0": T.Q8_0, "MXFP4": T.Q8_0}[file_type]
        embd = head if self.tied else {"Q4_0": T.Q4_0, "Q4_K_M": T.Q4_K, "Q8_0": T.Q8_0, "MXFP4": T.Q8_0}[file_type]
        h, kv = self.hidden, self.kv_heads * self.head_dim
        out = [("token_embd.weight", embd, VOCAB, h)]
        for i in range(self.layers):
            # Q4_K_M: attn_v and ffn_down in Q6_K on llama.cpp's "more bits" layers (the first and last eighth,
            # every third one between: half of them)
            more = file_type == "Q4_K_M" and (i < self.layers // 8 or i >= 7 * self.layers // 8
                                              or (i - self.layers // 8) % 3 == 2)
            six = T.Q6_K if more else base
            out += [(f"blk.{i}.attn_norm.weight", T.F32, 1, h),
                    (f"blk.{i}.attn_q.weight", base, h, h), (f"blk.{i}.attn_k.weight", base, kv, h),
                    (f"blk.{i}.attn_v.weight", six, kv, h), (f"blk.{i}.attn_output.weight", base, h, h),
                    (f"blk.{i}.ffn_norm.weight", T.F32, 1, h),
                    (f"blk.{i}.ffn_gate.weight", base, self.ffn, h), (f"blk.{i}.ffn_up.weight", base, self.ffn, h),
                    (f"blk.{i}.ffn_down.weight", six, h, self.ffn)]
        out.append(("output_norm.weight", T.F32, 1, h))
        if not self.tied:
            out.append(("output.weight", head, VOCAB, h))
        return out

    def decode_bytes(self, file_type: str) -> int:
        """Weight bytes one decode step reads: every matmul weight and the LM head (the embedding lookup is a row)."""
        total = 0
        for name, t, rows, cols in self.plan(file_type):
            if t == T.F32 or (name == "token_embd.weight" and not self.tied):
                continue
            total += nbytes(t, rows, cols)
        return total

    def matmul_params(self) -> tuple[int, int]:
        """(weights of the layers' matmuls, weights of the LM head)."""
        kv = self.kv_heads * self.head_dim
        per_layer = 2 * self.hidden * self.hidden + 2 * kv * self.hidden + 3 * self.ffn * self.hidden
        return self.layers * per_layer, VOCAB * self.hidden

    def kv_bytes_per_token(self, elem: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * elem


SHAPES = {
    "1.7b": Shape("SmolLM2-1.7B", 2048, 24, 32, 32, 8192, tied=True, rope_base=130000.0),
    "8b": Shape("Llama-3-8B-body", 4096, 32, 32, 8, 14336, tied=False, rope_base=500000.0),
    "tiny": Shape("tiny", 256, 2, 4, 2, 512, tied=True, rope_base=10000.0, context=2048),  # the test's, a smoke run
}


def nbytes(t: T, rows: int, cols: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[t]
    return rows * cols // block * size


def random_blocks(t: T, rows: int, cols: int, gen: np.random.Generator) -> np.ndarray:
    """(rows, bytes per row) uint8 of type t: random quants, scales near a weight std of 0.02."""
    if t == T.F32:
        return (1 + 0.1 * gen.standard_normal((rows, cols))).astype(np.float32).reshape(-1)
    block, size = gguf.GGML_QUANT_SIZES[t]
    nb = cols // block
    raw = gen.integers(0, 256, (rows, nb, size), dtype=np.uint8)

    def f16(lo: float, hi: float) -> np.ndarray:
        return gen.uniform(lo, hi, (rows, nb, 1)).astype(np.float16).view(np.uint8)

    if t == T.Q4_0:  # d, then 16 bytes of nibbles (q - 8: std 4.6)
        raw[..., 0:2] = f16(3e-3, 5.5e-3)
    elif t == T.Q8_0:  # d, then 32 int8 (std 74)
        raw[..., 0:2] = f16(2e-4, 3.4e-4)
    elif t == T.Q4_K:  # d, dmin = 7.5 d (weights about zero-mean), 12 bytes of 6-bit scales and mins, nibbles
        d = gen.uniform(6e-5, 9.5e-5, (rows, nb, 1))
        raw[..., 0:2] = d.astype(np.float16).view(np.uint8)
        raw[..., 2:4] = (7.5 * d).astype(np.float16).view(np.uint8)
    elif t == T.Q6_K:  # ql, qh, 16 int8 scales, d
        raw[..., 192:208] = gen.integers(-40, 40, (rows, nb, 16)).astype(np.int8).view(np.uint8)
        raw[..., 208:210] = f16(3.5e-5, 6e-5)
    elif t == T.MXFP4:  # an E8M0 exponent byte (2^(e-127)), then 16 bytes of E2M1 nibbles (std about 3)
        raw[..., 0] = gen.integers(119, 122, (rows, nb), dtype=np.uint8)
    else:
        raise ValueError(f"no random block recipe for {t.name}")
    return raw.reshape(rows, nb * size)


@functools.cache
def tokenizer_fields() -> dict:
    src = gguf.GGUFReader(str(default_gguf_path()))
    return {k: f.contents() for k, f in src.fields.items() if k.startswith("tokenizer.")}


def write_gguf(path: Path, shape: Shape, file_type: str, seed: int = 0) -> Path:
    """Writes `path` (through a temporary name, so a killed run leaves no half file behind) and returns it."""
    gen = np.random.default_rng(seed)
    plan = shape.plan(file_type)
    tmp = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"{shape.name} {file_type} (random weights)")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(shape.rope_base)
    w.add_vocab_size(VOCAB)
    fields = tokenizer_fields()
    w.add_tokenizer_model(fields["tokenizer.ggml.model"])
    w.add_tokenizer_pre(fields.get("tokenizer.ggml.pre", "default"))
    w.add_token_list(fields["tokenizer.ggml.tokens"])
    w.add_token_types(fields["tokenizer.ggml.token_type"])
    w.add_token_merges(fields["tokenizer.ggml.merges"])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("unknown_token_id", w.add_unk_token_id), ("padding_token_id", w.add_pad_token_id)):
        if f"tokenizer.ggml.{key}" in fields:
            add(int(fields[f"tokenizer.ggml.{key}"]))
    if "tokenizer.ggml.add_bos_token" in fields:
        w.add_add_bos_token(bool(fields["tokenizer.ggml.add_bos_token"]))
    if "tokenizer.chat_template" in fields:
        w.add_chat_template(fields["tokenizer.chat_template"])
    for name, t, rows, cols in plan:
        if t == T.F32:
            w.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
        else:
            n = nbytes(t, rows, cols)
            w.add_tensor_info(name, (rows, n // rows), np.dtype(np.uint8), n, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _name, t, rows, cols in plan:
        w.write_tensor_data(random_blocks(t, rows, cols, gen))
    w.close()
    tmp.replace(path)
    return path
