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

SHUTDOWN_GRACE_S = 30.0  # in-flight requests may finish this long after SIGTERM; the rest are aborted
logger = logging.getLogger("radixgen.server")


@dataclass(frozen=True)
class ServerArgs:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    engine: dict[str, Any] = field(default_factory=dict)  # Engine config keys (RuntimeConfig fields)

    def public(self) -> dict[str, Any]:
        """For /get_server_info: everything but the key."""
        d = asdict(self)
        d["api_key"] = "<set>" if self.api_key else None
        return d


# flag -> (Engine config key, argparse options); each flag is exactly one Engine option
_ENGINE_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "--dtype": ("dtype", {"choices": ["auto", "bfloat16", "float32", "float16"]}),
    "--max-total-tokens": ("max_total_tokens", {"type": int, "help": "KV cache slots"}),
    "--chunked-prefill-size": ("chunked_prefill_size", {"type": int}),
    "--schedule-policy": ("schedule_policy", {"choices": ["lpm", "dfs-weight", "fcfs"]}),
    "--disable-radix-cache": ("disable_radix_cache", {"action": "store_true", "default": None}),
    "--disable-cpu-kernels": ("disable_cpu_kernels", {"action": "store_true", "default": None}),
    "--disable-cuda-graph": ("disable_cuda_graph", {"action": "store_true", "default": None}),
    "--cuda-graph-max-bs": (
        "cuda_graph_max_bs",
        {"type": int, "help": "largest decode batch replayed from a CUDA graph (default 160)"},
    ),
    "--num-threads": (
        "num_threads",
        {"type": int, "help": "torch threads of the scheduler (0: torch's default)"},
    ),
}


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF folder or .gguf file (default: bundled SmolLM2-135M)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer <key>")
    parser.add_argument("--served-model-name", default=None, help="the model id of the OpenAI API")
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    for flag, (_, opts) in _ENGINE_FLAGS.items():
        parser.add_argument(flag, **opts)


def server_args_from(ns: argparse.Namespace) -> ServerArgs:
    engine = {}
    for flag, (key, _) in _ENGINE_FLAGS.items():
        value = getattr(ns, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            engine[key] = value
    return ServerArgs(ns.model, ns.host, ns.port, ns.api_key, ns.served_model_name, ns.log_level, engine)


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
    # a SIGTERM while the model loads: unwind (the Engine stops its scheduler process) and exit 0
    signal.signal(signal.SIGTERM, _exit_now)
    from radixgen.runtime.engine import Engine
    from radixgen.runtime.server.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = Engine(args.model, **args.engine)
    try:
        app = create_app(engine, args.served_model_name, args.api_key, args.public())
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            lifespan="off",
        )
        asyncio.run(_serve(_Server(config), app.state.dispatcher, engine))
    finally:
        engine.shutdown()  # idempotent; here for a failed start
    return 0


def _exit_now(sig: int, frame: Any) -> None:
    raise SystemExit(0)


async def _serve(server: uvicorn.Server, dispatcher: Any, engine: Any) -> None:
    try:
        await server.serve()
    finally:
        aborted = dispatcher.abort_all()  # whatever outlived the grace period
        if aborted:
            logger.info("aborted %d request(s) at shutdown", aborted)
        # inside the loop: the engine wakes its async waiters through it while shutting down
        await asyncio.to_thread(engine.shutdown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixgen serve", description="Serve a model over HTTP.")
    add_server_args(parser)
    return run_server(server_args_from(parser.parse_args(argv)))
