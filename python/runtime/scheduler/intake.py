"""Requests in: a GenerateRequest becomes a `Req`, is checked (its adapter known, its KV within the pool, constrained
decoding available) and waits for its conditions (waits.py) before it joins the admission queue. A request refused
here still gets its final record."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixgen.runtime.lora.adapter import LoRAAdapterError
from radixgen.runtime.scheduler.output import RegexStop
from radixgen.runtime.scheduler.request import FinishReason, GenerateRequest, Req, ReqOutput
from radixgen.runtime.scheduler.waits import AdapterSlot, Condition, GrammarCompile, KVLoadBack

if TYPE_CHECKING:
    from radixgen.runtime.scheduler.core import Scheduler


def add_request(sched: Scheduler, msg: GenerateRequest) -> None:
    """A new request: recorded, checked (take_in), then waiting for its conditions; refused with a final record."""
    if msg.rid in sched.rids:  # refused without touching the request in flight under that id
        reason = FinishReason.abort(f"request id {msg.rid!r} is already in use by a request in flight", 400)
        sched.outbox.append(ReqOutput(msg.rid, [], reason, len(msg.input_ids), 0, duplicate=True))
        return
    try:
        req = Req(msg, sched.step_no)
    except Exception as e:  # noqa: BLE001 - a request that cannot even be recorded
        sched.counters["failed_requests"] += 1
        reason = failure("taking in", e)
        sched.outbox.append(ReqOutput(msg.rid, [], reason, len(msg.input_ids), 0))
        return
    sched.rids[req.rid] = req
    sched.counters["num_requests"] += 1
    try:
        take_in(sched, req)
    except Exception as e:  # noqa: BLE001
        sched.fail(req, "taking in", e)


def take_in(sched: Scheduler, req: Req) -> None:
    """Checks, then the request waits for its conditions (waits.py): a grammar, a LoRA adapter's slot."""
    if req.lora_name is not None:
        try:
            sched.lora.start(req)
        except LoRAAdapterError as e:
            sched.finish(req, FinishReason.abort(str(e), 400))
            return
    p = req.params
    need = len(req.input_ids) + max(p.max_new_tokens - 1, 0)  # the last token's K/V is never computed
    if need > sched.kv.capacity:
        sched.finish(req, FinishReason.abort(
            f"the prompt ({len(req.input_ids)} tokens) plus max_new_tokens ({p.max_new_tokens}) needs {need} "
            f"KV cache slots, more than the KV cache holds ({sched.kv.capacity} tokens)", 400))
        return
    if p.stop_regex is not None:
        req.regex_stop = RegexStop(p.stop_regex, sched.tokenizer, p.skip_special_tokens)
    conditions: list[Condition] = []
    if p.constraint is not None:
        if sched.grammar is None:
            sched.finish(req, FinishReason.abort("constrained decoding is not available in this runtime", 400))
            return
        conditions.append(GrammarCompile(sched.grammar, p.constraint))
    sched.waits.add(req, conditions + resource_waits(sched, req))


def resource_waits(sched: Scheduler, req: Req) -> list[Condition]:
    """What a request must hold before admission besides KV: its LoRA adapter's slot; with the hierarchical cache,
    its prefix loaded back from the lower tiers (last: its namespace is known once the adapter is)."""
    waits: list[Condition] = [AdapterSlot(sched.lora, req)] if req.lora is not None else []
    if sched.kv.hicache is not None:
        waits.append(KVLoadBack(sched.kv.hicache, req))
    return waits


def failure(stage: str, exc: BaseException) -> FinishReason:
    """The abort reason of a request that failed: a ValueError is the request's fault (400), else 500."""
    status = 400 if isinstance(exc, ValueError) else 500
    what = "invalid request" if status == 400 else "internal error"
    return FinishReason.abort(f"{what} while {stage} this request: {type(exc).__name__}: {exc}", status)
