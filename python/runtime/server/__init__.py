"""The HTTP server: native /generate and the OpenAI-compatible API over one Engine."""

from radixgen.runtime.server.app import create_app
from radixgen.runtime.server.launch import ServerArgs, run_server

__all__ = ["ServerArgs", "create_app", "run_server"]
