"""`radixgen serve`: build the Engine, serve the app on uvicorn, shut down cleanly on SIGTERM / SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from dataclasses import asdict, dataclass, field
from typing import Any

import uvicorn

from radixgen.common.flags import add_dataclass_flags, values_of
from radixgen.common.options import check_choice, option
from radixgen.common.parsers import REASONING_FORMATS, TOOL_PARSERS
from radixgen.runtime.config import RuntimeConfig

SHUTDOWN_GRACE_S = 30.0  # in-flight requests may finish this long after SIGTERM; the rest are aborted
STREAM_CUTOFF_MARGIN_S = 1.0  # what still runs this long before the grace ends gets a final error event
SERVE_DESCRIPTION = "Serve a model over HTTP: the native API (/generate) and the OpenAI API (/v1)."
logger = logging.getLogger("radixgen.server")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
CACHE_ISOLATION = ("shared", "per-key")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's own options (the Engine's are RuntimeConfig's); each field is a `radixgen serve` flag."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(30000, "port to listen on")
    api_keys: tuple[str, ...] = option((), "require `Authorization: Bearer <key>` with one of these keys",
                                       flags=("--api-key",))
    api_key_file: str | None = option(None, "a file of API keys, one per line (blank lines and # comments skipped)")
    cache_isolation: str = option("shared", "shared: one radix cache for every client; per-key: each API key "
                                  "reuses only its own prefixes (no cross-user cache probing)",
                                  choices=CACHE_ISOLATION)
    served_model_name: str | None = option(None, "the model id of the OpenAI API (default: the model's folder name)")
    strict_model_name: bool = option(False, "OpenAI API: 404 for a `model` other than the served one "
                                     "(default: any name is accepted)")
    max_request_bytes: int = option(32 * 2**20, "larger request bodies get 413")
    shutdown_grace_s: float = option(SHUTDOWN_GRACE_S, "after SIGTERM, requests in flight may finish for this "
                                     "long; what still runs then ends with an error event")
    log_level: str = option("info", "log level of the server", choices=LOG_LEVELS)
    dp_size: int = option(1, "data parallelism: this many worker servers behind a cache-aware router")
    # chat output formats (server/parsers)
    reasoning_parser: str | None = option(None, "the think-block format of the model's output, separated into "
                                          "reasoning_content; none: not separated (default: detected from the "
                                          "chat template)", choices=(*REASONING_FORMATS, "none"))
    tool_call_parser: str | None = option(None, "the format of the model's tool calls (default: detected from "
                                          "the chat template; hermes when it names none)", choices=tuple(TOOL_PARSERS))

    def __post_init__(self) -> None:
        check_choice("cache_isolation", self.cache_isolation, CACHE_ISOLATION)
        check_choice("log_level", self.log_level, LOG_LEVELS)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.reasoning_parser is not None:
            check_choice("reasoning_parser", self.reasoning_parser, (*REASONING_FORMATS, "none"))
        if self.tool_call_parser is not None:
            check_choice("tool_call_parser", self.tool_call_parser, tuple(TOOL_PARSERS))
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if any(not k or k != k.strip() for k in self.api_keys):
            raise ValueError("api_keys: a key must be non-empty, without surrounding whitespace")

    def all_api_keys(self) -> tuple[str, ...]:
        """--api-key values, then the keys of --api-key-file. Raises ValueError naming an unreadable file."""
        if self.api_key_file is None:
            return self.api_keys
        try:
            with open(self.api_key_file) as f:
                lines = [line.strip() for line in f]
        except OSError as e:
            raise ValueError(f"api_key_file: cannot read {self.api_key_file!r}: {e.strerror}") from e
        keys = [k for k in lines if k and not k.startswith("#")]
        if not keys:
            raise ValueError(f"api_key_file: {self.api_key_file!r} holds no key")
        return tuple(dict.fromkeys((*self.api_keys, *keys)))


@dataclass(frozen=True)
class ServerArgs:
    """What `radixgen serve` was asked for."""

    server: ServerConfig = field(default_factory=ServerConfig)
    engine: dict[str, Any] = field(default_factory=dict)  # the RuntimeConfig fields given; the rest: defaults
    api_keys: tuple[str, ...] = ()  # server.all_api_keys(), read once at start

    def public(self) -> dict[str, Any]:
        """For /get_server_info: everything but the keys."""
        d = asdict(self.server)
        del d["api_keys"], d["api_key_file"]
        return {"model": self.engine.get("model"), **d, "api_key": "<set>" if self.api_keys else None,
                "num_api_keys": len(self.api_keys), "engine": dict(self.engine)}


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Every ServerConfig and RuntimeConfig field as a flag (see radixgen.common.flags)."""
    add_dataclass_flags(parser.add_argument_group("server"), ServerConfig)
    add_dataclass_flags(parser.add_argument_group("engine"), RuntimeConfig)


def server_args_from(ns: argparse.Namespace) -> ServerArgs:
    """Raises ValueError naming the option for a value the configs refuse."""
    server = ServerConfig(**values_of(ServerConfig, ns))
    engine = values_of(RuntimeConfig, ns)
    cfg = RuntimeConfig(**engine)  # validated here, before a model is loaded
    if server.dp_size > 1 and (cfg.nnodes > 1 or cfg.dist_init_addr is not None):
        raise ValueError("dp_size > 1 runs its workers on this machine: it takes no --nnodes or --dist-init-addr")
    return ServerArgs(server, engine, server.all_api_keys())


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGTERM after its shutdown, which kills the process with the
    signal; we catch it and return normally so the process exits 0 after shutting the Engine down."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:  # a second signal: stop waiting for in-flight requests
            self.force_exit = True
        self.should_exit = True


def run_server(args: ServerArgs) -> int:
    if args.engine.get("node_rank", 0) > 0:  # a node after the first runs its ranks and serves nothing
        from radixgen.runtime.engine.ranks import run_node

        return run_node(RuntimeConfig(**args.engine))
    if args.server.dp_size > 1:  # N workers and a router in front: the command's launcher does that
        raise ValueError("dp_size > 1 is started by radixgen.launch.run_server (`radixgen serve`), not by one server")
    # a SIGTERM while the model loads: unwind (the Engine stops its scheduler process) and exit 0
    signal.signal(signal.SIGTERM, _exit_now)
    from radixgen.runtime.engine import Engine
    from radixgen.runtime.server.app import create_app

    server = args.server
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = Engine(**args.engine)
    try:
        app = create_app(
            engine,
            server.served_model_name,
            None,
            args.public(),
            api_keys=args.api_keys,
            cache_isolation=server.cache_isolation,
            strict_model_name=server.strict_model_name,
            max_request_bytes=server.max_request_bytes,
            reasoning_parser=server.reasoning_parser,
            tool_call_parser=server.tool_call_parser,
        )
        config = uvicorn.Config(
            app,
            host=server.host,
            port=server.port,
            log_level=server.log_level,
            timeout_graceful_shutdown=server.shutdown_grace_s,
            lifespan="off",
        )
        asyncio.run(_serve(_Server(config), app.state.dispatcher, engine))
    finally:
        engine.shutdown()  # idempotent; here for a failed start
    return 0


def _exit_now(sig: int, frame: Any) -> None:
    raise SystemExit(0)


async def _serve(server: uvicorn.Server, dispatcher: Any, engine: Any) -> None:
    cutter = asyncio.ensure_future(_cut_off_after_grace(server, dispatcher))
    try:
        await server.serve()
    finally:
        cutter.cancel()
        aborted = dispatcher.abort_all()  # whatever outlived the grace period
        if aborted:
            logger.info("aborted %d request(s) at shutdown", aborted)
        # inside the loop: the engine wakes its async waiters through it while shutting down
        await asyncio.to_thread(engine.shutdown)


async def _cut_off_after_grace(server: uvicorn.Server, dispatcher: Any) -> None:
    """Shortly before uvicorn drops the connections still open past the grace period, end what still
    runs with an error event (then [DONE]), so that no stream is cut without a word."""
    while not server.should_exit:
        await asyncio.sleep(0.1)
    grace = server.config.timeout_graceful_shutdown or 0.0
    await asyncio.sleep(max(0.0, grace - STREAM_CUTOFF_MARGIN_S))
    cut = dispatcher.cut_off(f"the server is shutting down: the request was still running {grace:g} s after SIGTERM")
    if cut:
        logger.info("cut off %d request(s) still running at the end of the shutdown grace period", cut)


def parse_server_args(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> ServerArgs:
    """server_args_from, with a refused value reported as the parser's usage error (exit status 2)."""
    try:
        return server_args_from(ns)
    except ValueError as e:
        parser.error(str(e))
