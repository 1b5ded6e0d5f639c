"""The front process: the Engine (the in-process API), its link to the scheduler process and the rank
processes it starts, what it knows of each request in flight, and the checks made before a request is sent."""

from radixgen.runtime.engine.core import Engine, RequestError, RequestFailed

__all__ = ["Engine", "RequestError", "RequestFailed"]
