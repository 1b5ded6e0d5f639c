"""The scheduler: continuous batching over the KV pool with a radix-tree prefix cache.

Runs in its own process. Each step: take new messages, build one batch (extend work for waiting
requests under a token budget, or one decode token for every running request), run it, process the
outputs. Extend and decode steps alternate while both have work, so a long chunked prefill never
stalls the running requests.

KV ownership: a request's positions [0, cached_len) belong to the tree (locked while it runs),
[cached_len, kv_len) to the request. After each extend the computed prompt is inserted into the tree
(so requests queued behind it share it); on finish or retraction everything computed is inserted.
"""

from __future__ import annotations

import logging
import os
import re
import time
import traceback
from collections import deque

import torch

from radixgen.runtime.batch import Batch
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.model_runner import ModelRunner
from radixgen.runtime.radix_cache import RadixCache
from radixgen.runtime.request import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    FatalError,
    GenerateRequest,
    Req,
    ReqOutput,
)
from radixgen.runtime.sampler import Sampler, SamplingBatch, prompt_logprobs

logger = logging.getLogger(__name__)

# A waiting request that shares at least this many not-yet-cached tokens with one admitted in the
# same step waits a step, so the shared part is computed once and then read from the tree.
SHARED_PREFIX_DEFER_TOKENS = 16
# lpm / dfs-weight match every waiting request each step; past this queue length use fcfs (cost).
MAX_QUEUE_FOR_CACHE_AWARE = 256


class Scheduler:
    def __init__(self, cfg: RuntimeConfig, runner: ModelRunner, tokenizer, grammar_backend=None) -> None:
        self.cfg = cfg
        self.runner = runner
        self.tokenizer = tokenizer
        self.grammar = grammar_backend
        self.tree = RadixCache(page_size=cfg.page_size, disable=cfg.disable_radix_cache)
        self.sampler = Sampler()
        self.vocab_size = runner.vocab_size
        mc = runner.model_config
        self.eos_ids = set(mc.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.waiting: deque[Req] = deque()
        self.grammar_wait: list[Req] = []
        self.prefilling: list[Req] = []  # admitted, prompt partly computed (chunked prefill)
        self.running: list[Req] = []  # decoding, in admission order (the newest is retracted first)
        self.rids: dict[str, Req] = {}
        self.outbox: list = []
        self.step_no = 0
        self.last_was_extend = False
        self.stats = dict(num_requests=0, prompt_tokens=0, cached_tokens=0, generation_tokens=0,
                          forward_passes=0, extend_passes=0, decode_passes=0, retractions=0,
                          evicted_tokens=0, jump_forward_tokens=0)

    # ------------------------------------------------------------------ the step

    def step(self) -> bool:
        """One scheduling step; False when there was nothing to run."""
        self.step_no += 1
        self.handle_aborts()
        batch = self.schedule()
        if batch is None:
            return False
        logits = self.runner.forward(batch.forward_input(self.runner.req_table.table))
        self.process_output(batch, logits)
        return True

    def schedule(self) -> Batch | None:
        self.poll_grammars()
        if self.last_was_extend and self.running:
            self.last_was_extend = False
            return self.schedule_decode()
        batch = self.schedule_extend()
        if batch is not None:
            self.last_was_extend = True
            return batch
        self.last_was_extend = False
        return self.schedule_decode()

    # ------------------------------------------------------------------ messages in

    def handle_message(self, msg) -> None:
        match msg:
            case GenerateRequest():
                self.add_request(msg)
            case AbortRequest(rid=rid):
                req = self.rids.get(rid)
                if req is not None:
                    req.to_abort = "aborted by the client"
            case ControlRequest(reply_id=reply_id, kind=kind):
                self.outbox.append(ControlReply(reply_id, self.control(kind)))
            case _:
                raise TypeError(f"unknown message {type(msg).__name__}")

    def add_request(self, msg: GenerateRequest) -> None:
        req = Req(msg, self.step_no)
        if msg.rid in self.rids:
            self.finish_now(req, f"duplicate request id {msg.rid!r}")
            return
        self.rids[req.rid] = req
        self.stats["num_requests"] += 1
        constraint = req.params.constraint
        if constraint is None:
            self.waiting.append(req)
            return
        if self.grammar is None:
            self.finish_now(req, "constrained decoding is not available in this runtime")
            return
        req.grammar_future = self.grammar.submit(*constraint)
        self.grammar_wait.append(req)

    def poll_grammars(self) -> None:
        """Requests whose grammar finished compiling join the queue; a failed compile fails only them."""
        still = []
        for req in self.grammar_wait:
            if req.to_abort:
                self.finish_now(req, req.to_abort)
                continue
            state = self.grammar.poll(req.grammar_future)
            if state is None:
                still.append(req)
            elif isinstance(state, Exception):
                self.finish_now(req, str(state), status=400)
            else:
                req.grammar = self.grammar.new_matcher(state)
                self.waiting.append(req)
        self.grammar_wait = still

    def control(self, kind: str):
        if kind == "server_info":
            return self.server_info()
        if kind == "flush_cache":
            if self.running or self.prefilling or self.waiting or self.grammar_wait:
                return False
            self.runner.allocator.free(self.tree.evict(self.tree.evictable_size()))
            self.tree.reset()
            return True
        raise ValueError(f"unknown control request {kind!r}")

    def server_info(self) -> dict:
        alloc = self.runner.allocator
        return {
            "cache": {"free": alloc.available(), "evictable": self.tree.evictable_size(),
                      "protected": self.tree.protected_size(), "total": alloc.capacity,
                      "page_size": self.tree.page_size},
            "num_running": len(self.running) + len(self.prefilling),
            "num_waiting": len(self.waiting) + len(self.grammar_wait),
            "stats": dict(self.stats),
            "cache_hit_rate": self.stats["cached_tokens"] / max(1, self.stats["prompt_tokens"]),
            "invariant_ok": self.invariant_holds() if self.is_idle() else None,
            "cuda_graph": self.runner.cuda_graph_info(),
        }

    # ------------------------------------------------------------------ admission (extend)

    def ordered_waiting(self) -> tuple[list[Req], dict[int, int]]:
        """The waiting queue in policy order (requests past the ageing bound first), and the cached prefix
        length of each request (by id) where the ordering measured it (lpm)."""
        reqs = list(self.waiting)
        aged = [r for r in reqs if self.step_no - r.arrival_step >= self.cfg.max_queue_wait_steps]
        rest = [r for r in reqs if self.step_no - r.arrival_step < self.cfg.max_queue_wait_steps]
        policy = self.cfg.schedule_policy
        lens: dict[int, int] = {}
        if self.tree.disable or len(rest) > MAX_QUEUE_FOR_CACHE_AWARE:
            policy = "fcfs"
        if policy == "lpm":
            lens = {id(r): len(self.tree.match_prefix(r.fill_ids[:r.max_cacheable()], r.namespace).slots)
                    for r in rest}
            rest.sort(key=lambda r: -lens[id(r)])  # stable: fcfs among equals
        elif policy == "dfs-weight":
            rest = self.dfs_weight_order(rest)
        return aged + rest, lens

    def dfs_weight_order(self, reqs: list[Req]) -> list[Req]:
        """Walk the tree from the root, heaviest subtree (most waiting requests) first, so requests
        that share cached prefixes run next to each other."""
        at_node: dict[int, list[Req]] = {}
        weight: dict[int, int] = {}
        children: dict[int, list] = {}
        for r in reqs:
            node = self.tree.match_prefix(r.fill_ids[:r.max_cacheable()], r.namespace).last_node
            at_node.setdefault(id(node), []).append(r)
            while node is not None:
                weight[id(node)] = weight.get(id(node), 0) + 1
                parent = node.parent
                if parent is not None and weight[id(node)] == 1:
                    children.setdefault(id(parent), []).append(node)
                node = parent
        out: list[Req] = []
        stack = [self.tree.root]
        while stack:
            node = stack.pop()
            out += at_node.get(id(node), [])
            kids = sorted(children.get(id(node), []), key=lambda n: weight[id(n)])
            stack += kids  # heaviest popped first
        return out

    def schedule_extend(self) -> Batch | None:
        budget = self.cfg.max_prefill_tokens
        chunk = self.cfg.chunked_prefill_size if self.cfg.chunked_prefill_size > 0 else None
        reqs, prefix_lens, extend_lens = [], [], []

        def take(req: Req, n: int) -> None:
            slots = self.allocate(n)
            self.runner.req_table.write(req.table_row, req.kv_len, slots)
            reqs.append(req)
            prefix_lens.append(req.kv_len)
            extend_lens.append(n)

        for req in list(self.prefilling):  # chunked requests continue first
            n = min(req.remaining_prefill, budget, chunk or budget)
            if n <= 0 or not self.can_allocate(n):
                break
            take(req, n)
            budget -= n
        order, cached_lens = self.ordered_waiting()
        for req in order:
            if budget <= 0 or self.num_active + len(reqs) >= self.cfg.max_running_requests:
                break
            if self.runner.req_table.available() == 0:
                break
            if self.shares_uncached_prefix(req, reqs, cached_lens.get(id(req))):
                continue
            self.admit(req)
            n = req.remaining_prefill
            if chunk is not None:
                n = min(n, chunk, budget)
            elif n > budget and reqs:
                self.unadmit(req)
                break
            # keep a slot per running request free for their next decode step
            if not self.can_allocate(n + len(self.running)):
                self.unadmit(req)
                break
            self.waiting.remove(req)
            take(req, n)
            budget -= n
        if not reqs:
            return None
        return Batch(reqs, is_decode=False, prefix_lens=prefix_lens, extend_lens=extend_lens)

    def shares_uncached_prefix(self, req: Req, admitted: list[Req], cached: int | None = None) -> bool:
        """Whether `req` shares a long not-yet-cached prefix with a request admitted this step (then it waits
        a step and reuses that prefix). `cached`: its cached prefix length if already measured this step; a
        heuristic may use it even if an eviction since shortened the match (admission re-matches)."""
        if self.tree.disable:
            return False
        ids = req.fill_ids
        if cached is None:
            cached = len(self.tree.match_prefix(ids[:req.max_cacheable()], req.namespace).slots)
        for other in admitted:
            if other.namespace != req.namespace:
                continue
            common = _common_prefix_len(ids, other.fill_ids)
            if common - cached >= SHARED_PREFIX_DEFER_TOKENS:
                return True
        return False

    def admit(self, req: Req) -> None:
        """Match the longest cached prefix, lock it, and give the request a table row."""
        m = self.tree.match_prefix(req.fill_ids[:req.max_cacheable()], req.namespace)
        self.tree.lock(m.last_node)
        req.last_node = m.last_node
        req.cached_len = req.kv_len = len(m.slots)
        req.table_row = self.runner.req_table.allocate()
        self.runner.req_table.write(req.table_row, 0, m.slots)
        if req.reported_cached < 0:
            req.reported_cached = req.cached_len
            self.stats["prompt_tokens"] += len(req.input_ids)
            self.stats["cached_tokens"] += req.cached_len

    def unadmit(self, req: Req) -> None:
        self.tree.unlock(req.last_node)
        self.runner.req_table.free(req.table_row)
        req.table_row, req.last_node, req.cached_len, req.kv_len = None, None, 0, 0

    # ------------------------------------------------------------------ decode and retraction

    def schedule_decode(self) -> Batch | None:
        if not self.running:
            return None
        while not self.can_allocate(len(self.running)):
            if len(self.running) == 1:
                self.finish(self.running.pop(), {"type": "abort", "message": "the KV pool is too small for "
                                                "this request", "status_code": 400})
                return None
            self.retract(self.running.pop())
        reqs = list(self.running)
        slots = self.allocate(len(reqs))
        table = self.runner.req_table
        for req, slot in zip(reqs, slots, strict=True):
            table.table[req.table_row, req.kv_len] = slot
        return Batch(reqs, is_decode=True, prefix_lens=[r.kv_len for r in reqs], extend_lens=[1] * len(reqs))

    def retract(self, req: Req) -> None:
        """Preempt a running request: keep its KV in the tree, release the rest, queue it first."""
        self.stats["retractions"] += 1
        self.release_kv(req)
        self.waiting.appendleft(req)
        logger.info("retracted %s at %d tokens (pool full)", req.rid, req.seq_len)

    # ------------------------------------------------------------------ KV slots

    @property
    def num_active(self) -> int:
        return len(self.running) + len(self.prefilling)

    def can_allocate(self, n: int) -> bool:
        alloc = self.runner.allocator
        return n <= alloc.available() + self.tree.evictable_size()

    def allocate(self, n: int) -> torch.Tensor:
        alloc = self.runner.allocator
        if not alloc.can_allocate(n):
            freed = self.tree.evict(n - alloc.available())
            self.stats["evicted_tokens"] += freed.numel()
            alloc.free(freed)
        return alloc.allocate(n)

    def cache_computed(self, req: Req) -> None:
        """Insert the computed part of a running request into the tree and move its lock there."""
        if self.tree.disable:
            return
        table = self.runner.req_table.table
        tokens = req.fill_ids[:req.kv_len]
        slots = table[req.table_row, :req.kv_len].clone()
        already = self.tree.insert(tokens, slots, req.namespace)
        if already > req.cached_len:  # another request inserted the same tokens meanwhile
            self.runner.allocator.free(slots[req.cached_len:already])
        m = self.tree.match_prefix(tokens, req.namespace)
        table[req.table_row, :len(m.slots)] = m.slots
        self.tree.lock(m.last_node)
        self.tree.unlock(req.last_node)
        req.last_node, req.cached_len = m.last_node, len(m.slots)

    def release_kv(self, req: Req) -> None:
        """Give everything computed to the tree (or free it), unlock, and free the table row."""
        if req.table_row is None:
            return
        slots = self.runner.req_table.table[req.table_row, :req.kv_len].clone()
        already = self.tree.insert(req.fill_ids[:req.kv_len], slots, req.namespace)
        stored = 0 if self.tree.disable else req.kv_len // self.tree.page_size * self.tree.page_size
        free = self.runner.allocator.free
        if already > req.cached_len:
            free(slots[req.cached_len:already])  # duplicates of what the tree holds
        free(slots[max(stored, req.cached_len):req.kv_len])  # not taken by the tree
        self.tree.unlock(req.last_node)
        self.runner.req_table.free(req.table_row)
        req.table_row, req.last_node, req.cached_len, req.kv_len = None, None, 0, 0

    # ------------------------------------------------------------------ outputs

    def process_output(self, batch: Batch, logits: torch.Tensor) -> None:
        self.stats["forward_passes"] += 1
        self.stats["decode_passes" if batch.is_decode else "extend_passes"] += 1
        sample_idx = [i for i, row in enumerate(batch.sample_rows) if row >= 0]
        next_ids, lps, tops = self.sample(batch, logits, sample_idx)
        sampled = dict(zip(sample_idx, range(len(sample_idx)), strict=True))
        for i, req in enumerate(batch.reqs):
            req.kv_len += batch.extend_lens[i]
            if batch.prompt_lp_rows[i]:
                self.collect_prompt_logprobs(req, batch, i, logits)
            if not batch.is_decode:
                if req in self.prefilling:
                    self.prefilling.remove(req)
                self.cache_computed(req)
                if not batch.completes_prefill(i):
                    self.prefilling.append(req)
                    continue
                if req.wants_prompt_logprobs:
                    self.finalize_prompt_logprobs(req)
            if i in sampled:
                j = sampled[i]
                self.append_token(req, int(next_ids[j]), lps, tops, j)
            self.check_finished(req)
            if req.finished:
                if req in self.running:
                    self.running.remove(req)
                self.finish(req, req.finish_reason)
            elif req.remaining_prefill > 1:  # jump-forward appended tokens: they go through extend
                if req in self.running:
                    self.running.remove(req)
                self.prefilling.append(req)
            elif not batch.is_decode:
                self.running.append(req)
        self.emit(batch.reqs)

    def sample(self, batch: Batch, logits: torch.Tensor, idx: list[int]):
        if not idx:
            return None, None, None
        reqs = [batch.reqs[i] for i in idx]
        rows = logits[[batch.sample_rows[i] for i in idx]]  # (S, V)
        for k, req in enumerate(reqs):  # min_new_tokens: no stop token before then
            if len(req.output_ids) < req.params.min_new_tokens:
                rows[k, list(self.stop_token_ids(req))] = float("-inf")
        sb = SamplingBatch.build([r.params for r in reqs], [r.output_ids for r in reqs],
                                 [r.input_ids for r in reqs], [r.generator for r in reqs], self.vocab_size)
        want_lp = any(r.return_logprob for r in reqs)
        apply_mask = self.grammar.mask_fn(reqs) if self.grammar is not None else None
        out = self.sampler(rows, sb, apply_mask=apply_mask, return_logprob=want_lp,
                           top_logprobs_num=[r.top_logprobs_num if r.return_logprob else 0 for r in reqs])
        return out.next_ids.tolist(), out.logprobs, out.top_logprobs

    def append_token(self, req: Req, tok: int, lps, tops, j: int) -> None:
        req.output_ids.append(tok)
        self.stats["generation_tokens"] += 1
        if req.return_logprob:
            req.output_logprobs.append(float(lps[j]))
            if req.top_logprobs_num:
                req.output_top.append((tops[j].logprobs, tops[j].token_ids))
        if req.grammar is not None:
            if not req.grammar.accept_token(tok):
                req.finish_reason = {"type": "abort", "message": f"grammar rejected token {tok}"}
            elif self.cfg.enable_jump_forward and not req.grammar.is_terminated():
                self.jump_forward(req)

    def jump_forward(self, req: Req) -> None:
        forced = self.grammar.jump_forward(req.grammar, self.tokenizer, req.output_ids)
        budget = req.params.max_new_tokens - len(req.output_ids)
        for tok in forced[:budget]:
            req.output_ids.append(tok)
            self.stats["jump_forward_tokens"] += 1
            if req.return_logprob:
                req.output_logprobs.append(0.0)
                if req.top_logprobs_num:
                    req.output_top.append(([0.0], [tok]))

    def stop_token_ids(self, req: Req) -> set[int]:
        ids = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            ids |= self.eos_ids
        return ids

    def check_finished(self, req: Req) -> None:
        if req.finished:
            return
        p = req.params
        if req.to_abort:
            req.finish_reason = {"type": "abort", "message": req.to_abort}
            return
        if not req.output_ids:
            if p.max_new_tokens == 0:
                req.finish_reason = {"type": "length", "length": 0}
            return
        last = req.output_ids[-1]
        n = len(req.output_ids)
        if n >= p.min_new_tokens and last in self.stop_token_ids(req):
            req.finish_reason = {"type": "stop", "matched": last}
        elif req.grammar is not None and req.grammar.is_terminated():
            req.finish_reason = {"type": "stop", "matched": None}
        elif n >= p.min_new_tokens and (p.stop or p.stop_regex):
            self.check_stop_strings(req)
        if req.finish_reason is None and n >= p.max_new_tokens:
            req.finish_reason = {"type": "length", "length": p.max_new_tokens}
        if req.finish_reason is None and req.seq_len >= self.runner.context_length:
            req.finish_reason = {"type": "length", "length": n}

    def check_stop_strings(self, req: Req) -> None:
        p = req.params
        if p.stop:
            # the new token may complete a stop string begun in earlier tokens
            longest = max(len(s) for s in p.stop)
            tail = self.tokenizer.decode(req.output_ids[-(longest + 2):],
                                         skip_special_tokens=p.skip_special_tokens)
            for s in p.stop:
                if s in tail:
                    req.finish_reason = {"type": "stop", "matched": s}
                    return
        if p.stop_regex:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=p.skip_special_tokens)
            m = re.search(p.stop_regex, text)
            if m:
                req.finish_reason = {"type": "stop", "matched": m.group(0)}

    def collect_prompt_logprobs(self, req: Req, batch: Batch, i: int, logits: torch.Tensor) -> None:
        positions = batch.prompt_lp_rows[i]
        first = sum(len(r) for r in batch.prompt_lp_rows[:i]) + sum(
            1 for k in range(i) if batch.sample_rows[k] >= 0)
        rows = logits[first:first + len(positions)]
        targets = torch.tensor([req.input_ids[p] for p in positions], dtype=torch.int64)
        out = prompt_logprobs(rows, targets, top_k=req.top_logprobs_num, vocab_size=self.vocab_size)
        values = out.logprobs.tolist()
        top = None
        if out.top is not None:
            top = list(zip(out.top.values.tolist(), out.top.ids.tolist(), strict=True))
        for k, pos in enumerate(positions):
            req.pending_input_lp[pos] = (values[k], top[k] if top else None)

    def finalize_prompt_logprobs(self, req: Req) -> None:
        start = req.logprob_start_len
        lp, top = [], []
        for pos in range(start, len(req.input_ids)):
            v, t = req.pending_input_lp.get(pos, (None, None))
            lp.append(v)
            top.append(t)
        req.input_logprobs, req.input_top = lp, top
        req.pending_input_lp = {}

    def finish(self, req: Req, reason: dict) -> None:
        req.finish_reason = reason
        self.release_kv(req)
        self.rids.pop(req.rid, None)

    def finish_now(self, req: Req, message: str, status: int | None = None) -> None:
        """Finish a request that never ran (rejected, or aborted while queued) and tell the Engine."""
        reason = {"type": "abort", "message": message}
        if status is not None:
            reason["status_code"] = status
        self.finish(req, reason)
        self.emit([req])

    def handle_aborts(self) -> None:
        for req in [r for r in self.waiting if r.to_abort]:
            self.waiting.remove(req)
            self.finish_now(req, req.to_abort)
        for group in (self.running, self.prefilling):
            for req in [r for r in group if r.to_abort]:
                group.remove(req)
                self.finish(req, {"type": "abort", "message": req.to_abort})
                self.emit([req])

    def emit(self, reqs: list[Req]) -> None:
        for req in reqs:
            new = req.output_ids[req.sent_len:]
            if not new and not req.finished and req.input_logprobs is None:
                continue
            start = req.sent_len
            out = ReqOutput(
                rid=req.rid, new_ids=new, finish_reason=req.finish_reason,
                prompt_tokens=len(req.input_ids), cached_tokens=max(req.reported_cached, 0),
                output_logprobs=req.output_logprobs[start:] if req.return_logprob else [],
                output_top=req.output_top[start:] if req.top_logprobs_num else [],
            )
            if req.input_logprobs is not None and not req.input_logprobs_sent:
                out.input_logprobs, out.input_top = req.input_logprobs, req.input_top
                req.input_logprobs_sent = True
            req.sent_len = len(req.output_ids)
            self.outbox.append(out)

    # ------------------------------------------------------------------ idle checks

    def is_idle(self) -> bool:
        return not (self.running or self.prefilling or self.waiting or self.grammar_wait)

    def invariant_holds(self) -> bool:
        alloc = self.runner.allocator
        total = alloc.available() + self.tree.evictable_size() + self.tree.protected_size()
        ok = total == alloc.capacity and self.tree.protected_size() == 0
        if not ok:
            logger.error("KV slot leak: free %d + evictable %d + protected %d != total %d",
                         alloc.available(), self.tree.evictable_size(), self.tree.protected_size(),
                         alloc.capacity)
        return ok


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# ---------------------------------------------------------------------- the process


def run_scheduler_process(cfg: RuntimeConfig, recv_addr: str, send_addr: str, model_path: str) -> None:
    """Entry point of the scheduler process: build everything, report ready, loop until shutdown."""
    import pickle

    import zmq

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s scheduler %(levelname)s %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(recv_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(send_addr)

    def send(obj) -> None:
        outbox.send(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    try:
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        from radixgen.runtime.loader import load_tokenizer

        runner = ModelRunner(cfg, model_path=model_path)
        tokenizer = load_tokenizer(model_path)
        grammar = _make_grammar_backend(cfg, tokenizer, runner.vocab_size)
        sched = Scheduler(cfg, runner, tokenizer, grammar)
        send(ControlReply(0, {"ready": True, "num_slots": runner.allocator.capacity,
                              "context_length": runner.context_length, "vocab_size": runner.vocab_size,
                              "dtype": str(runner.dtype).removeprefix("torch."),
                              "max_running_requests": cfg.max_running_requests,
                              "grammar": grammar is not None}))
    except Exception:  # noqa: BLE001 - reported to the Engine, which raises it
        send(FatalError(traceback.format_exc()))
        return

    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    idle_checked = True
    parent = os.getppid()
    try:
        while True:
            if sched.is_idle() and os.getppid() != parent:
                return  # the Engine's process is gone: nobody will read our outputs
            timeout = 0 if not sched.is_idle() else (5 if sched.grammar_wait else 100)
            events = dict(poller.poll(timeout))
            while inbox in events:
                msg = pickle.loads(inbox.recv())
                if isinstance(msg, ControlRequest) and msg.kind == "shutdown":
                    send(ControlReply(msg.reply_id, True))
                    return
                sched.handle_message(msg)
                events = dict(poller.poll(0))
            ran = sched.step()
            for out in sched.outbox:
                send(out)
            sched.outbox.clear()
            if ran or not sched.is_idle():
                idle_checked = False
            elif not idle_checked:
                sched.invariant_holds()  # logs an error with the figures on a leak
                idle_checked = True
    except Exception:  # noqa: BLE001
        send(FatalError(traceback.format_exc()))
    finally:
        time.sleep(0.05)
        outbox.close(linger=1000)
        inbox.close(linger=0)
        ctx.term()


def _make_grammar_backend(cfg: RuntimeConfig, tokenizer, vocab_size: int):
    try:
        from radixgen.runtime.grammar import make_backend
    except ImportError:
        return None
    return make_backend(cfg, tokenizer, vocab_size)


if __name__ == "__main__":
    import pickle
    import sys

    with open(sys.argv[1], "rb") as f:
        run_scheduler_process(*pickle.load(f))
