"""GGUF types without a kernel of their own whose values are exactly int8 times a float32 scale per group: run on
the int8 C layout instead of dequantized. Each decoder reads only the scales from the blocks (torch, vectorised);
the values come from the gguf package's dequantization divided by them, and are kept only where that division is
exact (every value an integer in [-127, 127] that times its scale gives back the value bit for bit): a type or
file where it is not returns None (the caller dequantizes, as before).

  Q5_0    22 bytes / 32: d, 4 + 16 bytes of 5-bit q; w = d (q - 16)              scale d, group 32
  IQ4_NL  18 bytes / 32: d, 16 bytes of 4-bit indices into an int8 table           scale d, group 32
  IQ4_XS  136 bytes / 256: d, 2 bytes high and 4 bytes low of 8 6-bit scales ls,
          128 bytes of table indices; w = d (ls - 32) table[q]                      scale d (ls - 32), group 32
  Q3_K    110 bytes / 256: 32 bytes high bits, 64 bytes 2-bit q, 12 bytes of 16 6-bit scales, d;
          w = d (sc - 32) q3, q3 in -4..3                                           scale d (sc - 32), group 16
  MXFP4   17 bytes / 32: an e8m0 exponent e, 16 bytes of fp4 (e2m1) codes: twice each value is an integer
          (0, 1, 2, 3, 4, 6, 8, 12 and their negatives)                             scale 2^(e - 128), group 32
"""

from __future__ import annotations

import logging

import torch

from radixgen.runtime.layers.quantization.base import QuantizedWeight

logger = logging.getLogger("radixgen.runtime.layers.quantization.gguf")
_logged: set[str] = set()


def _f16(b: torch.Tensor, lo: int) -> torch.Tensor:
    return b[..., lo:lo + 2].contiguous().view(torch.float16)[..., 0].float()


def _q5_0(b):  # (n, blocks, 22) -> (n, blocks) scales
    return _f16(b, 0)


def _iq4_xs(b):  # (n, blocks, 136) -> (n, blocks, 8)
    d = _f16(b, 0)
    high = b[..., 2:4].contiguous().view(torch.int16)[..., 0].to(torch.int32) & 0xFFFF
    low = b[..., 4:8].to(torch.int32)
    j = torch.arange(8)
    ls = ((low[..., j // 2] >> (4 * (j % 2))) & 15) | (((high[..., None] >> (2 * j)) & 3) << 4)
    return d[..., None] * (ls - 32).float()


def _q3_k(b):  # (n, blocks, 110) -> (n, blocks, 16)
    s = b[..., 96:108].to(torch.int32)
    j = torch.arange(16)
    low = torch.where(j < 8, s[..., j % 8] & 15, s[..., j % 8] >> 4)
    sc = low | (((s[..., 8 + j % 4] >> (2 * (j // 4))) & 3) << 4)
    return _f16(b, 108)[..., None] * (sc - 32).float()


def _mxfp4(b):  # (n, blocks, 17) -> (n, blocks)
    return torch.pow(2.0, b[..., 0].float() - 128)


# type -> (block bytes, groups per block, the scales (n, blocks[, groups]) from the blocks (n, blocks, bytes))
SCALES = {"Q5_0": (22, 1, _q5_0), "IQ4_NL": (18, 1, _q5_0), "IQ4_XS": (136, 8, _iq4_xs), "Q3_K": (110, 16, _q3_k),
          "MXFP4": (17, 1, _mxfp4)}


def int8_exact(tensor) -> QuantizedWeight | None:
    """A gguf.GGUFTensor of a type in SCALES as int8 values and float32 scales, or None where that is not exact."""
    spec = SCALES.get(tensor.type_name)
    if spec is None:
        return None
    block_bytes, groups, scales_of = spec
    n, k = tensor.rows, tensor.columns
    scales = scales_of(tensor.raw.reshape(n, -1, block_bytes)).reshape(n, -1)  # (n, k / group)
    group = k // scales.shape[1]
    dense = tensor.dense()
    s = scales.repeat_interleave(group, 1)
    q = torch.where(s != 0, dense / torch.where(s != 0, s, 1.0), 0.0).round()
    if not (bool((q.abs() <= 127).all()) and torch.equal(q * s, dense)):
        return None
    if tensor.type_name not in _logged:
        _logged.add(tensor.type_name)
        logger.info("GGUF %s has no kernel of its own: its exact values run as int8 (a float32 scale per %d)",
                    tensor.type_name, group)
    return QuantizedWeight(8, q.to(torch.int8), scales, group)
