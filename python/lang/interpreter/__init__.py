"""The interpreter: a program state's text and variables, and how each IR node changes them.

- errors.py   the program line of an expression (Origin), ProgramError, TraceStop
- notifier.py waking threads and coroutines when a state changes
- core.py     StateCore: text, turns, variables and the queue of one program (or fork)
- execute.py  what each IR node does; yields the backend calls it needs (Generate, Score, Wait)
- drivers.py  the worker thread / caller thread / asyncio task that runs a state's queue

Nodes queued on a state run one at a time, in order; `s += gen(...)` returns at once (except in
inline mode, where it runs the expression before returning).
"""

from radixgen.lang.interpreter.core import LogEntry, SamplingDefaults, StateCore, produced_names
from radixgen.lang.interpreter.drivers import start_driver
from radixgen.lang.interpreter.errors import Origin, ProgramError, TraceStop, caller_origin
from radixgen.lang.interpreter.execute import OpenRole, gen_request
from radixgen.lang.interpreter.notifier import Notifier

__all__ = [
    "LogEntry",
    "Notifier",
    "OpenRole",
    "Origin",
    "ProgramError",
    "SamplingDefaults",
    "StateCore",
    "TraceStop",
    "caller_origin",
    "gen_request",
    "produced_names",
    "start_driver",
]
