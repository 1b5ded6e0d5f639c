"""Batch -> ForwardContext -> model -> logits."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from radixgen.kernels._cpu_bindings import libc_function
from radixgen.runtime.config import ModelConfig, RuntimeConfig
from radixgen.runtime.deterministic import check_deterministic
from radixgen.runtime.executor import distributed
from radixgen.runtime.executor.cpu_decode import MAX_BATCH as MAX_FUSED_BATCH
from radixgen.runtime.executor.cpu_decode import FusedDecode
from radixgen.runtime.executor.cuda_graph_runner import CudaGraphRunner, graph_unsafe
from radixgen.runtime.executor.encoder_cache import EncoderCache
from radixgen.runtime.executor.parallel_step import StepGroup
from radixgen.runtime.executor.step_messages import ForwardInput, KVCopyQueue
from radixgen.runtime.executor.weights import load_weights, release_gguf_pages
from radixgen.runtime.ground import sharding
from radixgen.runtime.ground.forward_context import ForwardContext, forward_context, row_kernels
from radixgen.runtime.ground.kv_pool import KVPool, TableWriteLog, host_tier_pool, new_req_to_slot_table
from radixgen.runtime.ground.parallel_context import ParallelContext
from radixgen.runtime.ground.window_kv import plan_window_kv, pool_slots, window_info
from radixgen.runtime.layers import fixed_order, quantization
from radixgen.runtime.layers.ops import CpuOps, TorchOps, ops_for
from radixgen.runtime.loader import is_gguf_native, model_path_for, read_hf_config
from radixgen.runtime.lora.layer import attach as attach_lora
from radixgen.runtime.lora.pool import LoRAPool
from radixgen.runtime.models import model_class
from radixgen.runtime.models.multimodal import MediaEmbeds, StepMedia, VisionLanguageLM
from radixgen.runtime.models.parts import DENSE_GATED_SILU, MOE_GATED_SILU

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def _mallopt(settings: dict[int, int]) -> bool:
    """glibc malloc settings (mallopt parameter -> value), process-wide; False where the C library is not glibc."""
    mallopt = libc_function("mallopt")
    return mallopt is not None and all(bool(mallopt(param, value)) for param, value in settings.items())


def map_large_blocks() -> bool:
    """While the weights load: every block over 64 KiB its own mapping, given back to the kernel when freed.

    glibc otherwise raises its mmap threshold to the size of each large block freed, so after the first few
    loading temporaries (a checkpoint tensor, a dequantized or repacked weight) the next ones come from the heap,
    between the layouts that stay; freed, they cannot be returned, and the process keeps them resident (about
    200 MB for the bundled model's GGUF blocks)."""
    return _mallopt({_M_MMAP_THRESHOLD: 64 << 10})


def release_free_heap() -> bool:
    """Give the heap's free pages back to the kernel once, after start-up (glibc's malloc_trim(0)): what loading
    the weights, the tokenizer and the grammar backend freed (about 30 MB of the tokenizer's parse alone).
    keep_freed_host_memory's threshold stops only automatic trimming, so the blocks the steps reuse stay
    cached. False where the C library is not glibc."""
    trim = libc_function("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


def keep_freed_host_memory() -> bool:
    """Have glibc's malloc keep freed blocks of up to 32 MiB for reuse instead of returning them to the kernel.

    By default every block over 128 KiB is mmap'ed on allocation and unmapped on release, so each of a forward
    pass's activation tensors (a 1024-token prefill makes about 15 MB of them per layer) starts as fresh pages
    that the kernel faults in and zeroes: about 15,000 page faults and 5-8% of the prefill on this CPU. With the
    thresholds raised, the blocks are reused from one op, layer and step to the next, the way the caching
    allocators of GPU runtimes work. Process-wide and idempotent; False where the C library is not glibc."""
    return _mallopt({_M_MMAP_THRESHOLD: 32 << 20, _M_TRIM_THRESHOLD: 1 << 30})


def check_multimodal(cfg: RuntimeConfig, architecture: str) -> None:
    """What a vision-language model does not run with, refused at start with the combination named."""
    if cfg.tp_size * cfg.pp_size > 1:
        raise ValueError(f"tensor / pipeline parallelism (tp_size={cfg.tp_size}, pp_size={cfg.pp_size}) with a "
                         f"vision-language model ({architecture}) is not supported: a step's image embeddings "
                         f"are made on one rank; serve it with tp_size and pp_size 1")
    if cfg.lora_enabled:
        raise ValueError(f"LoRA adapters with a vision-language model ({architecture}) are not supported: the "
                         f"adapters would reach the language model only; serve it without --lora-paths / "
                         f"--enable-lora")
    if cfg.speculative_algorithm == "draft":
        raise ValueError(f"speculative_algorithm='draft' with a vision-language model ({architecture}) is not "
                         f"supported (the draft model has no vision encoder); use 'ngram' or none")


class ModelRunner:
    """This process's model (its shard and pipeline stage on a rank of a parallel group: `parallel`),
    the KV pool of its layers and KV heads, the request->slot table tensor, the ops set; `forward` runs a step."""

    def __init__(self, cfg: RuntimeConfig, model_path=None, req_to_slot: torch.Tensor | None = None,
                 ops: TorchOps | None = None, parallel: ParallelContext | None = None) -> None:
        """`req_to_slot`: another runner's request->slot table to read instead of a new one (a draft model's
        runner reads the target's: its pool has the same slots, and a position's slot is the same in both).
        ops: the ops set (default: the device's, `ops_for`); tests pass TritonOps to run a CPU model on the
        Triton kernels under TRITON_INTERPRET=1, how the CUDA path's wiring is checked without a GPU.
        parallel: this rank's ParallelContext, handed to the model it builds (default: the one
        distributed.init made for this process, SINGLE without a group)."""
        self.runtime_config = cfg
        self.parallel = par = parallel if parallel is not None else distributed.context()
        self.device = distributed.rank_device(cfg.device, par)
        self.dtype = cfg.torch_dtype
        self._resolve_model(model_path)
        model = self._build_model(ops)
        self._load_weights(model)
        num_slots = self._build_kv(req_to_slot)
        self._attach_step_paths()
        logger.info("model %s loaded: %s, weights %s (%.1f MB), %d KV slots (KV cache %s)", self.model_path,
                    self.dtype, self.quantization, quantization.weight_bytes(self.model) / 1e6, num_slots,
                    cfg.kv_cache_dtype)

    # ------------------------------------------------------------------ building (in this order)

    def _resolve_model(self, model_path) -> None:
        """The checkpoint: its path, config, weight format and context length."""
        cfg = self.runtime_config
        self.model_path = Path(model_path) if model_path else model_path_for(cfg)
        self.hf_config = read_hf_config(self.model_path)
        self.model_config = ModelConfig.from_hf(self.hf_config)
        mc = self.model_config
        self.quantization = quantization.resolve(cfg.quantization, self.hf_config, is_gguf_native(self.model_path),
                                                 experts=mc.moe is not None)
        self.context_length = cfg.context_length or min(mc.max_position_embeddings, 8192)
        if cfg.context_length > mc.max_position_embeddings:
            raise ValueError(f"context_length={cfg.context_length} exceeds the model's "
                             f"max_position_embeddings={mc.max_position_embeddings}")

    def _build_model(self, ops: TorchOps | None):
        """The model's modules with their parameters allocated uninitialized, directly on the device and in the
        target dtype; the ops set chosen and its linear methods prepared (what the checkpoint fills)."""
        cfg, mc, par = self.runtime_config, self.model_config, self.parallel
        # parameters are allocated uninitialized, directly on the device and in the target dtype
        if self.device.type == "cpu":
            map_large_blocks()
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = model_class(mc.architecture)(mc, par)
                # the device's ops, chosen once
                self.ops = ops or ops_for(self.device, cfg.disable_cpu_kernels, cfg.deterministic)
                if cfg.ep_size > 1 and mc.moe is None:
                    raise ValueError(f"ep_size={cfg.ep_size} splits expert blocks, and {mc.architecture} has none: "
                                     f"use ep_size=1")
                if cfg.deterministic:  # (expert blocks: their experts' layout, once loaded (fixed_order.install))
                    check_deterministic(self.quantization, self.dtype, self.ops, mc.head_dim)
                self.ops.prepare(model, self.quantization)  # linear methods: the parameters the checkpoint fills
        finally:
            torch.set_default_dtype(default_dtype)
        return model

    def _load_weights(self, model) -> None:
        """The checkpoint's values into the model, each linear layer's weight re-laid out once for the ops set."""
        cfg, mc = self.runtime_config, self.model_config
        load_weights(model, self.model_path, cfg.load_format, seed=cfg.seed, quantized=self.quantization.method)
        self.ops.install(model)  # each linear layer re-lays out its weight (one copy), before mallopt below
        if cfg.load_format != "dummy" and is_gguf_native(self.model_path):
            release_gguf_pages(model, self.model_path)  # the file's pages whose blocks were copied
        if cfg.deterministic and getattr(model, "unfused", lambda: None)() is not None:
            raise ValueError(f"deterministic mode does not run this model: {model.unfused()} (the masked attention "
                             f"path is not batch-invariant yet)")
        if cfg.deterministic:  # row-parallel sums in tp 2's fixed segments, at tp 1 and 2 alike
            for i, layer in enumerate(model.decoder_structure() if hasattr(model, "decoder_structure") else ()):
                if layer.attention.variant is not None:  # the masked attention path: not batch-invariant yet
                    raise ValueError(f"deterministic mode does not run layer {i}'s attention: it has "
                                     f"{layer.attention.variant}")
                if layer.mlp.kind not in (DENSE_GATED_SILU, MOE_GATED_SILU):  # what the mode's tests hold
                    raise ValueError(f"deterministic mode does not run layer {i}'s MLP part {layer.mlp.kind!r}: "
                                     f"not covered by the mode's tests")
            if self.device.type == "cpu":  # (CUDA: TritonOps.install checked every layer's matmul)
                fixed_order.install(model, self.ops.kl)
        self.model = model.eval()
        # a vision-language model: image embeddings by content hash, reused across requests (encoder_cache.py)
        self.encoder_cache = None
        if isinstance(model, VisionLanguageLM):
            check_multimodal(cfg, mc.architecture)
            self.encoder_cache = EncoderCache(cfg.encoder_cache_tokens)
        if self.device.type == "cpu":
            keep_freed_host_memory()

    def _build_kv(self, req_to_slot: torch.Tensor | None) -> int:
        """The KV pool, the request->slot table, the KV copy queue and the host tier; returns the pool's slots. Window
        layers keep only their last W tokens, in a pool and a table of their own, where ground/window_kv.py applies."""
        cfg, mc, par, model = self.runtime_config, self.model_config, self.parallel, self.model
        attn = model.layers[model.start_layer].self_attn  # this rank's heads
        plan = self.window_plan = plan_window_kv(
            tuple(mc.window(i) for i in range(model.start_layer, model.end_layer)), self.context_length,
            hierarchical_cache=cfg.hicache_enabled, world_size=par.world_size, page_size=cfg.page_size,
            shares_table=req_to_slot is not None, chunked_prefill=cfg.chunked_prefill_size > 0)
        token_bytes = KVPool.bytes_per_slot(1, attn.num_kv_heads, mc.head_dim, self.dtype, cfg.kv_code_dtype)
        num_slots, window_slots = (cfg.max_total_tokens or self._slots_from_memory(), 0) if plan is None else \
            pool_slots(plan, cfg.max_total_tokens, int(cfg.max_kv_memory_gb * 2**30), token_bytes,
                       cfg.chunked_prefill_size, cfg.max_running_requests)
        self.kv_pool = KVPool(model.end_layer - model.start_layer, num_slots + 1, attn.num_kv_heads, mc.head_dim,
                              self.dtype, self.device, cfg.kv_code_dtype, huge_pages=cfg.kv_huge_pages,
                              window_layers=plan.layers if plan else (), window_slots=window_slots + 1 if plan else 0)
        # the request->slot table tensor: the scheduler's KV cache manager owns its rows and writes it; the model
        # only reads it (row `padding_row` stays all padding slots). In a parallel group every rank has a copy,
        # which the others update from the writes rank 0 logs (parallel_step.py).
        shape = (cfg.max_running_requests + 1, self.context_length)
        if req_to_slot is not None and tuple(req_to_slot.shape) != shape:
            raise ValueError(f"req_to_slot: expected a table of shape {shape}, got {tuple(req_to_slot.shape)}")
        self.req_to_slot = req_to_slot if req_to_slot is not None else \
            new_req_to_slot_table(cfg.max_running_requests, self.context_length, self.device)
        self.padding_row = cfg.max_running_requests
        self.req_to_wslot = plan and new_req_to_slot_table(cfg.max_running_requests, self.context_length, self.device)
        self.table_log = TableWriteLog() if par.world_size > 1 else None
        self.kv_copies = KVCopyQueue()  # KV copy orders, applied on every rank before the next step's forward
        self.host_pool = host_tier_pool(cfg, self.kv_pool)  # the hierarchical cache's host tier (None: off)
        return num_slots

    def _attach_step_paths(self) -> None:
        """What runs around the model's forward: LoRA adapters, the fused CPU decode step, CUDA graphs, the parallel
        group's step transfers."""
        cfg, mc, par = self.runtime_config, self.model_config, self.parallel
        # the resident LoRA adapters' weights (the scheduler's LoRA manager decides which sit where)
        self.lora_pool = LoRAPool.for_config(cfg, mc, self.dtype, self.device) if cfg.lora_enabled else None
        if self.lora_pool is not None:  # the LoRA layers wrap whatever linear methods the ops set installed
            attach_lora(self.model, self.lora_pool, self.ops)
        logger.info("ops: %s (linear layers: %s)", self.ops.name, ", ".join(self.ops.linear_methods(self.model)))
        # bf16 decode batches of up to cpu_decode.MAX_BATCH on the C kernels: every layer in one C call (None where
        # that does not apply)
        kl = self.ops.kl if isinstance(self.ops, CpuOps) else None
        self.fused_decode = None if kl is None else FusedDecode.build(self.model, self.kv_pool, kl, self.lora_pool,
                                                                      piece=self.ops.attention_piece)
        # decode steps of up to cuda_graph_max_bs requests replay captured graphs (CUDA only; per rank with
        # tensor parallelism, not with pipeline stages)
        self.cuda_graph_runner: CudaGraphRunner | None = None
        if self.device.type == "cuda" and not cfg.disable_cuda_graph and par.pp_size == 1:
            reason = graph_unsafe(self.model)
            if reason is None:
                self.cuda_graph_runner = CudaGraphRunner(self)
            else:  # what the model's parts say of themselves: its decode steps run eagerly
                logger.warning("CUDA graphs off: %s", reason)
        self.group = StepGroup(self) if par.world_size > 1 else None
        # a step with embed / score requests: the hidden rows of its logits rows are kept for the pooling stage
        # (scheduler/pooling.py) as last_hidden, and the step runs eagerly (the fused and graph paths keep none)
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None

    def _lora_batch(self, fi: ForwardInput):
        if fi.lora_slots is None:
            return None
        if self.lora_pool is None:
            raise ValueError("a step with LoRA adapter rows, but LoRA is not enabled")
        return self.lora_pool.batch(fi.lora_slots, fi.extend_lens)

    def _slots_from_memory(self) -> int:
        """KV slots from max_kv_memory_gb (per rank): the same on every rank of a group (one slot table), sized
        by the rank whose layers and KV heads take the most memory per slot (an 8-bit pool's scales counted)."""
        mc, par = self.model_config, self.parallel
        per_slot = 0
        for stage in range(par.pp_size):
            start, end = sharding.layer_range(mc.num_layers, par.pp_size, stage)
            for rank in range(par.tp_size):
                heads = sharding.head_shard(mc.num_heads, mc.num_kv_heads, par.tp_size, rank)
                per_slot = max(per_slot, KVPool.bytes_per_slot(end - start, heads.num_kv_heads, mc.head_dim,
                                                               self.dtype, self.runtime_config.kv_code_dtype))
        return max(1024, min(int(self.runtime_config.max_kv_memory_gb * 2**30) // per_slot, 262144))

    def kv_cache_info(self) -> dict:
        """The KV pool for get_server_info: its storage dtype, capacity in tokens and size (with tensor / pipeline
        parallelism, this rank's pool: its stage's layers and its KV heads)."""
        p, mc = self.kv_pool, self.model_config
        return {"kv_cache_dtype": self.runtime_config.kv_cache_dtype,
                "dtype": str(p.code_dtype or p.dtype).removeprefix("torch."), "capacity_tokens": p.num_slots - 1,
                "bytes_per_token": KVPool.bytes_per_slot(len(p.k_buffers), p.k_buffers[0].shape[1], mc.head_dim,
                                                         p.dtype, p.code_dtype),
                "memory_bytes": p.nbytes(), **window_info(self.window_plan, p, mc.head_dim)}

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def memory_info(self) -> dict:
        """What the weights (each in its one layout) and the KV pool's buffers take, in bytes; the weight format."""
        return {"weight_bytes": quantization.weight_bytes(self.model), "kv_pool_bytes": self.kv_pool.nbytes(),
                "quantization": str(self.quantization)}

    def encoder_cache_info(self) -> dict | None:
        return self.encoder_cache.info() if self.encoder_cache is not None else None

    def clear_encoder_cache(self) -> None:
        if self.encoder_cache is not None:
            self.encoder_cache.clear()

    def cuda_graph_info(self) -> dict:
        g = self.cuda_graph_runner
        return {"enabled": False} if g is None else g.info()

    @torch.inference_mode()
    def forward(self, fi: ForwardInput) -> torch.Tensor:
        """Run the model on one step; return float32 logits (N, V) of `fi.logit_rows`.

        Decode steps the CUDA graph runner covers replay its graphs; everything else runs eagerly. On rank 0 of
        a parallel group the step runs on every rank (parallel_step.py)."""
        return self.collect(self.launch(fi))

    def launch(self, fi: ForwardInput):
        """Start step `fi`; `collect` gives its logits. Only with pipeline stages is anything left to wait for
        (scheduler/pipeline.py keeps several steps in flight)."""
        if self.group is not None:
            return self.group.launch(fi)
        self.apply_kv_copies()
        return self.run_stage(fi)

    def apply_kv_copies(self) -> None:
        """Run the KV copy orders given so far (before a forward; the hierarchical cache also runs them at once)."""
        if len(self.kv_copies):
            self.kv_copies.take().apply(self.kv_pool, self.host_pool)

    def collect(self, step) -> torch.Tensor:
        return self.group.collect(step) if self.group is not None else step

    @torch.inference_mode()
    def run_stage(self, fi: ForwardInput, stage_input=None):
        """This rank's part of step `fi`: the logits on the last stage's first tensor-parallel rank (None on its
        others), the StageHidden for the next stage elsewhere; a stage after the first starts from
        `stage_input`."""
        media = None
        if fi.media is not None:  # the model's positions; the image rows' embeddings (encoded or cached)
            fi, media = self.media_inputs(fi)
        g = self.cuda_graph_runner
        # graphs were captured without adapters, media or kept hidden rows
        if g is not None and fi.lora_slots is None and media is None and not self.keep_hidden and g.can_run(fi):
            return g.replay(fi)
        return self.forward_eager(fi, stage_input, media)

    def media_inputs(self, fi: ForwardInput) -> tuple[ForwardInput, MediaEmbeds | None]:
        """Step `fi` with the model's positions, and the embeddings of its image rows (None: it has none). Each
        item the step needs comes from the encoder cache or is encoded, all missing ones in one call."""
        if self.encoder_cache is None:
            raise ValueError("a step with media inputs, but the model takes text only")
        step = StepMedia(fi.prefix_lens, fi.extend_lens, fi.media)
        fi = fi._replace(positions=self.model.positions(fi.positions, step))
        pieces = list(step.pieces())
        if not pieces:
            return fi, None
        needed = {}
        for pc in pieces:
            item = fi.media[pc.req][pc.item]
            needed[item.content_hash] = item.payload
        embeds = self.encoder_cache.take(needed, self.model.encode)
        rows = torch.cat([torch.arange(pc.row, pc.row + pc.hi - pc.lo) for pc in pieces])
        values = torch.cat([embeds[fi.media[pc.req][pc.item].content_hash][pc.lo:pc.hi] for pc in pieces])
        return fi, MediaEmbeds(rows.to(values.device), values)

    @torch.inference_mode()
    def forward_eager(self, fi: ForwardInput, stage_input=None, media: MediaEmbeds | None = None):
        if self.device.type != "cpu":  # the scheduler builds ids, positions and rows on the host
            dev = self.device
            fi = fi._replace(input_ids=fi.input_ids.to(dev, non_blocking=True),
                             positions=fi.positions.to(dev, non_blocking=True),
                             out_slots=fi.out_slots.to(dev, non_blocking=True),
                             req_indices=fi.req_indices.to(dev, non_blocking=True),
                             logit_rows=fi.logit_rows.to(dev, non_blocking=True))
        self.last_hidden = None
        if (self.fused_decode is not None and media is None and not self.keep_hidden
                and self.fused_decode.applies(fi.extend_lens, fi.verify)
                and self.fused_decode.positions_fit(fi)):
            return self.fused_decode(fi, self.req_to_slot, stage_input)
        # when fewer rows become logits than tokens are computed (a prefill), the last layer may compute only
        # those; not with tensor parallelism, where every rank must reduce the same rows whatever its kernels
        keep = None
        if (fi.logit_rows.shape[0] < fi.input_ids.shape[0] and self.model.is_last_stage
                and self.parallel.tp_size == 1):
            keep = fi.logit_rows.to(torch.int64)
        ctx = ForwardContext(
            is_decode=fi.is_decode, kv_pool=self.kv_pool, out_slots=fi.out_slots,
            req_to_slot=self.req_to_slot, req_indices=fi.req_indices, prefix_lens=fi.prefix_lens,
            extend_lens=fi.extend_lens, backend=self.ops.attention, keep_rows=keep, lora=self._lora_batch(fi),
            verify=fi.verify, req_to_wslot=self.req_to_wslot,
        )
        self.ops.attention.prepare(ctx)  # keeps ctx.keep_rows only where it can compute just those rows
        with forward_context(ctx):
            if media is None:
                hidden = self.model(fi.input_ids, fi.positions, keep_rows=ctx.keep_rows, stage_input=stage_input)
            else:
                hidden = self.model(fi.input_ids, fi.positions, keep_rows=ctx.keep_rows, stage_input=stage_input,
                                    media=media)
        if not self.model.is_last_stage:
            return hidden
        rows = hidden if ctx.keep_rows is not None else hidden[fi.logit_rows]
        if self.keep_hidden:
            self.last_hidden = rows  # (N, hidden): the final (normed) hidden state of each logits row
        if rows.shape[0] > MAX_FUSED_BATCH:
            return self.model.compute_logits(rows)
        if self.fused_decode is not None:
            return self.fused_decode.logits(rows)
        with row_kernels():  # the fused step's logits bits (its C kernels), not the prefill GEMM's
            return self.model.compute_logits(rows)

