"""Requests in: a GenerateRequest becomes a `Req`, is checked (its adapter known, its KV within the pool, constrained
decoding available) and waits for its conditions (waits.py) before it joins the admission queue. A request refused
here still gets its final record.

`Intake` sees the scheduler through what it is handed, nothing more: the registry of requests in flight, the outbox,
the counters, the KV and LoRA managers, the grammar backend, the wait list, and the scheduler's `finish` / `fail`."""

from __future__ import annotations

from collections.abc import Callable

from radixgen.common.lora_names import LoRAAdapterError
from radixgen.runtime.scheduler.kv_manager import KVCacheManager
from radixgen.runtime.scheduler.output import RegexStop
from radixgen.runtime.scheduler.request import Counters, FinishReason, GenerateRequest, Req, ReqOutput
from radixgen.runtime.scheduler.waits import AdapterSlot, Condition, GrammarCompile, KVLoadBack, WaitList


class Intake:
    def __init__(self, *, rids: dict[str, Req], outbox: list, counters: Counters, kv: KVCacheManager, lora,
                 grammar, tokenizer, waits: WaitList, finish: Callable[[Req, FinishReason], None],
                 fail: Callable[[Req, str, BaseException], None]) -> None:
        self.rids, self.outbox, self.counters = rids, outbox, counters
        self.kv, self.lora, self.grammar, self.tokenizer, self.waits = kv, lora, grammar, tokenizer, waits
        self.finish, self.fail = finish, fail

    def add(self, msg: GenerateRequest, step_no: int) -> None:
        """A new request: recorded, checked (take_in), then waiting for its conditions; refused with a final record."""
        if msg.rid in self.rids:  # refused without touching the request in flight under that id
            reason = FinishReason.abort(f"request id {msg.rid!r} is already in use by a request in flight", 400)
            self.outbox.append(ReqOutput(msg.rid, [], reason, len(msg.input_ids), 0, duplicate=True))
            return
        try:
            req = Req(msg, step_no)
        except Exception as e:  # noqa: BLE001 - a request that cannot even be recorded
            self.counters.failed_requests += 1
            self.outbox.append(ReqOutput(msg.rid, [], failure("taking in", e), len(msg.input_ids), 0))
            return
        self.rids[req.rid] = req
        self.counters.num_requests += 1
        try:
            self.take_in(req)
        except Exception as e:  # noqa: BLE001
            self.fail(req, "taking in", e)

    def take_in(self, req: Req) -> None:
        """Checks, then the request waits for its conditions (waits.py): a grammar, a LoRA adapter's slot."""
        if req.lora_name is not None:
            try:
                self.lora.start(req)
            except LoRAAdapterError as e:
                self.finish(req, FinishReason.abort(str(e), 400))
                return
        p = req.params
        need = len(req.input_ids) + max(p.max_new_tokens - 1, 0)  # the last token's K/V is never computed
        if need > self.kv.capacity:
            self.finish(req, FinishReason.abort(
                f"the prompt ({len(req.input_ids)} tokens) plus max_new_tokens ({p.max_new_tokens}) needs {need} "
                f"KV cache slots, more than the KV cache holds ({self.kv.capacity} tokens)", 400))
            return
        if p.stop_regex is not None:
            req.regex_stop = RegexStop(p.stop_regex, self.tokenizer, p.skip_special_tokens)
        conditions: list[Condition] = []
        if p.constraint is not None:
            if self.grammar is None:
                self.finish(req, FinishReason.abort("constrained decoding is not available in this runtime", 400))
                return
            conditions.append(GrammarCompile(self.grammar, p.constraint))
        self.waits.add(req, conditions + self.resource_waits(req))

    def resource_waits(self, req: Req) -> list[Condition]:
        """What a request must hold before admission besides KV: its LoRA adapter's slot; with the hierarchical
        cache, its prefix loaded back from the lower tiers (last: its namespace is known once the adapter is)."""
        waits: list[Condition] = [AdapterSlot(self.lora, req)] if req.lora is not None else []
        if self.kv.hicache is not None:
            waits.append(KVLoadBack(self.kv.hicache, req))
        return waits


def failure(stage: str, exc: BaseException) -> FinishReason:
    """The abort reason of a request that failed: a ValueError is the request's fault (400), else 500."""
    status = 400 if isinstance(exc, ValueError) else 500
    what = "invalid request" if status == 400 else "internal error"
    return FinishReason.abort(f"{what} while {stage} this request: {type(exc).__name__}: {exc}", status)
