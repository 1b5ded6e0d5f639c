"""Qwen2-VL / Qwen2.5-VL: our vision tower and our M-RoPE decoder over the paged KV pool against transformers'
own model on the same tiny random weights (float32): the vision tower's output, the prompt's logits (in one
extend, and in chunks that cut through the image), decode steps after the image; the model's side of the image
contract (models/multimodal.py) driven directly: encode, the positions hook, the media rows."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kv_helpers import kv_of
from tiny_vl_models import IMAGE_TOKEN, VISION_END, VISION_START, hf_vl_model, random_image, tiny_vl_dir

from radixgen.common.prompt import MediaItem
from radixgen.kernels import cpu, cpu_fused
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ForwardInput, ModelRunner
from radixgen.runtime.loader import read_hf_config
from radixgen.runtime.media import processor_for
from radixgen.runtime.models.multimodal import StepMedia
from radixgen.runtime.models.qwen2_vl import ImageSpan, mrope_positions
from radixgen.runtime.models.vision.qwen2_vit import Qwen2VisionTransformer, VisionSpec

ARCHS = ["qwen2_vl", "qwen2_5_vl"]
TOL = 1e-4


def rel_err(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    import transformers as tf

    folder = tiny_vl_dir(request.param)
    runner = ModelRunner(RuntimeConfig(model=str(folder), dtype="float32", max_total_tokens=2048,
                                       max_running_requests=4))
    cls = {"qwen2_vl": tf.Qwen2VLForConditionalGeneration,
           "qwen2_5_vl": tf.Qwen2_5_VLForConditionalGeneration}[request.param]
    proc = processor_for(request.param, read_hf_config(folder), folder)
    return runner, cls.from_pretrained(folder, dtype=torch.float32).eval(), proc


def image_prompt(proc, image, before: int = 5, after: int = 7, seed: int = 0) -> tuple[list[int], MediaItem]:
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 49152, (before + after,), generator=gen).tolist()
    px = proc.process(image)
    toks = proc.tokens(px)
    item = MediaItem("image", proc.content_hash(px), before + toks.start, before + toks.end, payload=px)
    return text[:before] + toks.ids + text[before:], item


def hf_logits(ref, ids, item) -> torch.Tensor:
    t = torch.tensor([ids])
    with torch.no_grad():
        out = ref(input_ids=t, pixel_values=item.payload.pixel_values, image_grid_thw=torch.tensor([item.payload.grid]),
                  mm_token_type_ids=(t == IMAGE_TOKEN).int())
    return out.logits[0]


class VLDriver:
    """One request's steps through ModelRunner.forward with its media item on the step (ForwardInput.media), as
    the scheduler sends them: the runner asks the model's positions hook, takes the image rows' embeddings from
    the encoder cache (or encodes them) and hands them to the model."""

    def __init__(self, runner, item: MediaItem) -> None:
        self.runner, self.item = runner, item
        self.kv = kv_of(runner)
        self.row, self.len, self.slots = self.kv.table.allocate(), 0, []
        self.last_positions = None

    def step(self, ids: list[int]) -> torch.Tensor:
        start, n = self.len, len(ids)
        slots = self.kv.allocator.allocate(n)
        self.slots.append(slots)
        self.kv.table.write(self.row, start, slots)
        fi = ForwardInput(torch.tensor(ids), torch.arange(start, start + n), slots, torch.tensor([self.row]),
                          [start], [n], torch.arange(n), media=((self.item,),))
        self.last_positions = self.runner.media_inputs(fi)[0].positions
        self.len += n
        return self.runner.forward(fi)

    def close(self) -> None:
        self.kv.allocator.free(torch.cat(self.slots))
        self.kv.table.free(self.row)


@pytest.mark.parametrize("arch", ARCHS)
def test_vision_tower_equals_transformers(arch):
    ref = hf_vl_model(arch)
    spec = VisionSpec.from_hf(ref.config.vision_config.to_dict(), arch == "qwen2_5_vl")
    ours = Qwen2VisionTransformer(spec)
    ours.load_weights(ref.model.visual.state_dict().items())
    grids = [(1, 6, 10), (1, 4, 4), (1, 10, 6)]  # several images in one pass, windows cut short
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), spec.patch_features)
    with torch.no_grad():
        want = ref.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
        got = ours(pixels, grids)
    assert got.shape == want.shape == (sum(t * h * w for t, h, w in grids) // 4, 64)
    assert rel_err(got, want) < TOL


def test_mrope_positions_follow_the_grid():
    # 2 text, a 2 x 3 merged image, 3 text, a 1 x 2 image, 1 text
    spans = [ImageSpan(2, 8, 1, 2, 3), ImageSpan(11, 13, 1, 1, 2)]
    pos, inside = mrope_positions(torch.arange(14), spans)
    assert inside
    assert pos.tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 7, 8, 8, 10],
                            [0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 7, 8, 8, 10],
                            [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    later, inside = mrope_positions(torch.tensor([14, 15]), spans)  # decode rows: index + delta, all equal
    assert not inside and later.tolist() == [[11, 12]] * 3


def test_processor_tokens_and_hash(pair):
    _, _, proc = pair
    a, b = proc.process(random_image(0, 100, 150)), proc.process(random_image(1, 100, 150))
    assert a.grid == (1, 8, 10) and a.num_tokens == 20 and tuple(a.pixel_values.shape) == (80, 1176)
    toks = proc.tokens(a)
    assert toks.ids == [VISION_START] + [IMAGE_TOKEN] * 20 + [VISION_END] and (toks.start, toks.end) == (1, 21)
    assert proc.content_hash(a) == proc.content_hash(proc.process(random_image(0, 100, 150)))
    assert proc.content_hash(a) != proc.content_hash(b)
    big = proc.process(random_image(2, 1000, 700))  # resized under max_pixels (64 merged blocks), aspect kept
    assert big.num_tokens <= 64 and big.grid[1] > big.grid[2]


@pytest.mark.parametrize("cut", [None, 9, 14])
def test_prompt_logits_equal_transformers(pair, cut):
    """The whole prompt in one extend, or two chunks whose border falls inside the image's tokens."""
    runner, ref, proc = pair
    ids, item = image_prompt(proc, random_image(0, 100, 150))  # 20 image tokens at [6, 26)
    want = hf_logits(ref, ids, item)
    d = VLDriver(runner, item)
    try:
        got = d.step(ids) if cut is None else torch.cat([d.step(ids[:cut]), d.step(ids[cut:])])
        assert d.last_positions.dim() == 2  # the last step has image rows (or text after one: still (3, T))
    finally:
        d.close()
    assert rel_err(got, want) < TOL


def test_decode_after_the_image_equals_transformers(pair):
    runner, ref, proc = pair
    ids, item = image_prompt(proc, random_image(1, 90, 60), seed=3)
    d = VLDriver(runner, item)
    seq = list(ids)
    try:
        last = d.step(ids)[-1]
        for _ in range(6):
            seq.append(int(last.argmax()))
            last = d.step(seq[-1:])[-1]
            assert d.last_positions.dim() == 1  # the plain rotary at index + delta
            assert rel_err(last, hf_logits(ref, seq, item)[-1]) < TOL
    finally:
        d.close()


@pytest.mark.skipif(not (cpu.available() and cpu.lib().has_decode_step),
                    reason="the fused decode step needs the CPU kernels built with AVX512-BF16")
def test_fused_decode_step_runs_mrope_decode(monkeypatch):
    """bf16: decode steps after the image take the fused CPU step (positions index + delta through its plain
    rotary) and give the unfused path's logits."""
    folder = tiny_vl_dir("qwen2_vl")
    fused, plain = (ModelRunner(RuntimeConfig(model=str(folder), dtype="bfloat16", max_total_tokens=1024,
                                              max_running_requests=2)) for _ in range(2))
    assert fused.fused_decode is not None
    plain.fused_decode = None
    proc = processor_for("qwen2_vl", read_hf_config(folder), folder)
    ids, item = image_prompt(proc, random_image(5, 120, 90), seed=4)
    calls = []
    real = cpu_fused.decode_step
    monkeypatch.setattr(cpu_fused, "decode_step", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = {}
    for name, runner in (("fused", fused), ("plain", plain)):
        d = VLDriver(runner, item)
        last, rows, toks = d.step(ids)[-1], [], []
        for _ in range(8):
            toks.append(int(last.argmax()))
            last = d.step(toks[-1:])[-1]
            rows.append(last)
        d.close()
        out[name] = (toks, torch.stack(rows))
    assert len(calls) == 8  # the fused runner's decode steps only
    assert out["fused"][0] == out["plain"][0]
    f, p = out["fused"][1], out["plain"][1]
    assert ((f - p).norm() / p.norm()).item() < 2e-2


def test_fused_step_positions_remapped_to_indices():
    """The C step takes a row's context as its position + 1: M-RoPE positions (index + delta) go to it as the
    indices over a remapped table; two rows at one index with different positions make the step unfused."""
    from radixgen.runtime.executor.cpu_decode import _row_indices, rotary_at_indices

    table = torch.randn(64, 8)

    def step(prefix, positions):
        n = len(prefix)
        return ForwardInput(torch.zeros(n, dtype=torch.int64), torch.tensor(positions), torch.zeros(n),
                            torch.arange(n), list(prefix), [1] * n, torch.arange(n), media=((),) * n)

    fi = step([30, 12], [22, 12])  # an image request (delta -8) and a text one
    pos, t = rotary_at_indices(fi, fi.positions, table)
    assert pos.tolist() == [30, 12] and torch.equal(t[30], table[22]) and torch.equal(t[12], table[12])
    assert rotary_at_indices(step([5], [5]), torch.tensor([5]), table)[1] is table  # no remap where equal
    assert _row_indices(step([30, 30], [22, 30])) is None  # one index, two positions


def test_hub_style_config_reads_as_the_nested_one():
    """Checkpoints on the hub keep the language model's fields at the top level and name M-RoPE a rope type
    (rope_scaling {"type": "mrope"}); transformers 5 nests them in text_config. Both read the same."""
    from radixgen.runtime.config import ModelConfig

    nested = read_hf_config(tiny_vl_dir("qwen2_vl"))
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    flat.update({k: v for k, v in nested["text_config"].items() if k not in ("rope_parameters", "model_type")})
    flat.update(model_type="qwen2_vl", rope_theta=1e6, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    a, b = ModelConfig.from_hf(nested), ModelConfig.from_hf(flat)
    assert replace(a, multimodal=None) == replace(b, multimodal=None)  # the whole config itself differs
    assert a.multimodal["vision_config"] == b.multimodal["vision_config"]
    assert a.architecture == "qwen2_vl" and a.text_architecture == "qwen2" and a.mrope_section == (2, 3, 3)
    assert a.rope_scaling is None and a.rope_theta == 1e6 and a.hidden_size == 64


def test_positions_hook_over_a_mixed_step(pair):
    """One step of three requests: rows inside an image (a chunk), rows past an image (decode), a text request."""
    runner, _, proc = pair
    a = proc.process(random_image(0, 100, 150))  # 1 x 8 x 10 patches: 4 x 5 merged, 20 tokens
    item = MediaItem("image", proc.content_hash(a), 3, 23, payload=a)
    step = StepMedia([0, 40, 7], [25, 1, 2], ((item,), (item,), ()))
    plain = torch.cat([torch.arange(25), torch.tensor([40]), torch.arange(7, 9)])
    pos = runner.model.positions(plain, step)
    want, _ = mrope_positions(torch.arange(25), [ImageSpan(3, 23, 1, 4, 5)])
    assert pos.shape == (3, 28) and torch.equal(pos[:, :25], want)
    assert pos[:, 25].tolist() == [40 - 15] * 3 and pos[:, 26:].tolist() == [[7, 8]] * 3  # shift 5 - 20
    decode = runner.model.positions(torch.tensor([40, 7]), StepMedia([40, 7], [1, 1], ((item,), ())))
    assert decode.tolist() == [25, 7]


def test_vision_language_models_in_the_registry_read_no_gguf():
    from radixgen.runtime.models import for_gguf, gguf_architectures, model_class

    assert model_class("qwen2_5_vl").qwen2_5 and not model_class("qwen2_vl").qwen2_5
    assert "qwen2" in gguf_architectures() and for_gguf("qwen2_vl") is None
