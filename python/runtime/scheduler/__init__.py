"""The scheduler package: `Scheduler` (core.py: the step, admission, decode, retraction, finishing), the KV cache
manager (kv_manager.py), the radix tree (radix/), the scheduler's records (request.py: Req; batch.py: Batch, which
builds the executor's ForwardInput), admission order (policy.py), intake (intake.py), sampling (sampling.py),
output processing (output.py), speculative decoding as a stage of the decode step (speculative/) and the process
loop (process.py: `run_scheduler_process`, started by the Engine as `python -m radixgen.runtime.scheduler ARGS`).

Imports point down only: the scheduler imports the executor, the executor nothing of the scheduler."""

from radixgen.runtime.scheduler.core import Scheduler
from radixgen.runtime.scheduler.kv_manager import KVCacheManager
from radixgen.runtime.scheduler.process import run_scheduler_process

__all__ = ["KVCacheManager", "Scheduler", "run_scheduler_process"]
