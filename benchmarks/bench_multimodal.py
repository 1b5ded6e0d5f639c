"""Image input: what the radix and encoder caches buy, and our engine against transformers, on vision-language
checkpoints of a 0.5B-shaped language model (Qwen2-0.5B's: hidden 896, 24 layers, 14 / 2 heads, MLP 4864; the
bundled tokenizer's 49k vocabulary) with random weights, written once by this script with transformers' own
config and model classes (nothing is downloaded):

  qwen2_vl  Qwen2-VL: an 8-block, 640-wide dynamic-resolution vision transformer (a 448 x 448 image: 1024
            patches, 256 image tokens), M-RoPE
  llava     LLaVA: a ViT-B-wide CLIP tower with LLaVA-1.5's geometry, 336 x 336 in patches of 14 (576 image
            tokens, as every LLaVA-1.5 prompt carries), a two-layer projector

(a) 8 questions about one image sent together (12 question tokens each, answers of --max-new tokens: 8), radix
    and encoder caches on (the scheduler computes the shared image prefix once: the others wait a step and read it
    from the tree), against both off (requests arriving in one step still share one encoder call): requests/s.
(b) batch 1: prefill of an image prompt (the image's processing and encoding included: the time to the first
    token) and decode tokens/s (the median time per token while streaming), ours in bf16 (the fused CPU decode
    step; prefill and the encoder on oneDNN's AMX tiles where the CPU has them) against transformers' `generate`
    in bf16 and float32, each figure against transformers' best dtype for it; the encoder time per image.

All in one run, on one machine. This process sets GOMP_SPINCOUNT as our rank processes do (see the import).

    python benchmarks/bench_multimodal.py [--models qwen2_vl,llava] [--quick] [--report DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

# transformers' side (this process) waits at OpenMP barriers as our rank processes do (engine/ranks.py): set before
# torch loads libgomp, so that on a busy machine the comparison is of the two engines' work, not of spin policies
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import torch  # noqa: E402
from report import Report, add_report_arg  # noqa: E402

from radixgen.common.prompt import MediaSegment, Prompt  # noqa: E402
from radixgen.runtime.engine import Engine  # noqa: E402
from radixgen.runtime.loader import read_hf_config, resolve_model_path  # noqa: E402

VOCAB = 49216  # the bundled tokenizer's 49152, padded; the image / vision ids are in the padding
IMAGE_ID, VISION_START, VISION_END, VIDEO_ID = 49200, 49201, 49202, 49203
TEXT = dict(vocab_size=VOCAB, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
QUESTION_TOKENS, SYSTEM_TOKENS = 12, 24


def hf_config(kind: str):
    import transformers as tf

    if kind == "qwen2_vl":
        text = dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]})
        vision = dict(depth=8, embed_dim=640, hidden_size=896, num_heads=10, mlp_ratio=4, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        return tf.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_ID,
                                video_token_id=VIDEO_ID, vision_start_token_id=VISION_START,
                                vision_end_token_id=VISION_END, tie_word_embeddings=False)
    vision = tf.CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                 image_size=336, patch_size=14, projection_dim=512)
    return tf.LlavaConfig(vision_config=vision, text_config=tf.Qwen2Config(**TEXT, rope_theta=1e6),
                          image_token_index=IMAGE_ID, projector_hidden_act="gelu", tie_word_embeddings=False)


def checkpoint(kind: str) -> Path:
    """The benchmark's checkpoint folder (written once): bf16 safetensors, the bundled tokenizer, the image
    processor's config."""
    import transformers as tf

    root = Path(os.environ.get("RADIXGEN_CACHE", Path.home() / ".cache" / "radixgen")) / "bench"
    out = root / f"{kind}-0.5b" if kind == "qwen2_vl" else root / f"{kind}-0.5b-336"
    if (out / "DONE").exists():
        return out
    tmp = root / f"{out.name}.tmp{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cls = tf.Qwen2VLForConditionalGeneration if kind == "qwen2_vl" else tf.LlavaForConditionalGeneration
    cls(hf_config(kind)).to(torch.bfloat16).save_pretrained(tmp)
    for f in resolve_model_path(None).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp / f.name)
    if kind == "qwen2_vl":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 1280).save_pretrained(tmp)
    else:
        clip = tf.CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
        clip.save_pretrained(tmp)
    (tmp / "DONE").write_text("ok\n")
    tmp.rename(out)
    return out


def test_image(kind: str):
    """A photo-like image (smooth gradients and a few shapes), 448 x 448 for Qwen2-VL, 480 x 360 for LLaVA (its
    processor resizes and crops it to 336)."""
    from PIL import Image, ImageDraw

    w, h = (448, 448) if kind == "qwen2_vl" else (480, 360)
    img = Image.new("RGB", (w, h))
    px = img.load()
    for y in range(h):
        for x in range(w):
            px[x, y] = (x * 255 // w, y * 255 // h, (x + y) * 127 // (w + h) + 64)
    d = ImageDraw.Draw(img)
    d.ellipse((w // 5, h // 5, w // 2, h // 2), fill=(220, 40, 40))
    d.rectangle((w // 2, h // 2, 4 * w // 5, 4 * h // 5), fill=(30, 30, 200))
    return img


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prompt(image, question: int) -> Prompt:
    return Prompt.of(ids(0, SYSTEM_TOKENS), MediaSegment.image(image), ids(100 + question, QUESTION_TOKENS))


def questions_run(eng: Engine, image, n: int, max_new: int) -> dict:
    """n questions about one image, sent together; requests/s, cached tokens, how often the image was encoded."""
    eng.flush_cache()
    sp = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
    before = eng.get_server_info()["encoder_cache"]["encoded_items"]
    t = time.perf_counter()
    outs = eng.generate([prompt(image, q) for q in range(n)], sp)
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "rps": n / seconds, "cached": sum(r["meta_info"]["cached_tokens"] for r in outs),
            "prompt": sum(r["meta_info"]["prompt_tokens"] for r in outs),
            "encoded": eng.get_server_info()["encoder_cache"]["encoded_items"] - before}


def rates(t0: float, marks: list[tuple[float, int]]) -> dict:
    """Time to the first token and the decode rate from (time, tokens so far) marks: the median time per token
    between marks, which a busy machine's stalls move less than a total would."""
    marks = [m for m in marks if m[1] > 0]
    per_token = [(b[0] - a[0]) / (b[1] - a[1]) for a, b in zip(marks, marks[1:], strict=False) if b[1] > a[1]]
    return {"prefill_s": marks[0][0] - t0, "decode_tps": 1.0 / statistics.median(per_token)}


def best_of(runs: list[dict]) -> dict:
    return {"prefill_s": min(r["prefill_s"] for r in runs), "decode_tps": max(r["decode_tps"] for r in runs)}


def ours_b1(eng: Engine, image, new_tokens: int, reps: int) -> dict:
    """Batch 1, caches flushed: the time to the first token (the image's processing and encoding, the prefill)
    and the decode rate, streamed; best of `reps`."""
    runs = []
    for _ in range(reps):
        eng.flush_cache()
        marks = []
        t0 = time.perf_counter()
        for chunk in eng.generate(prompt(image, 0), {"max_new_tokens": new_tokens, "temperature": 0.0,
                                                     "ignore_eos": True}, stream=True):
            marks.append((time.perf_counter(), len(chunk["output_ids"])))
        assert marks[-1][1] == new_tokens
        runs.append(rates(t0, marks))
    return {**best_of(runs), "prompt_tokens": chunk["meta_info"]["prompt_tokens"]}


class Marks:
    """A transformers streamer that notes when each new token arrives (its first put is the prompt)."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, int]] = []

    def put(self, value) -> None:
        self.marks.append((time.perf_counter(), len(self.marks)))

    def end(self) -> None:
        pass


class HF:
    """transformers' model and processor for one checkpoint, in one dtype."""

    def __init__(self, kind: str, folder: Path, dtype: torch.dtype) -> None:
        import transformers as tf

        self.kind, self.dtype = kind, dtype
        cls = tf.Qwen2VLForConditionalGeneration if kind == "qwen2_vl" else tf.LlavaForConditionalGeneration
        self.model = cls.from_pretrained(folder, dtype=dtype).eval()
        if kind == "qwen2_vl":
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            self.processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
        else:
            self.processor = tf.CLIPImageProcessorPil.from_pretrained(folder)

    def inputs(self, image) -> dict:
        """The same token ids as our prompt(image, 0), and the processed pixels."""
        px = self.processor(images=image, return_tensors="pt")
        pixels = px["pixel_values"].to(self.dtype)
        if self.kind == "qwen2_vl":
            grid = px["image_grid_thw"]
            n = int(grid.prod()) // 4
            image_ids = [VISION_START] + [IMAGE_ID] * n + [VISION_END]
        else:
            n = (336 // 14) ** 2
            image_ids = [IMAGE_ID] * n
        t = torch.tensor([ids(0, SYSTEM_TOKENS) + image_ids + ids(100, QUESTION_TOKENS)])
        kw = {"input_ids": t, "pixel_values": pixels}
        if self.kind == "qwen2_vl":
            kw.update(image_grid_thw=grid, mm_token_type_ids=(t == IMAGE_ID).int())
        return kw

    def b1(self, image, new_tokens: int, reps: int) -> dict:
        """As ours_b1: the image's processing inside the time to the first token."""
        runs = []
        for _ in range(reps):
            streamer = Marks()
            t0 = time.perf_counter()
            kw = self.inputs(image)
            with torch.no_grad():
                out = self.model.generate(**kw, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                          do_sample=False, pad_token_id=0, streamer=streamer)
            assert out.shape[1] - kw["input_ids"].shape[1] == new_tokens
            runs.append(rates(t0, streamer.marks))
        return best_of(runs)

    def encoder_s(self, image, reps: int) -> float:
        kw = self.inputs(image)
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            with torch.no_grad():
                if self.kind == "qwen2_vl":
                    self.model.model.get_image_features(kw["pixel_values"], kw["image_grid_thw"])
                else:
                    self.model.model.get_image_features(pixel_values=kw["pixel_values"])
            best = min(best, time.perf_counter() - t)
        return best


def ours_encoder_s(kind: str, folder: Path, image, reps: int) -> float:
    """Our vision tower (and projector) on one image, as the scheduler process runs it (a ModelRunner in bf16)."""
    from radixgen.runtime.config import RuntimeConfig
    from radixgen.runtime.executor.model_runner import ModelRunner
    from radixgen.runtime.media import processor_for

    runner = ModelRunner(RuntimeConfig(model=str(folder), dtype="bfloat16", max_total_tokens=1024))
    item = processor_for(kind, read_hf_config(folder), folder).process(image)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps + 1):  # the first warms the kernels
            t = time.perf_counter()
            runner.model.encode([item])
            best = min(best, time.perf_counter() - t)
    del runner
    return best


def run_model(kind: str, args) -> dict:
    folder = checkpoint(kind)
    image = test_image(kind)
    res: dict = {}
    for label, kw in (("caches on", {}), ("caches off", {"disable_radix_cache": True, "encoder_cache_tokens": 0})):
        with Engine(str(folder), dtype="bfloat16", max_total_tokens=16384, **kw) as eng:
            eng.generate(prompt(image, 99), {"max_new_tokens": 2})  # warm up
            res[label] = questions_run(eng, image, 8, args.max_new)
            print(f"{kind:9} 8 questions, {label:10} {res[label]['rps']:6.2f} req/s  "
                  f"cached {res[label]['cached'] / res[label]['prompt']:.0%} of prompt tokens, image encoded "
                  f"{res[label]['encoded']}x", flush=True)
            if label == "caches on":
                res["ours"] = ours_b1(eng, image, args.new_tokens, args.reps)
                print(f"{kind:9} ours b1: prefill {res['ours']['prefill_s'] * 1e3:.0f} ms "
                      f"({res['ours']['prompt_tokens']} prompt tokens), decode {res['ours']['decode_tps']:.1f} tok/s",
                      flush=True)
    res["ours_encoder_s"] = ours_encoder_s(kind, folder, image, args.reps)
    runs = []
    for dtype in (torch.bfloat16, torch.float32):  # transformers in each dtype; each figure against its best
        hf = HF(kind, folder, dtype)
        r = hf.b1(image, args.new_tokens, args.reps)
        r["encoder_s"] = hf.encoder_s(image, args.reps)
        r["dtype"] = str(dtype).removeprefix("torch.")
        print(f"{kind:9} transformers {r['dtype']}: prefill {r['prefill_s'] * 1e3:.0f} ms, decode "
              f"{r['decode_tps']:.1f} tok/s, encoder {r['encoder_s'] * 1e3:.0f} ms", flush=True)
        runs.append(r)
        del hf
    res["hf"] = max(runs, key=lambda r: r["decode_tps"])
    res["hf_prefill"] = min(runs, key=lambda r: r["prefill_s"])
    res["hf_encoder"] = min(runs, key=lambda r: r["encoder_s"])
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2_vl,llava", help="comma-separated: qwen2_vl, llava")
    ap.add_argument("--max-new", type=int, default=8, help="tokens per answer in (a)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens generated in (b)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions in (b); the best is kept")
    ap.add_argument("--quick", action="store_true", help="(b) with 12 tokens, one repetition")
    add_report_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.new_tokens, args.reps = 12, 1
    report = Report(args.report, "bench_multimodal", "Image input: caches, and against transformers") \
        if args.report else None
    kinds = [k.strip() for k in args.models.split(",") if k.strip()]
    for k in kinds:
        if k not in ("qwen2_vl", "llava"):
            raise SystemExit(f"--models: unknown {k!r} (qwen2_vl, llava)")
    torch.set_num_threads(os.cpu_count() or 1)
    import transformers as tf

    tf.utils.logging.disable_progress_bar()
    results = {k: run_model(k, args) for k in kinds}
    rows = []
    print(f"\n{'model':9} {'8 questions: on / off':>22} {'prefill ms ours / hf':>24} {'decode tok/s ours / hf':>28} "
          f"{'encoder ms ours / hf':>26}   (hf: its best dtype for each)")
    for k, r in results.items():
        on, off, ours, hf = r["caches on"], r["caches off"], r["ours"], r["hf"]
        hp, he = r["hf_prefill"], r["hf_encoder"]
        cells = [k, f"{on['rps'] / off['rps']:.2f}x",
                 f"{ours['prefill_s'] * 1e3:.0f} / {hp['prefill_s'] * 1e3:.0f} {hp['dtype']}",
                 f"{ours['decode_tps']:.1f} / {hf['decode_tps']:.1f} {hf['dtype']} "
                 f"({ours['decode_tps'] / hf['decode_tps']:.2f}x)",
                 f"{r['ours_encoder_s'] * 1e3:.0f} / {he['encoder_s'] * 1e3:.0f} {he['dtype']}"]
        rows.append(cells)
        print(f"{cells[0]:9} {cells[1]:>22} {cells[2]:>24} {cells[3]:>28} {cells[4]:>26}")
    print(f"load average: {os.getloadavg()[0]:.2f} (1 min)")
    if report is not None:
        report.text("Vision-language checkpoints of a 0.5B-shaped language model with random weights (see the "
                    "script's docstring). (a): 8 questions about one image sent together, radix and encoder caches "
                    "on against off. (b): batch 1, ours in bf16 against transformers' "
                    "`generate` in its best dtype for each figure; prefill is the time to the first token, image "
                    "processing and encoding included.")
        report.bars("questions", "8 questions about one image: requests/s, caches on against off", kinds,
                    {"caches on": [results[k]["caches on"]["rps"] / results[k]["caches off"]["rps"] for k in kinds]},
                    ylabel="speed-up (x)", baseline=1.0)
        report.bars("decode", "Batch-1 decode against transformers", kinds,
                    {"ours": [results[k]["ours"]["decode_tps"] / results[k]["hf"]["decode_tps"] for k in kinds]},
                    ylabel="speed-up (x)", baseline=1.0)
        report.table(["model", "8 questions on / off", "prefill ms ours / hf", "decode tok/s ours / hf",
                      "encoder ms ours / hf"], rows)
        report.write()


if __name__ == "__main__":
    main()
