"""`python -m radixgen.runtime.scheduler ARGS_FILE`: one rank's process (see ranks.py); rank 0 is the scheduler."""

import os
import pickle
import sys

from radixgen.runtime.scheduler.process import run_rank_process, run_scheduler_process

if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        args = pickle.load(f)
    code = run_scheduler_process(args) if args.rank == 0 else run_rank_process(args)
    if args.cfg.world_size > 1:  # a process group's destructors may abort on a peer that is gone: skip them
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
