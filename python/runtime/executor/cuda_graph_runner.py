"""CUDA graphs of decode steps: one graph per batch-size bucket, replayed with the batch padded up to its bucket.

A decode step of B requests is B one-token rows. The runner owns static device buffers sized for the largest
bucket (input_ids, positions, out_slots, req_indices, seq_lens, and a float32 logits buffer), and each bucket's
graph was captured reading and writing only those, plus tensors that never move (weights, the KV pool, the
request->slot table). A replay copies the real batch into rows [0, B), fills rows [B, bucket) with padding,
replays the bucket's graph and returns the logits of the batch's `logit_rows` (a copy: the next replay
overwrites the static buffer).

Padding rows are inert: input id 0 at position 0, K/V written to the reserved padding slot 0 (never handed out
by the SlotAllocator), request row = the table's reserved `padding_row` (all entries 0), seq_len 1. So a padding
row writes and reads slot 0 only; real requests read slot 0 only under a mask, and nothing is allocated.

Capture: largest bucket first, all graphs in one shared memory pool (later, smaller captures reuse what the
larger ones freed), each after warm-up runs on the capture stream (Triton compiles, cuBLAS picks its kernels,
the allocator grows). Inside a graph the decode attention metadata is the static seq_lens tensor, installed by
`TritonAttentionBackend.prepare_static`: the only host-side value baked into a graph is its bucket size.
The torch ops cache their rotary cos/sin lookup by the identity of the positions tensor; every run passes a fresh
slice of the static positions buffer (a new tensor object), so each run looks it up again.

CPU testability: `CudaGraphRunner(runner, capture=False)` captures nothing; each replay runs the model eagerly
on the same static, padded buffers through the same code (`_load`, `_run`, the logits read-back). With an
attention backend that has `prepare_static` (Triton, interpreted on the CPU) that is exactly the graph's code
path; the torch and CPU backends have none, so there the runner builds its metadata with the ordinary `prepare` from
lists read back from the static seq_lens buffer (the padded batch, padding rows included, still runs through
attention). CPU tests therefore cover: bucket choice, copy-in and padding of every buffer, the reserved slot and
row, logits of the real rows against the eager forward, KV written only to the real rows' slots and slot 0, no
slot leak. They do not cover the capture itself: side-stream warm-up, the shared pool, that recorded kernels
read the static buffers rather than copies, that nothing syncs the host during capture, graph-vs-eager numerics
on the GPU. Those need CUDA (the skipped-on-CPU test in tests/runtime/test_cuda_graph_runner.py, and
benchmarks/gpu_check.py).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch

from radixgen.runtime.ground.forward_context import ForwardContext, forward_context

if TYPE_CHECKING:
    from radixgen.runtime.executor.model_runner import ForwardInput, ModelRunner

logger = logging.getLogger(__name__)

PADDING_SLOT = 0  # the KV pool's reserved slot (SlotAllocator never hands it out)
WARMUP_RUNS = 2  # eager runs of each bucket before its capture


def batch_size_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_bs, and max_bs itself."""
    if max_bs < 1:
        raise ValueError(f"max_bs must be >= 1, got {max_bs}")
    sizes = {b for b in (1, 2, 4, 8) if b <= max_bs} | set(range(16, max_bs + 1, 8)) | {max_bs}
    return sorted(sizes)


def graph_unsafe(model) -> str | None:
    """Why a decode step of `model` (a models.decoder.CausalLM) cannot be captured, by what its decoder layers say
    of themselves (models.parts.MLPStructure.graph_safe: an expert block routes with data-dependent shapes), or
    None where it can."""
    for i, layer in enumerate(model.decoder_structure()):
        if not layer.mlp.graph_safe:
            return f"layer {model.start_layer + i}'s MLP part {layer.mlp.kind!r} is not graph-safe"
        if layer.attention.variant is not None:  # the masked path reads the step's lengths on the host
            return f"layer {model.start_layer + i}'s attention has {layer.attention.variant}"
    return getattr(model, "unfused", lambda: None)()  # what the model adds around its layers


class CudaGraphRunner:
    """Decode steps of up to `max_bs` requests, replayed from per-bucket CUDA graphs (see the module doc)."""

    def __init__(self, runner: ModelRunner, max_bs: int | None = None, capture: bool = True) -> None:
        cfg = runner.runtime_config
        reason = graph_unsafe(runner.model)
        if reason is not None:
            raise ValueError(f"CUDA graphs cannot capture this model's decode step: {reason}; run it with "
                             f"disable_cuda_graph")
        self.runner = runner
        self.capture_graphs = capture
        if max_bs is None:
            max_bs = min(cfg.max_running_requests, cfg.cuda_graph_max_bs)
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        device = runner.device
        # one (5, max_bs) int64 matrix: its rows are the static inputs, so padding a range is one copy
        pad_values = [0, 0, PADDING_SLOT, runner.padding_row, 1]
        self._pad = torch.tensor(pad_values, dtype=torch.int64).unsqueeze(1).expand(5, self.max_bs)
        self._pad = self._pad.contiguous().to(device)
        self._buf = self._pad.clone()
        self.input_ids, self.positions, self.out_slots, self.req_indices, self.seq_lens = self._buf.unbind(0)
        # this rank's vocabulary rows (all of them at tp 1): a graph records no collective but the layers'
        # all-reduces; the logits of a tensor-parallel group are gathered after the replay
        self.logits = torch.zeros((self.max_bs, runner.model.lm_head.out_features), dtype=torch.float32,
                                  device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0
        if capture:
            self.capture()

    # ------------------------------------------------------------------ use

    def bucket_for(self, batch_size: int) -> int:
        i = bisect.bisect_left(self.buckets, batch_size)
        if batch_size < 1 or i == len(self.buckets):
            raise ValueError(f"batch size {batch_size} is outside the captured buckets 1..{self.max_bs}")
        return self.buckets[i]

    def can_run(self, fi: ForwardInput) -> bool:
        return fi.is_decode and 0 < len(fi.extend_lens) <= self.max_bs

    @torch.inference_mode()
    def replay(self, fi: ForwardInput) -> torch.Tensor | None:
        """The decode step `fi` -> float32 logits (N, V) of fi.logit_rows, like ModelRunner.run_stage (with
        tensor parallelism every rank replays its graph, in step with the others: the graphs hold the layers'
        all-reduces; the logits are on the first rank, None on the others)."""
        if not self.can_run(fi):
            raise ValueError(f"not a decode step of 1..{self.max_bs} requests")
        bs = len(fi.extend_lens)
        bucket = self.bucket_for(bs)
        self._load(fi, bs, bucket)
        if self.capture_graphs:
            self.graphs[bucket].replay()
        else:
            self._run(bucket)
        self.replays += 1
        rows = fi.logit_rows.to(self.logits.device, torch.int64, non_blocking=True)
        return self.runner.model.lm_head.gather(self.logits[:bs].index_select(0, rows))

    def _load(self, fi: ForwardInput, bs: int, bucket: int) -> None:
        """Real rows into [0, bs), padding into [bs, bucket); rows past the bucket are not read."""
        seq_lens = torch.tensor([p + 1 for p in fi.prefix_lens], dtype=torch.int64)
        for dst, src in ((self.input_ids, fi.input_ids), (self.positions, fi.positions),
                         (self.out_slots, fi.out_slots), (self.req_indices, fi.req_indices),
                         (self.seq_lens, seq_lens)):
            if src.shape != (bs,):
                raise ValueError(f"a decode step of {bs} requests needs ({bs},) inputs, got {tuple(src.shape)}")
            dst[:bs].copy_(src, non_blocking=True)
        if bucket > bs:
            self._buf[:, bs:bucket].copy_(self._pad[:, bs:bucket])

    def _run(self, bs: int) -> None:
        """The model on static rows [0, bs), logits into self.logits[:bs]: what each graph records."""
        mr = self.runner
        backend = mr.ops.attention
        # the lists describe the capture batch, not a replay's: with prepare_static nothing reads them
        ctx = ForwardContext(
            is_decode=True, kv_pool=mr.kv_pool, out_slots=self.out_slots[:bs], req_to_slot=mr.req_to_slot,
            req_indices=self.req_indices[:bs], prefix_lens=[0] * bs, extend_lens=[1] * bs, backend=backend,
        )
        seq_lens = self.seq_lens[:bs]
        if hasattr(backend, "prepare_static"):
            backend.prepare_static(ctx, seq_lens)
        else:  # eager mode only (capture() refuses such a backend): the torch and CPU backends read host lists
            ctx.prefix_lens = (seq_lens - 1).tolist()
            backend.prepare(ctx)
        with forward_context(ctx):
            # fresh slices each run: a new positions object makes the rotary cache look its table up again
            hidden = mr.model(self.input_ids[:bs], self.positions[:bs])
        self.logits[:bs].copy_(mr.model.local_logits(hidden))

    # ------------------------------------------------------------------ capture

    def capture(self) -> None:
        mr = self.runner
        if mr.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, the model is on {mr.device}")
        if not hasattr(mr.ops.attention, "prepare_static"):
            raise RuntimeError(f"{type(mr.ops.attention).__name__} has no graph-safe prepare_static")
        start = time.perf_counter()
        self._buf.copy_(self._pad)  # all rows padding: warm-ups write K/V to slot 0 only
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=mr.device)
        with torch.inference_mode():
            for bs in reversed(self.buckets):
                stream.wait_stream(torch.cuda.current_stream(mr.device))
                with torch.cuda.stream(stream):
                    for _ in range(WARMUP_RUNS):
                        self._run(bs)
                torch.cuda.current_stream(mr.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._run(bs)
                self.graphs[bs] = graph
        torch.cuda.synchronize(mr.device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs),
                    self.buckets, time.perf_counter() - start)

    def info(self) -> dict:
        return {"enabled": True, "captured": self.capture_graphs, "buckets": list(self.buckets),
                "replays": self.replays}
