"""The scheduler process: build the runner, tokenizer, grammar backend and scheduler, report ready, then loop:
receive messages, step, send outputs, until shutdown. Anything raised outside a request's processing (the
scheduler fails each request's own errors itself) is fatal and reported to the Engine."""

from __future__ import annotations

import logging
import os
import pickle
import time
import traceback

import torch

from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.model_runner import ModelRunner
from radixgen.runtime.request import ControlKind, ControlReply, ControlRequest, FatalError, ReadySignal
from radixgen.runtime.scheduler.core import Scheduler
from radixgen.runtime.special_tokens import eos_token_ids

logger = logging.getLogger(__name__)


def run_scheduler_process(cfg: RuntimeConfig, recv_addr: str, send_addr: str, model_path: str) -> None:
    """Entry point of the scheduler process: build everything, report ready, loop until shutdown."""
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
        stop_ids = eos_token_ids(runner.model_config.eos_token_ids, tokenizer)
        grammar = _make_grammar_backend(cfg, tokenizer, runner.vocab_size, stop_ids)
        sched = Scheduler(cfg, runner, tokenizer, grammar)
        send(ReadySignal(num_slots=sched.kv.capacity, context_length=runner.context_length,
                         vocab_size=runner.vocab_size, dtype=str(runner.dtype).removeprefix("torch."),
                         max_running_requests=cfg.max_running_requests, grammar=grammar is not None,
                         lora_adapters=None if runner.lora_pool is None else sched.lora.listing()))
    except Exception:  # noqa: BLE001 - reported to the Engine, which raises it
        send(FatalError(traceback.format_exc()))
        return

    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    idle_checked = True
    ran = False
    parent = os.getppid()
    try:
        while True:
            if sched.is_idle() and os.getppid() != parent:
                return  # the Engine's process is gone: nobody will read our outputs
            # a step that ran nothing leaves the state as it was until a message or a background job (a grammar
            # compiling, a LoRA adapter being read) arrives: wait for it instead of spinning
            timeout = 0 if ran else (5 if sched.waits_in_background or not sched.is_idle() else 100)
            events = dict(poller.poll(timeout))
            while inbox in events:
                msg = pickle.loads(inbox.recv())
                if isinstance(msg, ControlRequest) and msg.kind == ControlKind.SHUTDOWN:
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


def _make_grammar_backend(cfg: RuntimeConfig, tokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
    try:
        from radixgen.runtime.grammar import make_backend
    except ImportError:
        return None
    # a grammar may end only on the ids the scheduler stops at (one derivation: special_tokens)
    return make_backend(cfg, tokenizer, vocab_size, stop_token_ids=sorted(stop_ids) or None)
