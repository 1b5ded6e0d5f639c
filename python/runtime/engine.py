"""The in-process API: tokenize, send requests to the scheduler process over zmq, detokenize results.

    with Engine() as eng:                      # the bundled SmolLM2-135M-Instruct
        out = eng.generate("Hello", {"max_new_tokens": 16, "temperature": 0})

A background thread receives the scheduler's per-step outputs and hands them to whoever waits on
each request: a blocking caller, a stream iterator or an asyncio task.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

import zmq

from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.detokenizer import IncrementalDetokenizer
from radixgen.runtime.loader import load_tokenizer, resolve_model_path
from radixgen.runtime.request import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    FatalError,
    GenerateRequest,
    ReqOutput,
)
from radixgen.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0


class RequestError(ValueError):
    """A request the runtime rejected (bad grammar, too large for the pool...)."""


class _ReqState:
    """What the Engine knows of one request; updated by the receiver thread."""

    def __init__(self, rid: str, prompt_tokens: int, params: SamplingParams, tokenizer,
                 return_logprob: bool, text_in_logprobs: bool) -> None:
        self.rid = rid
        self.params = params
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.output_ids: list[int] = []
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.tokenizer = tokenizer
        self.return_logprob = return_logprob
        self.text_in_logprobs = text_in_logprobs
        self.finish_reason: dict | None = None
        self.final_text: str | None = None
        self.output_logprobs: list = []
        self.output_top: list = []
        self.input_logprobs: list | None = None
        self.input_top: list | None = None
        self.input_ids: list[int] = []
        self.sent_text_len = 0
        self.notify = None  # callable, set by the waiter
        self.holdback = max((len(s) for s in params.stop), default=1) - 1

    def apply(self, out: ReqOutput) -> None:
        self.cached_tokens = out.cached_tokens
        self.output_ids += out.new_ids
        self.detok.add(out.new_ids)
        if self.return_logprob:
            self.output_logprobs += [self._entry(lp, t) for lp, t in
                                     zip(out.output_logprobs, out.new_ids, strict=False)]
            self.output_top += [[self._entry(lp, t) for lp, t in zip(*top, strict=True)]
                                for top in out.output_top]
        if out.input_logprobs is not None:
            start = len(self.input_ids) - len(out.input_logprobs)
            ids = self.input_ids[start:]
            self.input_logprobs = [self._entry(lp, t) for lp, t in zip(out.input_logprobs, ids, strict=True)]
            if out.input_top is not None and any(t is not None for t in out.input_top):
                self.input_top = [None if top is None else [self._entry(lp, t) for lp, t in zip(*top, strict=True)]
                                  for top in out.input_top]
        if out.finish_reason is not None:
            self.detok.flush()
            self.finish_reason = out.finish_reason
            self.final_text = self._trimmed_text()

    def _entry(self, lp, tok: int):
        text = self.tokenizer.decode([tok]) if self.text_in_logprobs else None
        return (lp, tok, text)

    def _trimmed_text(self) -> str:
        text, reason, p = self.detok.text, self.finish_reason, self.params
        if reason.get("type") != "stop" or p.no_stop_trim:
            return text
        matched = reason.get("matched")
        if isinstance(matched, str):
            idx = text.rfind(matched)
            return text[:idx] if idx >= 0 else text
        if isinstance(matched, int) and self.output_ids and self.output_ids[-1] == matched:
            return self.tokenizer.decode(self.output_ids[:-1], skip_special_tokens=p.skip_special_tokens)
        return text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def visible_text(self) -> str:
        if self.final_text is not None:
            return self.final_text
        text = self.detok.text
        # hold back what could still turn out to be the start of a stop string
        return text[:len(text) - self.holdback] if self.holdback > 0 else text

    def result(self, delta: bool = False) -> dict:
        text = self.visible_text()
        meta: dict[str, Any] = {
            "id": self.rid, "prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens, "finish_reason": self.finish_reason,
        }
        if self.return_logprob:
            meta["input_token_logprobs"] = self.input_logprobs or []
            meta["output_token_logprobs"] = list(self.output_logprobs)
            meta["input_top_logprobs"] = self.input_top or []
            meta["output_top_logprobs"] = list(self.output_top)
        out = {"text": text, "output_ids": list(self.output_ids), "meta_info": meta}
        if delta:
            out["delta"] = text[self.sent_text_len:]
            self.sent_text_len = len(text)
        return out


class Engine:
    def __init__(self, model: str | os.PathLike | None = None, **config: Any) -> None:
        self.config = RuntimeConfig.from_kwargs(model=None if model is None else str(model), **config)
        self.model_path = resolve_model_path(self.config.model)
        self.tokenizer = load_tokenizer(self.model_path)
        self._states: dict[str, _ReqState] = {}
        self._groups: dict[str, list[str]] = {}
        self._replies: dict[int, tuple[threading.Event, list]] = {}
        self._reply_ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._closed = False
        self._stopping = False
        self._fatal: str | None = None

        self._zmq = zmq.Context()
        ipc = tempfile.mkdtemp(prefix="radixgen-")
        to_sched, from_sched = f"ipc://{ipc}/in", f"ipc://{ipc}/out"
        self._out = self._zmq.socket(zmq.PUSH)
        self._out.bind(to_sched)
        self._in = self._zmq.socket(zmq.PULL)
        self._in.bind(from_sched)
        # a fresh interpreter (not multiprocessing's spawn), so the caller's script is never re-imported
        args_file = os.path.join(ipc, "args.pkl")
        with open(args_file, "wb") as f:
            pickle.dump((self.config, to_sched, from_sched, str(self.model_path)), f)
        self._proc = _SchedulerProcess(args_file)
        self._finalizer = weakref.finalize(self, _kill, self._proc)
        atexit.register(self._finalizer)
        ready = self._wait_ready()
        self.model_info = self._build_model_info(ready)
        self._receiver = threading.Thread(target=self._receive_loop, name="radixgen-receiver", daemon=True)
        self._receiver.start()

    # ------------------------------------------------------------------ lifecycle

    def _wait_ready(self) -> dict:
        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        waited = 0.0
        while waited < START_TIMEOUT_S:
            if poller.poll(200):
                msg = pickle.loads(self._in.recv())
                if isinstance(msg, FatalError):
                    self._shutdown_process()
                    raise RuntimeError(f"the scheduler process failed to start:\n{msg.message}")
                if isinstance(msg, ControlReply) and msg.reply_id == 0:
                    return msg.payload
            elif not self._proc.is_alive():
                raise RuntimeError(f"the scheduler process exited during start (code {self._proc.exitcode})")
            waited += 0.2
        self._shutdown_process()
        raise RuntimeError("the scheduler process did not start in time")

    def _build_model_info(self, ready: dict) -> dict:
        from radixgen.runtime.config import ModelConfig
        from radixgen.runtime.loader import read_hf_config

        mc = ModelConfig.from_hf(read_hf_config(self.model_path))
        eos = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return {
            "model_path": str(self.model_path),
            "model_name": self.config.model or "SmolLM2-135M-Instruct",
            "vocab_size": ready["vocab_size"],
            "context_length": ready["context_length"],
            "num_kv_slots": ready["num_slots"],
            "dtype": ready["dtype"],
            "chat_template": getattr(self.tokenizer, "chat_template", None),
            "eos_token_ids": sorted(eos),
            "bos_token_id": mc.bos_token_id,
            "architecture": mc.architecture,
            "max_running_requests": ready["max_running_requests"],
            "supports_constraints": ready["grammar"],
            "is_generation": True,
        }

    def shutdown(self) -> None:
        if self._closed:
            return
        self._stopping = True
        try:
            if self._proc.is_alive() and self._fatal is None:
                self._control("shutdown", timeout=10.0)
        except Exception:  # noqa: BLE001 - shutting down anyway
            pass
        self._closed = True
        self._receiver.join(timeout=2.0)
        self._shutdown_process()
        self._fail_all("the engine was shut down")

    def _shutdown_process(self) -> None:
        self._proc.join(timeout=10)
        _kill(self._proc)
        self._out.close(linger=0)
        self._in.close(linger=0)
        self._zmq.term()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def is_alive(self) -> bool:
        return not self._closed and self._fatal is None and self._proc.is_alive()

    # ------------------------------------------------------------------ receiving

    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        while not self._closed:
            try:
                ready = poller.poll(200)
            except zmq.ZMQError:
                return
            if not ready:
                if not self._proc.is_alive() and not (self._closed or self._stopping):
                    self._fatal = f"the scheduler process died (exit code {self._proc.exitcode})"
                    logger.error(self._fatal)
                    self._fail_all(self._fatal)
                    return
                continue
            try:
                msg = pickle.loads(self._in.recv())
            except zmq.ZMQError:
                return
            match msg:
                case ReqOutput():
                    state = self._states.get(msg.rid)
                    if state is not None:
                        state.apply(msg)
                        if state.finished:
                            self._states.pop(msg.rid, None)
                        if state.notify is not None:
                            state.notify()
                case ControlReply(reply_id=rid, payload=payload):
                    waiter = self._replies.pop(rid, None)
                    if waiter is not None:
                        waiter[1].append(payload)
                        waiter[0].set()
                case FatalError(message=message):
                    self._fatal = f"the scheduler process failed:\n{message}"
                    logger.error(self._fatal)
                    self._fail_all(self._fatal)

    def _fail_all(self, message: str) -> None:
        for state in list(self._states.values()):
            state.finish_reason = state.finish_reason or {"type": "abort", "message": message, "fatal": True}
            state.final_text = state.detok.text
            if state.notify is not None:
                state.notify()
        self._states.clear()
        for event, _ in list(self._replies.values()):
            event.set()

    def _send(self, msg) -> None:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        if self._fatal is not None:
            raise RuntimeError(self._fatal)
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:  # zmq sockets are not thread-safe
            while True:
                try:  # never block: a dead scheduler would hang the caller (and a server's event loop)
                    self._out.send(data, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    if not self._proc.is_alive():
                        self._fatal = self._fatal or "the scheduler process died"
                        raise RuntimeError(self._fatal) from None
                    time.sleep(0.001)

    def _control(self, kind: str, timeout: float = 60.0):
        reply_id = next(self._reply_ids)
        event, box = threading.Event(), []
        self._replies[reply_id] = (event, box)
        self._send(ControlRequest(reply_id, kind))
        if not event.wait(timeout) or not box:
            self._replies.pop(reply_id, None)
            raise RuntimeError(self._fatal or f"no answer from the scheduler to {kind!r}")
        return box[0]

    # ------------------------------------------------------------------ requests

    def _prepare(self, prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                 top_logprobs_num, rid, cache_salt, return_text_in_logprobs):
        """Validate everything and build the requests; nothing is sent. Returns (batched, requests)."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("exactly one of prompt and input_ids must be given")
        if prompt is not None:
            batched = isinstance(prompt, (list, tuple))
            texts = list(prompt) if batched else [prompt]
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a list of strings")
            ids_list = [self.tokenizer(t).input_ids for t in texts]
        else:
            batched = bool(input_ids) and isinstance(input_ids[0], (list, tuple))
            ids_list = [list(x) for x in input_ids] if batched else [list(input_ids)]
        if batched and not ids_list:
            raise ValueError("the prompt list is empty")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(ids_list):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(ids_list)} prompts")
            params_list = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params_list = [SamplingParams.from_dict(sampling_params)] * len(ids_list)
        if not isinstance(return_logprob, bool):
            raise ValueError("return_logprob must be a boolean")
        if not isinstance(logprob_start_len, int) or logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be an integer >= -1, got {logprob_start_len!r}")
        if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= 100:
            raise ValueError(f"top_logprobs_num must be an integer in [0, 100], got {top_logprobs_num!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt must be a string")
        vocab, ctx_len = self.model_info["vocab_size"], self.model_info["context_length"]
        base = rid or uuid.uuid4().hex
        reqs = []
        for i, (ids, params) in enumerate(zip(ids_list, params_list, strict=True)):
            if not ids:
                raise ValueError("the prompt is empty (no tokens)")
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"input_ids: token id {bad[0]!r} is out of the vocabulary [0, {vocab})")
            if len(ids) + params.max_new_tokens > ctx_len:
                raise ValueError(f"the prompt ({len(ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) "
                                 f"exceeds the context length ({ctx_len})")
            if logprob_start_len > len(ids):
                raise ValueError(f"logprob_start_len={logprob_start_len} is past the prompt ({len(ids)} tokens)")
            if params.constraint is not None:
                if not self.model_info["supports_constraints"]:
                    raise ValueError("constrained decoding (regex / json_schema / ebnf / choices) is not available")
                from radixgen.runtime.grammar import check_constraint

                check_constraint(*params.constraint, strict_json=self.config.grammar_strict_json)
            for k in range(params.n):
                p = params
                if params.n > 1:
                    p = SamplingParams.from_dict({**params.to_dict(), "n": 1,
                                                  "seed": None if params.seed is None else params.seed + k})
                sub = base if len(ids_list) == 1 and params.n == 1 else f"{base}-{i}-{k}"
                reqs.append(GenerateRequest(sub, ids, p, return_logprob, logprob_start_len,
                                            top_logprobs_num, cache_salt))
        return batched or len(reqs) > 1, base, reqs

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob: bool = False,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0, stream: bool = False,
                 rid: str | None = None, cache_salt: str | None = None,
                 return_text_in_logprobs: bool = False):
        """Generate for one prompt (a dict) or a list (a list of dicts); see the module docstring."""
        batched, base, reqs = self._prepare(prompt, sampling_params, input_ids, return_logprob,
                                            logprob_start_len, top_logprobs_num, rid, cache_salt,
                                            return_text_in_logprobs)
        if stream:
            if batched:
                raise ValueError("stream=True takes a single prompt with n=1")
            return self._stream(base, reqs, return_text_in_logprobs)
        events = []
        states = []
        for st in self._make_states(reqs, return_text_in_logprobs):
            ev = threading.Event()
            st.notify = ev.set
            events.append(ev)
            states.append(st)
        self._send_all(base, reqs, states)
        for ev, st in zip(events, states, strict=True):
            while not st.finished:
                ev.wait(0.5)
                ev.clear()
                if self._fatal is not None and not st.finished:
                    raise RuntimeError(self._fatal)
        results = [self._final(st) for st in states]
        self._groups.pop(base, None)
        return results if batched else results[0]

    def _make_states(self, reqs, text_in_logprobs) -> list[_ReqState]:
        out = []
        for r in reqs:
            if r.rid in self._states:
                raise ValueError(f"request id {r.rid!r} is already in use")
            st = _ReqState(r.rid, len(r.input_ids), r.params, self.tokenizer, r.return_logprob, text_in_logprobs)
            st.input_ids = r.input_ids
            out.append(st)
        return out

    def _send_all(self, base: str, reqs, states) -> None:
        self._groups[base] = [r.rid for r in reqs]
        for st, r in zip(states, reqs, strict=True):
            self._states[r.rid] = st
            try:
                self._send(r)
            except Exception:
                for other in reqs:
                    self._states.pop(other.rid, None)
                self._groups.pop(base, None)
                raise

    @staticmethod
    def _final(st: _ReqState) -> dict:
        reason = st.finish_reason or {}
        if reason.get("fatal"):
            raise RuntimeError(reason["message"])
        if reason.get("type") == "abort" and reason.get("status_code") == 400:
            raise RequestError(reason["message"])
        return st.result()

    def _stream(self, base, reqs, text_in_logprobs) -> Iterator[dict]:
        (st,) = self._make_states(reqs, text_in_logprobs)
        q: queue.SimpleQueue = queue.SimpleQueue()
        st.notify = lambda: q.put(None)
        self._send_all(base, reqs, [st])

        def chunks() -> Iterator[dict]:
            try:
                while True:
                    try:
                        q.get(timeout=0.5)
                    except queue.Empty:
                        if self._fatal is not None and not st.finished:
                            raise RuntimeError(self._fatal) from None
                        continue
                    if st.finished:
                        self._final(st)  # raises for errors
                        yield st.result(delta=True)
                        return
                    chunk = st.result(delta=True)
                    if chunk["delta"] or chunk["meta_info"].get("input_token_logprobs"):
                        yield chunk
            finally:
                if not st.finished:
                    self.abort(st.rid)
                self._groups.pop(base, None)

        return chunks()

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None,
                             return_logprob: bool = False, logprob_start_len: int = -1,
                             top_logprobs_num: int = 0, stream: bool = False, rid: str | None = None,
                             cache_salt: str | None = None, return_text_in_logprobs: bool = False):
        """Like generate; with stream=True returns an async iterator of chunks."""
        batched, base, reqs = self._prepare(prompt, sampling_params, input_ids, return_logprob,
                                            logprob_start_len, top_logprobs_num, rid, cache_salt,
                                            return_text_in_logprobs)
        loop = asyncio.get_running_loop()
        if stream:
            if batched:
                raise ValueError("stream=True takes a single prompt with n=1")
            return self._astream(base, reqs, return_text_in_logprobs, loop)
        states = self._make_states(reqs, return_text_in_logprobs)
        futures = []
        for st in states:
            fut = loop.create_future()

            def done(fut=fut, st=st):
                if st.finished and not fut.done():
                    fut.set_result(None)

            st.notify = lambda done=done: _call_soon(loop, done)
            futures.append(fut)
        self._send_all(base, reqs, states)
        try:
            await asyncio.gather(*futures)
        except asyncio.CancelledError:
            self.abort(base)
            raise
        finally:
            self._groups.pop(base, None)
        results = [self._final(st) for st in states]
        return results if batched else results[0]

    async def _astream(self, base, reqs, text_in_logprobs, loop) -> AsyncIterator[dict]:
        (st,) = self._make_states(reqs, text_in_logprobs)
        q: asyncio.Queue = asyncio.Queue()
        st.notify = lambda: _call_soon(loop, q.put_nowait, None)
        self._send_all(base, reqs, [st])
        try:
            while True:
                await q.get()
                if st.finished:
                    self._final(st)
                    yield st.result(delta=True)
                    return
                chunk = st.result(delta=True)
                if chunk["delta"]:
                    yield chunk
        finally:
            if not st.finished:
                self.abort(st.rid)
            self._groups.pop(base, None)

    # ------------------------------------------------------------------ control

    def abort(self, rid: str) -> None:
        """Abort a request (or every request created by one generate call with that rid)."""
        for sub in self._groups.get(rid, [rid]):
            if sub in self._states and not self._closed and self._fatal is None:
                self._send(AbortRequest(sub))

    def flush_cache(self) -> bool:
        return bool(self._control("flush_cache"))

    def get_server_info(self) -> dict:
        info = self._control("server_info")
        info["model_path"] = self.model_info["model_path"]
        return info


class _SchedulerProcess:
    """`python -m radixgen.runtime.scheduler ARGS_FILE` as a child process."""

    def __init__(self, args_file: str) -> None:
        # torch backs its large CPU allocations (weights, KV pool) with transparent huge pages when this is set
        # before its first allocation: fewer TLB misses while decode streams the weights (about 3% at batch 1)
        env = {"THP_MEM_ALLOC_ENABLE": "1", **os.environ}
        self.popen = subprocess.Popen([sys.executable, "-m", "radixgen.runtime.scheduler", args_file],
                                      stdin=subprocess.DEVNULL, env=env)

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Wake an asyncio waiter from the receiver thread; a loop that is already closed has no waiter."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _kill(proc: _SchedulerProcess) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=5)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5)
