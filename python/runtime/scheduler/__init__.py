"""The scheduler package: `Scheduler` (core.py: the step, admission, decode, retraction, finishing), the KV cache
manager (kv_manager.py), admission order (policy.py), output processing (output.py) and the process loop
(process.py: `run_scheduler_process`, started by the Engine as `python -m radixgen.runtime.scheduler ARGS`)."""

from radixgen.runtime.scheduler.core import Scheduler
from radixgen.runtime.scheduler.kv_manager import KVCacheManager
from radixgen.runtime.scheduler.process import run_scheduler_process

__all__ = ["KVCacheManager", "Scheduler", "run_scheduler_process"]
