"""The scheduler with pipeline stages (pp_size > 1): several steps in flight, so that the stages overlap.

A step's stage 0 runs on rank 0 and its later stages on other processes (parallel_step.py), so rank 0 need not
wait for a step's logits before it starts the next: it keeps up to pp_size steps in flight and, when that many
are out (or nothing else can be scheduled), waits for the oldest and processes its outputs. A request in a step
in flight is `busy`: no other step takes it, it is not retracted, and an abort waits until its step is back,
since the stages still write its KV slots. The running requests are split into pp_size micro-batches (each
decode step takes at most its share of them), which is what gives the stages something to overlap on.
"""

from __future__ import annotations

from collections import deque

from radixgen.runtime.scheduler.batch import Batch
from radixgen.runtime.scheduler.core import Scheduler
from radixgen.runtime.scheduler.request import Req


class PipelineScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.depth = self.cfg.pp_size
        self.in_flight: deque[tuple[Batch, object]] = deque()  # (batch, the runner's handle), oldest first

    def extending_in_flight(self) -> list[Req]:
        return [r for batch, _ in self.in_flight if not batch.is_decode for r in batch.reqs]

    def decode_candidates(self) -> list[Req]:
        share = -(-len(self.running) // self.depth)  # one micro-batch of the running requests
        return self.idle_requests(self.running)[:share]

    def step(self) -> bool:
        self.step_no += 1
        self.handle_aborts()
        launched = False
        if len(self.in_flight) < self.depth:
            batch = self.schedule()
            if batch is not None:
                self.launch(batch)
                launched = True
        if self.in_flight and (len(self.in_flight) == self.depth or not launched):
            self.complete_oldest()
            return True
        return launched

    def launch(self, batch: Batch) -> None:
        """Start the batch's step; its requests are busy until it completes. Any failure is the group's
        (GroupError, fatal): a step cannot be taken back from the stages it has reached."""
        handle = self.runner.launch(batch.forward_input(self.kv.table.table))
        self.busy.update(id(r) for r in batch.reqs)
        self.in_flight.append((batch, handle))

    def complete_oldest(self) -> None:
        batch, handle = self.in_flight.popleft()
        logits = self.runner.collect(handle)
        self.busy.difference_update(id(r) for r in batch.reqs)
        self.process_output(batch, logits)

    def drain(self) -> None:
        """Complete every step in flight (before shutting the group down)."""
        while self.in_flight:
            self.complete_oldest()

    def is_idle(self) -> bool:
        return super().is_idle() and not self.in_flight
