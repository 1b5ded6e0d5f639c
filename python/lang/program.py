"""`@function` programs: binding arguments and running them (run, run_batch, arun)."""

from __future__ import annotations

import asyncio
import inspect
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixgen.common.sampling_params import default_of, param_type
from radixgen.lang.backend_base import PREFILL_ONLY, BaseBackend, GenRequest
from radixgen.lang.global_config import global_config
from radixgen.lang.interpreter import SamplingDefaults, StateCore, TraceStop, start_driver
from radixgen.lang.ir import LOGPROB_FIELDS, SAMPLING_FIELDS
from radixgen.lang.state import ProgramState

_engine_backends: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Engine -> its backend


def as_backend(obj: Any) -> BaseBackend:
    """A backend, or an in-process `Engine` (wrapped in an EngineBackend, one per Engine)."""
    if isinstance(obj, BaseBackend):
        return obj
    if hasattr(obj, "generate") and hasattr(obj, "tokenizer") and hasattr(obj, "model_info"):
        from radixgen.lang.backend_engine import EngineBackend

        if obj not in _engine_backends:
            _engine_backends[obj] = EngineBackend(obj)
        return _engine_backends[obj]
    raise TypeError(f"expected a backend (EngineBackend, RuntimeEndpoint, OpenAI) or an Engine, got {obj!r}")


def set_default_backend(backend: Any) -> None:
    """Same as `radixgen.global_config.default_backend = backend` (checked here)."""
    global_config.default_backend = None if backend is None else as_backend(backend)


def get_default_backend() -> BaseBackend | None:
    backend = global_config.default_backend
    return None if backend is None else as_backend(backend)


def resolve_backend(backend: Any) -> BaseBackend:
    if backend is None:
        backend = global_config.default_backend
    if backend is None:
        raise ValueError("no backend: pass backend=... or call radixgen.set_default_backend(...) first")
    return as_backend(backend)


# The run-level sampling keywords of run / arun / run_batch, built from the declaration (SGLang's names; the
# declared defaults): every parameter a gen passes through and n, less RUN_NOT_EXPOSED; then the logprob options.
RUN_NOT_EXPOSED = frozenset(("min_new_tokens",))  # SGLang's run does not take it (a gen does)
RUN_FIELDS = tuple(k for k in (*SAMPLING_FIELDS, "n") if k not in RUN_NOT_EXPOSED)
_SAMPLING_KEYS = RUN_FIELDS + LOGPROB_FIELDS
# Each method's own keywords beside the sampling ones, with their defaults.
_OPTIONS: dict[str, dict[str, Any]] = {
    "run": {"stream": False, "backend": None, "use_thread": True, "lora_name": None},
    "arun": {"stream": False, "backend": None, "lora_name": None},
    "run_batch": {"backend": None, "lora_name": None, "num_threads": "auto", "progress_bar": False,
                  "generator_style": False},
}


def _signature(method: str, head: list[inspect.Parameter], program_kwargs: bool) -> inspect.Signature:
    """What help() and inspect show for a run method: `head`, the sampling keywords (declared defaults; a list
    default shows as None), the method's options, and **kwargs (the program's arguments) where it takes them."""
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *head]
    for name in RUN_FIELDS:
        default = default_of(name)
        params.append(inspect.Parameter(name, kw, default=None if isinstance(default, list) else default,
                                        annotation=param_type(name)))
    params += [inspect.Parameter(name, kw, default=None) for name in LOGPROB_FIELDS]
    params += [inspect.Parameter(name, kw, default=v) for name, v in _OPTIONS[method].items()]
    if program_kwargs:
        params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD, annotation=Any))
    return inspect.Signature(params)


def _print_if_verbose(state: ProgramState) -> None:
    if global_config.verbosity >= 2:
        print(state.text())


class Function:
    """A program: a Python function whose first parameter is the state `s`."""

    def __init__(self, func, num_api_spec_tokens: int | None = None, bind_arguments: dict | None = None):
        # SGLang's API speculative execution (one long API call whose text later gens consume) is for
        # OpenAI-backed programs. With a radixgen backend it has nothing to save (the radix cache reuses
        # the prefix of every call): accepted, no effect. With the OpenAI backend a run refuses it.
        if num_api_spec_tokens is not None and (
            not isinstance(num_api_spec_tokens, int) or isinstance(num_api_spec_tokens, bool) or num_api_spec_tokens < 1
        ):
            raise ValueError(f"function.num_api_spec_tokens: must be a positive integer (got {num_api_spec_tokens!r})")
        self.num_api_spec_tokens = num_api_spec_tokens
        self.func = func
        self.bind_arguments = dict(bind_arguments or {})
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
            raise TypeError(f"@function {func.__name__}: the first parameter must be the state (s)")
        self.arg_names = [p.name for p in params[1:]]
        self.signature = inspect.Signature(params[1:])
        self.is_async = inspect.iscoroutinefunction(func)
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> Function:
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(f"{self.__name__}.bind: unknown argument(s) {unknown}")
        return Function(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def _arguments(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        bound = self.signature.bind(*args, **{**self.bind_arguments, **kwargs})
        return dict(bound.arguments)

    def run(self, *args: Any, **kwargs: Any) -> ProgramState:
        """Run the program. With stream=False it returns when the program has finished (raising
        a ProgramError, with the failing program line, if it failed); with stream=True it returns
        as soon as the body has queued its expressions: iterate `state.text_iter()`.
        `n`: the number of samples of every gen that does not set its own (its variable is then a
        list of n texts). `use_thread=False`: each expression runs in the calling thread when it is
        appended, instead of in a worker thread of the state (fork branches still get threads).
        `lora_name`: the LoRA adapter every request of the run uses (gens, selects' scoring, fork and cache
        prefills), by name; None: the base model. The sampling keywords are the declared parameters'
        (radixgen.common.sampling_params); every other keyword is the program's."""
        self._check_sync("run")
        opts, defaults, kwargs = self._take_options("run", kwargs)
        arguments = self._arguments(args, kwargs)
        stream = opts["stream"]
        state = self._start(resolve_backend(opts["backend"]), defaults, stream,
                            "thread" if opts["use_thread"] else "inline")
        try:
            state.ret_value = self.func(state, **arguments)
        except BaseException as e:
            state._core.fail(e, None)  # drop what the body queued before it failed
            raise
        finally:
            state._core.close()
        if not stream:
            state.sync()
            if state._core.error is not None:
                raise state._core.error
            _print_if_verbose(state)
        return state

    __call__ = run

    async def arun(self, *args: Any, **kwargs: Any) -> ProgramState:
        """Run the program on the running event loop: generation awaits the backend's async API.
        An `async def` body runs on the loop too (read values with `await s.aget_var(name)`);
        a plain `def` body runs in a worker thread so that `s["x"]` may block."""
        opts, defaults, kwargs = self._take_options("arun", kwargs)
        arguments = self._arguments(args, kwargs)
        stream = opts["stream"]
        state = self._start(resolve_backend(opts["backend"]), defaults, stream, "async")
        core = state._core
        try:
            if self.is_async:
                state.ret_value = await self.func(state, **arguments)
            else:
                state.ret_value = await asyncio.to_thread(self.func, state, **arguments)
        except BaseException as e:
            core.fail(e, None)
            raise
        finally:
            core.close()
        if not stream:
            await core.changed.wait_async(lambda: core.finished)
            if core.error is not None:
                raise core.error
            _print_if_verbose(state)
        return state

    def run_batch(
        self, batch_kwargs: list[dict[str, Any]] | list[tuple], **kwargs: Any
    ) -> list[ProgramState] | Iterator[ProgramState]:
        """Run the program once per argument set, concurrently; states come back in input order.
        A program that fails does not stop the others: its state's `error()` tells why.
        Unless `global_config.enable_precache_with_tracing` is off, the prefix shared by the first
        programs' prompts is cached once before they start. `generator_style=True` returns an
        iterator instead of a list: each state, in input order, as soon as it (and those before it)
        has finished."""
        self._check_sync("run_batch")
        opts, defaults, unknown = self._take_options("run_batch", kwargs)
        if unknown:
            raise TypeError(f"{self.__name__}.run_batch: unknown keyword(s) {sorted(unknown)} (program arguments "
                            "go in batch_kwargs)")
        num_threads = opts["num_threads"]
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch: batch_kwargs must be a list of dicts (or of argument tuples)")
        arguments = [
            self._arguments((), a) if isinstance(a, dict) else self._arguments(tuple(a), {}) for a in batch_kwargs
        ]
        if num_threads == "auto":
            # Program threads mostly wait on the runtime; more of them means bigger batches there.
            num_threads = max(1, min(len(arguments), 64))
        if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1:
            raise ValueError(f"run_batch.num_threads: must be 'auto' or a positive integer (got {num_threads!r})")
        resolved = resolve_backend(opts["backend"])
        states = self._batch_states(arguments, resolved, defaults, num_threads, opts["progress_bar"])
        return states if opts["generator_style"] else list(states)

    def _batch_states(
        self, arguments: list[dict], backend: BaseBackend, defaults: SamplingDefaults, num_threads: int, bar: bool
    ) -> Iterator[ProgramState]:
        if not arguments:
            return
        if len(arguments) > 1 and backend.can_prefill and global_config.enable_precache_with_tracing:
            prefix = self.shared_prefix(arguments[:4], backend, defaults)
            if prefix:
                backend.generate([GenRequest(prefix, None, dict(PREFILL_ONLY), lora_name=defaults.lora_name)])

        def one(args: dict[str, Any]) -> ProgramState:
            state = self._start(backend, defaults, False, "thread")
            try:
                state.ret_value = self.func(state, **args)
            except Exception as e:  # noqa: BLE001 - reported through the state, like expression errors
                state._core.fail(e, None)
            finally:
                state._core.close()
            state.sync()
            _print_if_verbose(state)
            return state

        progress = None
        if bar:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(arguments), desc=self.__name__)
        pool = ThreadPoolExecutor(max_workers=num_threads)
        futures = [pool.submit(one, a) for a in arguments]
        try:
            if progress is not None:
                for f in futures:
                    f.add_done_callback(lambda _: progress.update(1))
            for f in futures:
                yield f.result()
        finally:  # also when a generator-style caller stops early: programs not started yet never start
            for f in futures:
                f.cancel()
            pool.shutdown(wait=True)
            if progress is not None:
                progress.close()

    def trace_prompt(self, arguments: dict[str, Any], backend: Any = None, defaults=None) -> str:
        """The text this program has built when it first needs the model (without calling it)."""
        state = self._start(resolve_backend(backend), defaults or SamplingDefaults(), False, "trace")
        try:
            self.func(state, **arguments)
        except TraceStop:
            pass
        return state._core.text

    def shared_prefix(self, arguments: list[dict[str, Any]], backend: BaseBackend, defaults) -> str:
        """The longest common prefix of the given argument sets' first prompts ('' if trivial)."""
        if self.is_async:
            return ""
        prompts = []
        for args in arguments:
            try:
                prompts.append(self.trace_prompt(args, backend, defaults))
            except Exception:  # noqa: BLE001 - a body that cannot be traced just skips the warm-up
                return ""
        prefix = prompts[0]
        for p in prompts[1:]:
            n = 0
            while n < min(len(prefix), len(p)) and prefix[n] == p[n]:
                n += 1
            prefix = prefix[:n]
        return prefix if len(prefix) >= 16 else ""

    def _take_options(self, method: str, kwargs: dict[str, Any]) -> tuple[dict, SamplingDefaults, dict]:
        """A run method's keywords split three ways: its options, the run's sampling defaults, and the rest (the
        program's arguments)."""
        kwargs = dict(kwargs)
        if "lora_path" in kwargs and "lora_path" not in self.arg_names:
            raise TypeError(f"{self.__name__}.{method}: the adapter is named by lora_name (lora_path names an "
                            "adapter's folder, given to Engine.load_lora_adapter)")
        opts = {k: kwargs.pop(k, v) for k, v in _OPTIONS[method].items()}
        sampling = {k: kwargs.pop(k) for k in _SAMPLING_KEYS if k in kwargs}
        return opts, SamplingDefaults(**sampling, lora_name=opts["lora_name"]), kwargs

    def _check_sync(self, method: str) -> None:
        if self.is_async:
            raise TypeError(
                f"{self.__name__}.{method}: an `async def` program runs with `await {self.__name__}.arun(...)`"
            )

    def _start(self, backend: BaseBackend, defaults: SamplingDefaults, stream: bool, mode: str) -> ProgramState:
        if self.num_api_spec_tokens is not None:
            from radixgen.lang.backend_openai import OpenAI

            if isinstance(backend, OpenAI):
                raise NotImplementedError(
                    f"{self.__name__}: num_api_spec_tokens (API speculative execution) is not implemented for the "
                    "OpenAI backend; remove it from @function(...) to run this program there"
                )
        core = StateCore(backend, defaults, stream=stream, mode=mode)
        start_driver(core)
        return ProgramState(core)

    def __repr__(self) -> str:
        return f"<radixgen function {self.__name__}>"


_ARGS = inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL, annotation=Any)
Function.run.__signature__ = _signature("run", [_ARGS], program_kwargs=True)  # type: ignore[attr-defined]
Function.arun.__signature__ = _signature("arun", [_ARGS], program_kwargs=True)  # type: ignore[attr-defined]
Function.run_batch.__signature__ = _signature(  # type: ignore[attr-defined]
    "run_batch", [inspect.Parameter("batch_kwargs", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                    annotation=list[dict[str, Any]] | list[tuple])], program_kwargs=False)
