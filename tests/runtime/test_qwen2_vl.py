"""Qwen2-VL / Qwen2.5-VL: our vision tower and our M-RoPE decoder over the paged KV pool against transformers'
own model on the same tiny random weights (float32): the vision tower's output, the prompt's logits (in one
extend, and in chunks that cut through the image), and decode steps after the image."""

from __future__ import annotations

import pytest
import torch
from kv_helpers import kv_of
from tiny_vl_models import IMAGE_TOKEN, VISION_END, VISION_START, hf_vl_model, image_patches, tiny_vl_dir

from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.forward_context import ForwardContext, forward_context
from radixgen.runtime.executor.model_runner import ModelRunner
from radixgen.runtime.models.qwen2_vl import mrope_positions
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
    return runner, cls.from_pretrained(folder, dtype=torch.float32).eval()


def image_prompt(grid, before: int = 5, after: int = 7, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 49152, (before + after,), generator=gen).tolist()
    n = grid[0] * grid[1] * grid[2] // 4
    return text[:before] + [VISION_START] + [IMAGE_TOKEN] * n + [VISION_END] + text[before:]


def hf_logits(ref, ids, pixels, grid) -> torch.Tensor:
    t = torch.tensor([ids])
    with torch.no_grad():
        return ref(input_ids=t, pixel_values=pixels, image_grid_thw=torch.tensor([grid]),
                   mm_token_type_ids=(t == IMAGE_TOKEN).int()).logits[0]


class VLDriver:
    """One request's steps straight through the runner's model: M-RoPE positions, the image's rows in place."""

    def __init__(self, runner, ids, pixels, grid) -> None:
        self.runner, self.model = runner, runner.model
        self.ids = list(ids)
        self.rope = mrope_positions(ids, [grid], IMAGE_TOKEN, 2)
        self.image = self.model.encode([pixels], [grid])[0]  # (n, hidden)
        self.image_at = ids.index(IMAGE_TOKEN)
        self.kv = kv_of(runner)
        self.row, self.len, self.slots = self.kv.table.allocate(), 0, []

    def step(self, ids: list[int]) -> torch.Tensor:
        start, n = self.len, len(ids)
        slots = self.kv.allocator.allocate(n)
        self.slots.append(slots)
        self.kv.table.write(self.row, start, slots)
        prompt = self.rope.positions.shape[1]
        if start + n <= prompt:
            positions = self.rope.positions[:, start:start + n].contiguous()
        else:  # after the prompt: index + delta, the plain rotary
            positions = torch.arange(start, start + n) + self.rope.delta
        idx = torch.arange(start, start + n)
        in_image = (idx >= self.image_at) & (idx < self.image_at + self.image.shape[0])
        rows = in_image.nonzero().flatten()
        ctx = ForwardContext(is_decode=n == 1, kv_pool=self.runner.kv_pool, out_slots=slots,
                             req_to_slot=self.runner.req_to_slot, req_indices=torch.tensor([self.row]),
                             prefix_lens=[start], extend_lens=[n], backend=self.runner.ops.attention)
        self.runner.ops.attention.prepare(ctx)
        with torch.inference_mode(), forward_context(ctx):
            hidden = self.model(torch.tensor(ids), positions, embed_rows=rows if rows.numel() else None,
                                embeds=self.image[idx[rows] - self.image_at] if rows.numel() else None)
        self.len += n
        return self.model.compute_logits(hidden)

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
    # 2 text, a 1 x 4 x 6 patch image (2 x 3 merged), 3 text
    ids = [7, 8] + [IMAGE_TOKEN] * 6 + [9, 10, 11]
    pos, delta = mrope_positions(ids, [(1, 4, 6)], IMAGE_TOKEN, 2)
    assert pos.tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 7],
                            [0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 7],
                            [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7]]
    assert delta == 8 - 11
    with pytest.raises(ValueError, match="consecutive placeholder"):
        mrope_positions(ids[:5], [(1, 4, 6)], IMAGE_TOKEN, 2)
    with pytest.raises(ValueError, match="without their placeholder"):
        mrope_positions([1, 2], [(1, 4, 6)], IMAGE_TOKEN, 2)


@pytest.mark.parametrize("cut", [None, 9, 14])
def test_prompt_logits_equal_transformers(pair, cut):
    """The whole prompt in one extend, or two chunks whose border falls inside the image's tokens."""
    runner, ref = pair
    pixels, grid = image_patches(0, 100, 150)  # 8 x 10 patches: 20 image tokens from row 6
    ids = image_prompt(grid)
    want = hf_logits(ref, ids, pixels, grid)
    d = VLDriver(runner, ids, pixels, grid)
    try:
        if cut is None:
            got = d.step(ids)
        else:
            got = torch.cat([d.step(ids[:cut]), d.step(ids[cut:])])
    finally:
        d.close()
    assert rel_err(got, want) < TOL


def test_decode_after_the_image_equals_transformers(pair):
    runner, ref = pair
    pixels, grid = image_patches(1, 90, 60)
    ids = image_prompt(grid, seed=3)
    d = VLDriver(runner, ids, pixels, grid)
    seq = list(ids)
    try:
        last = d.step(ids)[-1]
        for _ in range(6):
            seq.append(int(last.argmax()))
            last = d.step(seq[-1:])[-1]
            assert rel_err(last, hf_logits(ref, seq, pixels, grid)[-1]) < TOL
    finally:
        d.close()
