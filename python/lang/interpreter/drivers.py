"""Drivers: what runs a state's queue and performs the calls `execute` yields.

A worker thread per state calls the backend synchronously (`run`, `run_batch`); an asyncio task
per state awaits it (`arun`); an inline state runs each expression in the caller's thread as it
is appended (`run(use_thread=False)`), with the same synchronous calls.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

from radixgen.lang.interpreter.errors import Origin
from radixgen.lang.interpreter.execute import EmbedCall, Generate, Score, Wait, execute
from radixgen.lang.ir import Node

if TYPE_CHECKING:
    from radixgen.lang.interpreter.core import StateCore


def run_item_sync(core: StateCore, node: Node, origin: Origin | None) -> None:
    steps = execute(core, node)
    result = None
    try:
        while True:
            call = steps.send(result)
            result = perform_sync(core, call)
    except StopIteration:
        pass
    except BaseException as e:  # noqa: BLE001 - every failure is reported with its program line
        core.fail(e, origin)


def perform_sync(core: StateCore, call: Any) -> Any:
    match call:
        case Generate(requests, None):
            return core.backend.generate(requests)
        case Generate([request], on_chunk):
            last = None
            for chunk in core.backend.generate_stream(request):
                on_chunk(chunk)
                last = chunk
            return [last]
        case Score(prompt, choices, unconditional, lora_name, images):
            return core.backend.score_choices(prompt, choices, unconditional, lora_name, images)
        case EmbedCall(text, dimensions):
            return core.backend.embed(text, dimensions)
        case Wait(notifier, pred):
            notifier.wait(pred)
            return None
    raise TypeError(f"unknown call {call!r}")


async def run_item_async(core: StateCore, node: Node, origin: Origin | None) -> None:
    steps = execute(core, node)
    result = None
    try:
        while True:
            call = steps.send(result)
            result = await perform_async(core, call)
    except StopIteration:
        pass
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, asyncio.CancelledError):
            core.fail(RuntimeError("the program was cancelled"), origin)
            raise
        core.fail(e, origin)


async def perform_async(core: StateCore, call: Any) -> Any:
    match call:
        case Generate(requests, None):
            return await core.backend.agenerate(requests)
        case Generate([request], on_chunk):
            last = None
            async for chunk in core.backend.agenerate_stream(request):
                on_chunk(chunk)
                last = chunk
            return [last]
        case Score(prompt, choices, unconditional, lora_name, images):
            return await core.backend.ascore_choices(prompt, choices, unconditional, lora_name, images)
        case EmbedCall(text, dimensions):
            return await core.backend.aembed(text, dimensions)
        case Wait(notifier, pred):
            await notifier.wait_async(pred)
            return None
    raise TypeError(f"unknown call {call!r}")


def _thread_main(core: StateCore) -> None:
    while True:
        core.changed.wait(lambda: core.has_work() or core.exhausted())
        item = core.take()
        if item is None:
            return
        node, origin, names = item
        run_item_sync(core, node, origin)
        core.item_done(names)


async def _task_main(core: StateCore) -> None:
    while True:
        await core.changed.wait_async(lambda: core.has_work() or core.exhausted())
        item = core.take()
        if item is None:
            return
        node, origin, names = item
        await run_item_async(core, node, origin)
        core.item_done(names)


# Strong references to running driver tasks: the loop keeps only weak ones.
_TASKS: set[asyncio.Task] = set()


def start_driver(core: StateCore, loop: asyncio.AbstractEventLoop | None = None) -> None:
    match core.mode:
        case "thread":
            threading.Thread(target=_thread_main, args=(core,), daemon=True, name="radixgen-program").start()
        case "async":
            core.loop = loop or asyncio.get_running_loop()
            task = core.loop.create_task(_task_main(core))
            _TASKS.add(task)
            task.add_done_callback(_TASKS.discard)
        case "inline" | "trace":
            pass  # the caller's thread runs each expression as it is appended (inline) or nothing runs (trace)
