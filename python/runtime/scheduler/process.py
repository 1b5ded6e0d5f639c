"""The scheduler process: build the runner, tokenizer, grammar backend and scheduler, report ready, then loop:
receive messages, step, send outputs, until shutdown. Anything raised outside a request's processing (the
scheduler fails each request's own errors itself) is fatal and reported to the Engine.

With tensor / pipeline parallelism this is rank 0 of the group (ranks.py): it joins the group first, waits for
every rank to have built its model before it reports ready, sends heartbeats while idle and the group's
shutdown at the end. `run_rank_process` is every other rank: join, build the runner, run the steps rank 0
sends (parallel_step.py) until it says stop."""

from __future__ import annotations

import logging
import os
import pickle
import time
import traceback
from pathlib import Path

import torch

from radixgen.runtime.config import ModelConfig, RuntimeConfig
from radixgen.runtime.executor import distributed
from radixgen.runtime.executor.model_runner import ModelRunner, release_free_heap
from radixgen.runtime.rank_args import RankArgs, rank_threads
from radixgen.runtime.scheduler.core import Scheduler
from radixgen.runtime.scheduler.pipeline import PipelineScheduler
from radixgen.runtime.scheduler.request import ControlKind, ControlReply, ControlRequest, FatalError, ReadySignal
from radixgen.runtime.special_tokens import eos_token_ids

logger = logging.getLogger(__name__)


START_TIMEOUT_S = 600.0  # every rank has built its model (a first start may convert the model)


def _join_group(args: RankArgs) -> None:
    """Threads for this rank; with several ranks, join the group (distributed.init) before the model is built."""
    cfg = args.cfg
    threads = rank_threads(cfg)
    if threads > 0:
        torch.set_num_threads(threads)
    if cfg.world_size > 1:
        from radixgen.runtime.loader import read_hf_config

        mc = ModelConfig.from_hf(read_hf_config(Path(args.model_path)))
        distributed.init(cfg, mc, args.rank, *args.store_addr)


def run_scheduler_process(args: RankArgs) -> int:
    """Entry point of the scheduler process (rank 0): build everything, report ready, loop until shutdown."""
    import zmq

    cfg, model_path = args.cfg, args.model_path
    recv_addr, send_addr = args.engine_addrs
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s scheduler %(levelname)s %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(recv_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(send_addr)

    def send(obj) -> None:
        outbox.send(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    try:
        _join_group(args)
        from radixgen.runtime.loader import load_tokenizer

        encoder = _encoder_scheduler(cfg, model_path)
        if encoder is not None:  # BERT / XLM-R: no KV cache, a forward per request (scheduler/encoder.py)
            return _serve(encoder, None, inbox, outbox, send, encoder.ready_signal(), ctx)
        runner = ModelRunner(cfg, model_path=model_path)
        if runner.group is not None:
            distributed.wait_until_ready(START_TIMEOUT_S)
        tokenizer = load_tokenizer(model_path)
        stop_ids = eos_token_ids(runner.model_config.eos_token_ids, tokenizer)
        grammar = _make_grammar_backend(cfg, tokenizer, runner.vocab_size, stop_ids)
        sched = (PipelineScheduler if cfg.pp_size > 1 else Scheduler)(cfg, runner, tokenizer, grammar)
        if runner.group is not None:
            distributed.mark_started()
        if runner.device.type == "cpu":
            release_free_heap()  # what start-up freed goes back before serving
        send(ReadySignal(num_slots=sched.kv.capacity, context_length=runner.context_length,
                         vocab_size=runner.vocab_size, dtype=str(runner.dtype).removeprefix("torch."),
                         max_running_requests=cfg.max_running_requests, grammar=grammar is not None,
                         lora_adapters=None if runner.lora_pool is None else sched.lora.listing()))
    except Exception:  # noqa: BLE001 - reported to the Engine, which raises it
        send(FatalError(traceback.format_exc()))
        time.sleep(0.05)
        return 1
    return _serve(sched, runner.group, inbox, outbox, send, None, ctx)


def _encoder_scheduler(cfg: RuntimeConfig, model_path: str):
    """The EncoderScheduler of an encoder model's folder; None for a decoder."""
    from radixgen.runtime.pooling import PoolingSpec, is_encoder

    if not is_encoder(Path(model_path)):
        return None
    spec = PoolingSpec.read(Path(model_path))
    from radixgen.runtime.scheduler.encoder import EncoderRunner, EncoderScheduler

    if cfg.world_size > 1:
        raise ValueError("an encoder model runs on one process: tp_size and pp_size must be 1")
    return EncoderScheduler(cfg, EncoderRunner(cfg, model_path, spec))


def _serve(sched, group, inbox, outbox, send, ready: ReadySignal | None = None, ctx=None) -> int:
    """The loop: receive messages, step, send outputs, until shutdown. `ready`: sent first (an encoder's)."""
    import zmq

    if ready is not None:
        send(ready)
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    idle_checked = True
    ran = False
    parent = os.getppid()
    code = 0
    try:
        while True:
            if sched.is_idle() and os.getppid() != parent:
                return 0  # the Engine's process is gone: nobody will read our outputs
            # a step that ran nothing leaves the state as it was until a message or a background job (a grammar
            # compiling, a LoRA adapter being read) arrives: wait for it instead of spinning
            timeout = 0 if ran else (5 if sched.waits_in_background or not sched.is_idle() else 100)
            events = dict(poller.poll(timeout))
            while inbox in events:
                msg = pickle.loads(inbox.recv())
                if isinstance(msg, ControlRequest) and msg.kind == ControlKind.SHUTDOWN:
                    if group is not None:
                        _close_group(sched, group)
                    sched.kv.close()  # the disk tier's queued pages are written
                    send(ControlReply(msg.reply_id, True))
                    return 0
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
            if group is not None and sched.is_idle():
                group.heartbeat()
    except Exception:  # noqa: BLE001
        send(FatalError(traceback.format_exc()))
        code = 1
    finally:
        time.sleep(0.05)
        outbox.close(linger=1000)
        inbox.close(linger=0)
        if ctx is not None:
            ctx.term()
    return code


def _close_group(sched: Scheduler, group) -> None:
    """At shutdown: finish the steps in flight, then tell the other ranks to exit (a group already down is
    left as it is: its ranks exit on their own)."""
    try:
        if isinstance(sched, PipelineScheduler):
            sched.drain()
        group.close()
    except distributed.GroupError as e:
        logger.warning("the group could not be shut down in order: %s", e)


def run_rank_process(args: RankArgs) -> int:
    """A rank other than 0: join the group, build this rank's runner, serve rank 0's steps until shutdown."""
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s rank {args.rank} %(levelname)s %(message)s")
    try:
        _join_group(args)
        runner = ModelRunner(args.cfg, model_path=args.model_path)
        distributed.mark_ready()
        distributed.wait_for_start(START_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - node 0's Engine reads it from the store and raises it
        logger.exception("rank %d failed to start", args.rank)
        distributed.report_failure(f"rank {args.rank} (node {args.cfg.node_rank}) failed to start: "
                                   f"{type(e).__name__}: {e}")
        return 1
    try:
        runner.group.serve()
    except distributed.GroupError as e:
        logger.error("the group is down: %s", e)
        return 1
    except Exception:  # noqa: BLE001 - this rank cannot go on; the others see it gone
        logger.exception("rank %d failed in a step", args.rank)
        return 1
    return 0


def _make_grammar_backend(cfg: RuntimeConfig, tokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
    try:
        from radixgen.runtime.grammar import make_backend
    except ImportError:
        return None
    # a grammar may end only on the ids the scheduler stops at (one derivation: special_tokens)
    return make_backend(cfg, tokenizer, vocab_size, stop_token_ids=sorted(stop_ids) or None)
