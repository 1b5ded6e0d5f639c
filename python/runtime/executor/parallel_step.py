"""How one step travels through a tensor / pipeline parallel group (see docs/architecture.md, "Parallelism").

Rank 0 holds the scheduler. For each step it packs a `StepDescription` (step_messages.py): the step's ForwardInput,
the request->slot table writes since the previous step (the other ranks keep their own copy of the table: the KV
cache manager on rank 0 stays the one owner of slots) and the KV copy orders given since (the runner's
`kv_copies`), which every rank applies to its part of the pool before its part of the forward. Then:

- stage 0: rank 0 broadcasts the description over the stage's tensor-parallel group, and every rank of the stage
  runs its shard of the stage's layers (the all-reduces inside the layers keep them in step);
- stage s -> s + 1: each rank sends the description and its (hidden, residual) to the rank with the same
  tensor-parallel index in the next stage, without waiting (isend), and goes on with its next micro-batch;
- the last stage: the vocabulary-parallel logits are gathered on its first rank, which sends them to rank 0.

With one stage, `launch` returns the logits at once; with several, rank 0 keeps up to pp_size steps in flight
(scheduler/pipeline.py) and `collect` waits for the oldest. Ranks other than 0 run `serve` until a SHUTDOWN
description passes. While the scheduler is idle, rank 0 sends a HEARTBEAT every HEARTBEAT_S: the others'
waits stay within the group's timeout, and a rank that is gone is noticed within that time (its peers'
next transfer fails) rather than at the next request.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

import torch

from radixgen.runtime.executor import distributed
from radixgen.runtime.executor.step_messages import StepDescription, StepKind
from radixgen.runtime.models.llama import StageHidden

if TYPE_CHECKING:
    from radixgen.runtime.executor.model_runner import ModelRunner
    from radixgen.runtime.executor.step_messages import ForwardInput

HEARTBEAT_S = 1.0


class InFlight(NamedTuple):
    """A launched step: its logits (on rank 0), complete once `work` (None: already) has finished."""

    logits: torch.Tensor
    work: object | None


class StepGroup:
    """One rank's side of the step protocol (rank 0: launch / collect / heartbeat / close; the others: serve)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.par = runner.parallel
        par = self.par
        self.next_rank = par.rank_of(par.pp_rank + 1, par.tp_rank) if not par.is_last_stage else None
        self.prev_rank = par.rank_of(par.pp_rank - 1, par.tp_rank) if not par.is_first_stage else None
        self.last_stage_first = par.rank_of(par.pp_size - 1, 0)  # sends the logits to rank 0
        self.sends: deque[tuple[object, tuple]] = deque()  # isends not yet waited, with the tensors they read
        self.last_sent = time.monotonic()
        self.closed = False

    # ------------------------------------------------------------------ rank 0

    def launch(self, fi: ForwardInput) -> InFlight:
        """Send step `fi` on its way and run stage 0's part of it. Any failure is the group's (GroupError): the
        other ranks are already in the step, which cannot be taken back."""
        desc = StepDescription(StepKind.FORWARD, fi, self.runner.table_log.take(), self.runner.kv_copies.take())
        try:
            out = self._run_stage0(desc)
        except distributed.GroupError:
            raise
        except Exception as e:
            raise distributed.GroupError(f"rank 0 failed in a step the other ranks run too: "
                                         f"{type(e).__name__}: {e}") from e
        if self.par.pp_size == 1:
            return InFlight(out, None)
        logits = torch.empty((fi.logit_rows.numel(), self.runner.vocab_size), dtype=torch.float32,
                             device=self.runner.device)
        return InFlight(logits, distributed.irecv(logits, self.last_stage_first))

    def collect(self, step: InFlight) -> torch.Tensor:
        if step.work is not None:
            distributed.wait(step.work)
        return step.logits

    def heartbeat(self) -> None:
        """While the scheduler is idle: at most one HEARTBEAT description every HEARTBEAT_S."""
        if time.monotonic() - self.last_sent >= HEARTBEAT_S:
            self._run_stage0(StepDescription(StepKind.HEARTBEAT))

    def close(self) -> None:
        """Tell the other ranks to exit (rank 0, after the last step has been collected). Idempotent."""
        if not self.closed:
            self.closed = True
            self._run_stage0(StepDescription(StepKind.SHUTDOWN))
            self._reap(0)

    def _run_stage0(self, desc: StepDescription):
        header, payload = desc.pack()
        self.par.tp.broadcast_from_first(header)
        if payload.numel():
            self.par.tp.broadcast_from_first(payload)
        self.last_sent = time.monotonic()
        return self._run_and_pass_on(desc, header, payload, None)

    # ------------------------------------------------------------------ the other ranks

    def serve(self) -> None:
        """Run the steps rank 0 sends until a SHUTDOWN description passes."""
        while True:
            header = torch.zeros(StepDescription.HEADER_LEN, dtype=torch.int64)
            payload = torch.zeros(0, dtype=torch.int64)
            if self.prev_rank is None:  # stage 0: from rank 0, over the stage's tensor-parallel group
                self.par.tp.broadcast_from_first(header)
                n = StepDescription.payload_len(header)
                if n:
                    payload = self.par.tp.broadcast_from_first(torch.zeros(n, dtype=torch.int64))
            else:
                distributed.recv(header, self.prev_rank)
                n = StepDescription.payload_len(header)
                if n:
                    payload = distributed.recv(torch.zeros(n, dtype=torch.int64), self.prev_rank)
            desc = StepDescription.unpack(header, payload)
            stage_input = None
            if desc.kind == StepKind.FORWARD:
                desc.table_writes.apply(self.runner.req_to_slot)
                if self.prev_rank is not None:
                    stage_input = self._recv_hidden(desc.forward_input.input_ids.numel())
            out = self._run_and_pass_on(desc, header, payload, stage_input)
            if desc.kind == StepKind.FORWARD and self.next_rank is None and out is not None and self.par.world_rank:
                self._send((out.contiguous(),), 0)  # the last stage's first rank: the logits to rank 0
            if desc.kind == StepKind.SHUTDOWN:
                self._reap(0)
                return

    # ------------------------------------------------------------------ both

    def _run_and_pass_on(self, desc: StepDescription, header, payload, stage_input):
        """Run this rank's part of a FORWARD step; pass the description (and its output) to the next stage. The
        result: the logits on the last stage's first rank, None on its others, the StageHidden elsewhere."""
        out = None
        if desc.kind == StepKind.FORWARD:
            if desc.kv_copies:
                desc.kv_copies.apply(self.runner.kv_pool)  # before the forward, which may read the copies
            out = self.runner.run_stage(desc.forward_input, stage_input)
        if self.next_rank is not None:
            tensors = (header, payload)
            if out is not None:
                tensors = (*tensors, out.hidden.contiguous(), out.residual.contiguous())
            self._send(tuple(t for t in tensors if t.numel()), self.next_rank)
        return out

    def _recv_hidden(self, tokens: int) -> StageHidden:
        shape = (tokens, self.runner.model_config.hidden_size)
        hidden = torch.empty(shape, dtype=self.runner.dtype, device=self.runner.device)
        residual = torch.empty(shape, dtype=self.runner.dtype, device=self.runner.device)
        distributed.recv(hidden, self.prev_rank)
        distributed.recv(residual, self.prev_rank)
        return StageHidden(hidden, residual)

    def _send(self, tensors: tuple, dst: int) -> None:
        for t in tensors:
            self.sends.append((distributed.isend(t, dst), t))
        self._reap(4 * max(2, self.par.pp_size))  # back-pressure: a few steps ahead of the receiver at most

    def _reap(self, keep: int) -> None:
        """Wait for the oldest sends until at most `keep` are pending (their tensors are then free)."""
        while len(self.sends) > keep:
            work, _ = self.sends.popleft()
            distributed.wait(work)

