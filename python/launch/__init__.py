"""Commands that start several parts of radixgen together. The router and the runtime share nothing but
radixgen.common; `radixgen serve --dp-size N` needs both (N worker servers and a router in front), so its
launcher lives here, above them."""

from __future__ import annotations

from radixgen.runtime.server.launch import ServerArgs
from radixgen.runtime.server.launch import run_server as run_one_server


def run_server(args: ServerArgs) -> int:
    """`radixgen serve`: one server (or, with --node-rank > 0, a node's ranks); with --dp-size N > 1, N worker
    servers and the router (radixgen.launch.dp)."""
    if args.server.dp_size > 1 and args.engine.get("node_rank", 0) == 0:
        from radixgen.launch.dp import run_dp

        return run_dp(args)
    return run_one_server(args)
