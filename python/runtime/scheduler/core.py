"""The scheduler: continuous batching over the KV pool with a radix-tree prefix cache, in its own process
(process.py). Each step: take new messages, build one batch (extend work for waiting requests under a token budget,
or one decode token for every running request; with speculation (speculative/) a decode batch becomes a
verification), run it, process the outputs. Extend and decode steps alternate, so a long chunked prefill never
stalls the running requests. KV slots belong to the KV cache manager (kv_manager.py), admission order to the policy
(policy.py), stop conditions, logprobs and the records sent back to output.py; new requests come in through
intake.py and wait for their conditions (a grammar compiling, a LoRA adapter's slot: waits.py) before admission.

One request never takes the scheduler down: an exception while taking in, admitting or processing one request fails
that request alone (400 for a ValueError, else 500), a failed forward the requests of its batch; `finish` is the
one way a request ends, and it always reports.

Longer than 400 lines: the step's admission, decode, retraction and stall rules read best in one place."""

from __future__ import annotations

import logging
from collections import deque

import torch

from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.distributed import GroupError
from radixgen.runtime.executor.model_runner import ModelRunner
from radixgen.runtime.lora.manager import LoRAManager
from radixgen.runtime.messages import TreeSnapshotRequest
from radixgen.runtime.pooling import PoolingSpec
from radixgen.runtime.scheduler.batch import Batch
from radixgen.runtime.scheduler.intake import Intake, failure
from radixgen.runtime.scheduler.kv_manager import KVCacheManager
from radixgen.runtime.scheduler.output import OutputProcessor
from radixgen.runtime.scheduler.policy import AdmissionPolicy
from radixgen.runtime.scheduler.pooling import DecoderPooler
from radixgen.runtime.scheduler.radix.snapshot import snapshot_reply
from radixgen.runtime.scheduler.request import (
    AbortRequest,
    ControlKind,
    ControlReply,
    ControlRequest,
    Counters,
    FinishReason,
    GenerateRequest,
    LoadLoRAAdapter,
    Req,
    ReqOutput,
    UnloadLoRAAdapter,
)
from radixgen.runtime.scheduler.sampling import StepSampler
from radixgen.runtime.scheduler.speculative import Speculator
from radixgen.runtime.scheduler.waits import WaitList
from radixgen.runtime.special_tokens import eos_token_ids

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, cfg: RuntimeConfig, runner: ModelRunner, tokenizer, grammar_backend=None) -> None:
        self.cfg = cfg
        self.runner = runner
        self.tokenizer = tokenizer
        self.grammar = grammar_backend
        self.kv = KVCacheManager.for_runner(runner, cfg.page_size, cfg.disable_radix_cache)
        self.lora = LoRAManager.for_scheduler(cfg, runner, self.kv.evict_namespaces)  # owns the adapter slots
        self.kv.name_adapters(self.lora.digest_of)  # for the disk tier: an adapter's pages by its weights' digest
        self.policy = AdmissionPolicy(cfg, self.kv)
        eos_ids = set(eos_token_ids(runner.model_config.eos_token_ids, tokenizer))
        self.counters = Counters(speculative=cfg.speculative_algorithm != "none")
        self.sampling = StepSampler(tokenizer, grammar_backend, runner.vocab_size, eos_ids,
                                    batch_invariant=cfg.deterministic and cfg.device != "cpu")
        self.output = OutputProcessor(cfg, tokenizer, grammar_backend, runner.vocab_size,
                                      self.sampling.stop_token_ids, runner.context_length, self.counters)
        self.spec: Speculator | None = None  # speculative decoding, a stage of each decode step
        if cfg.speculative_algorithm != "none":
            self.spec = Speculator(cfg, runner, self.kv, self.output, grammar_backend, self.counters)
        self.pooler = DecoderPooler(PoolingSpec.read(runner.model_path, tokenizer))  # embed / score requests
        self.waiting: deque[Req] = deque()  # ready for admission
        self.waits = WaitList(self.waiting, self.finish, self.fail)  # not yet: their conditions are pending
        self.prefilling: list[Req] = []  # admitted, prompt partly computed (chunked prefill)
        self.running: list[Req] = []  # decoding, in admission order (the newest is retracted first)
        self.busy: set[int] = set()  # id() of the requests of steps in flight (pipeline stages: pipeline.py)
        self.rids: dict[str, Req] = {}
        self.outbox: list = []
        self.intake = Intake(rids=self.rids, outbox=self.outbox, counters=self.counters, kv=self.kv, lora=self.lora,
                             grammar=grammar_backend, tokenizer=tokenizer, waits=self.waits, finish=self.finish,
                             fail=self.fail)
        self.step_no, self.last_was_extend = 0, False

    @property
    def stats(self) -> dict:
        return {**self.counters.as_dict(), "evicted_tokens": self.kv.evicted_tokens}

    # ------------------------------------------------------------------ the step

    def step(self) -> bool:
        """One scheduling step; False when there was nothing to run."""
        self.step_no += 1
        self.handle_aborts()
        batch = self.schedule()
        if batch is None:
            return False
        if self.spec is not None and batch.is_decode:
            batch = self.draft(batch)  # draft tokens for some requests, with their KV slots: a verification
        logits = self.run_batch(batch) if batch is not None else None
        if logits is not None:
            self.process_output(batch, logits)  # sample; a verification keeps what the target agrees with
        return True

    def schedule(self) -> Batch | None:
        self.poll_waits()
        if self.last_was_extend and self.decode_candidates():
            self.last_was_extend = False
            return self.schedule_decode()
        batch = self.schedule_extend()
        self.last_was_extend = batch is not None
        batch = batch if batch is not None else self.schedule_decode()
        if batch is None and self.unstall_prefills():
            return self.schedule()
        return batch

    def unstall_prefills(self) -> bool:
        """Nothing could run while partly computed prompts wait for room that only they hold (each fits the pool,
        not all together): the newest is retracted, its computed KV left in the tree, so the oldest goes on. False
        when there is no such stall."""
        prefilling = self.idle_requests(self.prefilling)
        if len(prefilling) < 2 or self.busy:
            return False
        self.retract(prefilling[-1])
        return True

    def run_batch(self, batch: Batch) -> torch.Tensor | None:
        """The step's logits; None when the forward failed (its requests are failed, their KV given back)."""
        try:
            fi = batch.forward_input(self.kv.table.table)
            self.runner.keep_hidden = self.pooler.wants_hidden(batch.reqs)
            logits = self.runner.forward(fi)
            if self.spec is not None and not batch.is_decode:
                self.spec.mirror(fi)  # a draft model computes the same positions
            return logits
        except GroupError:  # a parallel group that lost a rank cannot run any step: fatal
            raise
        except Exception as e:  # noqa: BLE001 - fails this batch's requests, the scheduler goes on
            logger.exception("the forward of a batch of %d requests failed", len(batch.reqs))
            self.fail_batch(batch, "running the model on", e)
            return None

    def draft(self, batch: Batch) -> Batch | None:
        """The speculative stage's verification batch for a decode batch; None when drafting failed (its
        requests are failed, their KV given back)."""
        try:
            return self.spec.draft(batch)
        except Exception as e:  # noqa: BLE001 - fails this batch's requests, the scheduler goes on
            logger.exception("drafting for a batch of %d requests failed", len(batch.reqs))
            self.fail_batch(batch, "drafting tokens for", e)
            return None

    def fail_batch(self, batch: Batch, stage: str, exc: BaseException) -> None:
        for i, req in enumerate(batch.reqs):
            self.kv.free_tail(req, req.kv_len - batch.prefix_lens[i])  # never computed: not for the tree
            self.fail(req, stage, exc, log=False)

    # ------------------------------------------------------------------ messages in

    def handle_message(self, msg) -> None:
        match msg:
            case GenerateRequest():
                self.intake.add(msg, self.step_no)
            case AbortRequest(rid=rid):
                req = self.rids.get(rid)
                if req is not None:
                    req.to_abort = "aborted by the client"
            case ControlRequest(reply_id=reply_id, kind=kind):
                self.outbox.append(ControlReply(reply_id, self.control(kind)))
            case LoadLoRAAdapter() | UnloadLoRAAdapter():
                self.lora.handle(msg, self.outbox.append)
            case TreeSnapshotRequest():
                self.outbox.append(snapshot_reply(self.kv.tree, self.tokenizer, msg))
            case _:
                raise TypeError(f"unknown message {type(msg).__name__}")

    def poll_waits(self) -> None:
        """Adapters read from disk go into their slots, then every waiting request's conditions are polled."""
        self.lora.poll()
        self.waits.poll()

    @property
    def waits_in_background(self) -> bool:
        """Requests waiting for conditions, or LoRA adapters being read: the step loop has something to poll."""
        return bool(len(self.waits)) or self.lora.busy

    def control(self, kind: ControlKind):
        if kind == ControlKind.SERVER_INFO:
            return self.server_info()
        if kind == ControlKind.FLUSH_CACHE:
            if not self.is_idle():
                return False
            self.kv.flush()
            self.runner.clear_encoder_cache()
            return True
        raise ValueError(f"unknown control request {kind!r}")

    def server_info(self) -> dict:
        stats = self.stats
        return {
            "cache": self.kv.usage(),
            "num_running": len(self.running) + len(self.prefilling),
            "num_waiting": len(self.waiting) + len(self.waits),
            "stats": stats,
            "cache_hit_rate": stats["cached_tokens"] / max(1, stats["prompt_tokens"]),
            "invariant_ok": self.invariant_holds() if self.is_idle() else None,
            "cuda_graph": self.runner.cuda_graph_info(),
            "memory": self.runner.memory_info(),
            "kv_cache": self.runner.kv_cache_info(),
            "max_total_num_tokens": self.kv.capacity,  # SGLang's name for the pool's capacity
            "speculative": self.spec.info() if self.spec is not None else None,
            "lora": self.lora.info(), "hicache": self.kv.tier_info(),  # hierarchical cache tiers (None: off)
            "deterministic": self.cfg.deterministic,  # batch-invariant kernels (runtime/deterministic.py)
            "encoder_cache": self.runner.encoder_cache_info(),  # image embeddings (None: a text-only model)
        }

    # ------------------------------------------------------------------ admission (extend)

    def schedule_extend(self) -> Batch | None:
        budget = self.cfg.max_prefill_tokens
        chunk = self.cfg.chunked_prefill_size if self.cfg.chunked_prefill_size > 0 else None
        reqs, prefix_lens, extend_lens = [], [], []

        def take(req: Req, n: int) -> None:
            prefix_lens.append(req.kv_len)
            self.kv.extend(req, n)
            reqs.append(req)
            extend_lens.append(n)

        for req in self.idle_requests(self.prefilling):  # chunked requests continue first
            n = min(req.remaining_prefill, budget, chunk or budget)
            if n <= 0 or not self.kv.can_allocate(n, running=True):
                break
            take(req, n)
            budget -= n
        # the prompt tokens that admitted requests still owe: a new request is admitted only if its whole prompt
        # fits beside them, so that chunked prompts never hold the pool between them with none able to finish
        owed = sum(r.remaining_prefill for r in self.prefilling)
        order, cached_lens = self.policy.order(list(self.waiting), self.step_no)
        for req in order:
            if budget <= 0 or self.num_active + len(reqs) >= self.cfg.max_running_requests:
                break
            if self.policy.shares_uncached_prefix(req, [*reqs, *self.extending_in_flight()],
                                                  cached_lens.get(id(req))):
                continue
            try:
                if not self.admit(req):  # its adapter's slot (held since its wait) stays with it in the queue
                    break
            except Exception as e:  # noqa: BLE001
                self.fail(req, "admitting", e)
                continue
            n = req.remaining_prefill
            if chunk is not None:
                n = min(n, chunk, budget)
            elif n > budget and reqs:
                self.unadmit(req)
                break
            # keep a slot per running request free for their next decode step
            if not self.kv.can_allocate(req.remaining_prefill + owed + len(self.running)):
                self.unadmit(req)
                break
            self.waiting.remove(req)
            take(req, n)
            owed += req.remaining_prefill
            budget -= n
        return Batch(reqs, is_decode=False, prefix_lens=prefix_lens, extend_lens=extend_lens) if reqs else None

    def admit(self, req: Req) -> bool:
        """Lock the request's cached prefix and give it a table row (kv manager); False when no row is free."""
        if not self.kv.admit(req):
            return False
        if req.reported_cached < 0:
            req.reported_cached = req.cached_len
            self.counters.prompt_tokens += len(req.input_ids)
            self.counters.cached_tokens += req.cached_len
        return True

    def unadmit(self, req: Req) -> None:
        self.kv.unadmit(req)

    # ------------------------------------------------------------------ decode and retraction

    def idle_requests(self, queue: list[Req]) -> list[Req]:
        """The requests of `queue` that no step in flight holds (all of them but with pipeline stages)."""
        return [r for r in queue if id(r) not in self.busy] if self.busy else list(queue)

    def extending_in_flight(self) -> list[Req]:
        """Requests whose prompts steps in flight compute (pipeline stages): a sharer waits for them too."""
        return []

    def decode_candidates(self) -> list[Req]:
        """The running requests the next decode step takes (before retraction)."""
        return self.idle_requests(self.running)

    def schedule_decode(self) -> Batch | None:
        reqs = self.decode_candidates()
        if not reqs:
            return None
        while not self.kv.can_allocate(len(reqs), running=True):
            prefilling = self.idle_requests(self.prefilling)
            if len(reqs) > 1:
                self.retract(reqs.pop())
            elif prefilling:  # a partly computed prompt holds the slots the last decoder needs
                self.retract(prefilling[-1])
            elif self.busy:  # steps in flight hold the slots: wait for them
                return None
            else:
                self.finish(reqs[0], FinishReason.abort("the KV cache is too small for this request", 400))
                return None
        prefix_lens = [r.kv_len for r in reqs]
        self.kv.extend_by_one(reqs)
        return Batch(reqs, is_decode=True, prefix_lens=prefix_lens, extend_lens=[1] * len(reqs))

    def retract(self, req: Req) -> None:
        """Preempt a running (or prefilling) request: keep its KV in the tree, release the rest, queue it first."""
        self.counters.retractions += 1
        (self.running if req in self.running else self.prefilling).remove(req)
        self.kv.release(req)
        self.lora.release(req)  # its adapter's slot may be replaced meanwhile: it waits for it again, first in line
        self.waits.add(req, self.intake.resource_waits(req), front=True)
        logger.info("retracted %s at %d tokens (KV cache full)", req.rid, req.seq_len)

    @property
    def num_active(self) -> int:
        return len(self.running) + len(self.prefilling)

    # ------------------------------------------------------------------ outputs

    def process_output(self, batch: Batch, logits: torch.Tensor) -> None:
        self.counters.forward_passes += 1
        if batch.is_decode:
            self.counters.decode_passes += 1
        else:
            self.counters.extend_passes += 1
        sampled, failed = self.sampling.sample(batch, logits)
        for i, req in enumerate(batch.reqs):
            try:
                if i in failed:
                    raise failed[i]
                self.advance(batch, i, logits, sampled.get(i))
            except Exception as e:  # noqa: BLE001 - fails this request alone
                if batch.drafts is not None:  # of a verification, only its last token's K/V is sure to be its own
                    self.kv.free_tail(req, max(0, req.kv_len - batch.prefix_lens[i] - 1))
                self.fail(req, "processing the output of", e)
        self.emit(batch.reqs)

    def advance(self, batch: Batch, i: int, logits: torch.Tensor, sampled: list | None) -> None:
        """One request after its step: prompt logprobs, cache the computed prompt, append the token, stop checks."""
        req = batch.reqs[i]
        if batch.prompt_lp_rows[i]:
            self.output.collect_prompt_logprobs(req, batch, i, logits)
        if not batch.is_decode:
            if req in self.prefilling:
                self.prefilling.remove(req)
            self.kv.cache_computed(req)
            if not batch.completes_prefill(i):
                self.prefilling.append(req)
                return
            if req.wants_prompt_logprobs:
                self.output.finalize_prompt_logprobs(req)
            if req.kind != "generate":  # prefill-only: the pooling stage's result, and done
                req.pooled = self.pooler.output(req, batch.sample_rows[i], logits, self.runner.last_hidden)
                self.finish(req, FinishReason.stop(None))
                return
        if batch.drafts is not None:  # a verification: the tokens the target keeps, through the stop checks
            reason = self.spec.keep(batch, i, sampled)
        else:
            reason = self.output.append_token(req, sampled[0]) if sampled else None
            reason = reason or self.output.check_finished(req)
        if reason is not None:
            self.finish(req, reason)
        elif req.remaining_prefill > 1:  # jump-forward appended tokens: they go through extend
            if req in self.running:
                self.running.remove(req)
            self.prefilling.append(req)
        elif not batch.is_decode:
            self.running.append(req)

    def finish(self, req: Req, reason: FinishReason) -> None:
        """End a request wherever it is: out of every queue, KV back to the tree, and the Engine is told (always)."""
        if req.finished:
            return
        self._end(req, reason)
        self.emit([req])

    def _end(self, req: Req, reason: FinishReason) -> None:
        req.finish_reason = reason
        for queue in (self.running, self.prefilling, self.waiting):
            if req in queue:
                queue.remove(req)
        self.waits.remove(req)
        try:
            self.kv.release(req)
            self.lora.end(req)
        except Exception:  # noqa: BLE001 - a bug; the idle invariant check will report the slots
            logger.exception("releasing the KV of %s failed", req.rid)
        if self.rids.get(req.rid) is req:
            del self.rids[req.rid]

    def fail(self, req: Req, stage: str, exc: BaseException, log: bool = True) -> None:
        """Fail one request after an exception in its processing; the scheduler goes on."""
        self.counters.failed_requests += 1
        if log:
            logger.error("request %s failed while %s it", req.rid, stage, exc_info=exc)
        self.finish(req, failure(stage, exc))  # the abort reason of a request that failed

    def handle_aborts(self) -> None:
        for queue in (self.waiting, self.running, self.prefilling):
            for req in [r for r in queue if r.to_abort and id(r) not in self.busy]:  # in flight: when it is back
                self.finish(req, FinishReason.abort(req.to_abort))

    def emit(self, reqs: list[Req]) -> None:
        for req in reqs:
            try:
                out = self.output.output_of(req)
            except Exception as e:  # noqa: BLE001 - the request still gets a final record
                logger.exception("building the output of %s failed", req.rid)
                out = ReqOutput(req.rid, [], failure("reporting", e), len(req.input_ids), 0)
                if not req.finished:
                    self.counters.failed_requests += 1
                    self._end(req, out.finish_reason)
                req.final_sent = True
            if out is not None:
                out.pooled = req.pooled
                self.outbox.append(out)

    # ------------------------------------------------------------------ idle checks

    def is_idle(self) -> bool:
        return not (self.running or self.prefilling or self.waiting or len(self.waits))

    def invariant_holds(self) -> bool:
        return self.kv.invariant_holds()
