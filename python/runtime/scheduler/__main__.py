"""`python -m radixgen.runtime.scheduler ARGS_FILE`: the scheduler process (see engine.py)."""

import pickle
import sys

from radixgen.runtime.scheduler.process import run_scheduler_process

if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        run_scheduler_process(*pickle.load(f))
