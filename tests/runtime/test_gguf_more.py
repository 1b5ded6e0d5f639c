"""quantization="gguf" on a tiny mixed file (written here with gguf.GGUFWriter): a Q4_K_M-like layer (Q4_K, Q6_K)
beside layers in Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 and a tied LM head in Q3_K. Each tensor loads in its
own kind; the new types run from the file's blocks as views of its memory map (the weight's pointer lies in the
mapping of the file, its bytes the file's), and the logits match the torch path's (float inputs against the
dequantized values) within the kernels' int8 inputs."""

from __future__ import annotations

import numpy as np
import pytest
import test_gguf_native as tg
import torch

from radixgen.kernels import cpu, cpu_gguf_more
from radixgen.runtime.executor.weights import _model_tensors
from radixgen.runtime.layers.quantization import gguf_more

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")
T = gguf.GGMLQuantizationType
MIXED = [  # (q, k, v, output, gate, up, down) per layer
    (T.Q4_K, T.Q4_K, T.Q6_K, T.Q5_0, T.Q4_K, T.Q4_K, T.Q6_K),  # Q4_K_M-like, a Q5_0 output
    (T.Q3_K, T.Q2_K, T.IQ4_XS, T.Q5_1, T.IQ4_NL, T.MXFP4, T.Q8_0),
]
# each type's fp16 scale (and min) offsets in its block, and a d making weights of a few hundredths
SCALES = {"Q5_0": ((0, 2e-3),), "Q5_1": ((0, 2e-3), (2, -3.1e-2)), "Q2_K": ((80, 3e-3), (82, 4.5e-3)),
          "Q3_K": ((108, 1e-3),), "IQ4_NL": ((0, 4e-4),), "IQ4_XS": ((0, 3e-5),)}


_theirs = tg.blocks


def blocks(t, rows: int, cols: int, gen: np.random.Generator) -> np.ndarray:
    """tg.blocks, and random bytes with sane scales for the types the gguf package cannot quantize."""
    if t.name not in cpu_gguf_more.KINDS:
        return _theirs(t, rows, cols, gen)
    nb = cols // cpu_gguf_more.QK[t.name]
    raw = gen.integers(0, 256, (rows, nb, cpu_gguf_more.BLOCK_BYTES[t.name]), dtype=np.uint8)
    if t.name == "MXFP4":
        raw[..., 0] = 121  # 2^-7
    for at, d in SCALES.get(t.name, ()):
        raw[..., at:at + 2] = np.full((rows, nb, 1), d, np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def mapped(path) -> list[tuple[int, int]]:
    """This process's address ranges mapping `path`."""
    ranges = []
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith(str(path)):
            lo, hi = line.split()[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def resident(path) -> int:
    """Bytes of `path`'s mappings resident in this process (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:  # a mapping's header line
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_mixed_file_loads_per_tensor_from_the_map(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tg, "blocks", blocks)
    path = tmp_path / "mixed.gguf"
    tg.write_tiny_gguf(path, extra=("token_embd.weight", T.Q3_K), layer_types=MIXED)
    native = tg.runner(path, quantization="gguf")
    # resident memory, as a ratio: of the file's mapped pages only those of blocks read in place stay (the rest were
    # copied into the C layouts or dequantized, and released), so the file's bytes are not held twice
    ranges = mapped(path.resolve())
    kept = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in _model_tensors(native.model)
            if t.numel() and any(lo <= t.data_ptr() < hi for lo, hi in ranges)}
    held = sum(n for _, n in kept)
    assert 0 < resident(path.resolve()) <= held + 2 * 4096 * len(kept)
    methods = set(native.ops.linear_methods(native.model))
    assert {"gguf Q4_K/Q6_K (C)", "gguf Q5_0 (C)", "gguf IQ4_XS/Q2_K/Q3_K (C)", "gguf Q5_1 (C)",
            "gguf IQ4_NL/MXFP4 (C)", "gguf Q8_0 (C)", "gguf Q3_K (C)"} <= methods, methods
    ours = [w for m in native.model.modules() if isinstance(getattr(m, "method", None), gguf_more.GGUFBlocksLinear)
            for w in m.gguf_weights if isinstance(w, cpu_gguf_more.BlockWeight)]
    assert sorted({w.type_name for w in ours}) == sorted(cpu_gguf_more.KINDS)
    reader = gguf.GGUFReader(str(path))
    file_bytes = {t.name: int(t.n_bytes) for t in reader.tensors}
    assert sum(w.nbytes for w in ours) == sum(file_bytes[n] for n in file_bytes if n == "token_embd.weight"
                                              or any(s in n for s in ("blk.0.attn_output", "blk.1.")) and
                                              not n.endswith(("norm.weight", "ffn_down.weight")))
    assert ranges
    # Q and K rows are reordered for rotary (a copy); every other weight of ours is the file's blocks in place
    in_map = [any(lo <= w.data.data_ptr() < hi for lo, hi in ranges) for w in ours]
    assert sum(in_map) >= len(ours) - 2, in_map
    # the reference: the same folder on the torch path (the new types' values dequantized or as exact int8, float
    # inputs); a dequantized runner would convert the tokenizer a second time (half a minute)
    a, b = tg.forced_logits(native), tg.forced_logits(tg.runner(path, quantization="gguf", disable_cpu_kernels=True))
    assert tg.rel(a, b) < 3e-2, [tg.rel(x, y) for x, y in zip(a, b, strict=True)]
    ids = torch.tensor([3, 40000, 7])
    embed = next(m for n, m in native.model.named_modules() if n.endswith("embed_tokens"))
    # the tied Q3_K embedding's rows, read by the kernels: the gguf package's values
    raw = next(t for t in reader.tensors if t.name == "token_embd.weight").data
    ref = torch.from_numpy(gguf.quants.dequantize(np.asarray(raw)[ids.numpy()], T.Q3_K)).float()
    assert torch.equal(embed(ids).float(), ref)
