"""Preemption: SIGTERM (Slurm, a spot instance) or Ctrl-C stops the run at an update boundary that every process
agrees on.

The learner asks `requested()` once per update. With several processes the answer is agreed (an allgather of
the signals each has received), so all stop after the same update and write the same checkpoint; a process
that got no signal still learns that a peer was preempted, and reports the run as interrupted, not finished.

Every SIGTERM means the same: Slurm signals each task SIGTERM, SIGCONT and SIGTERM again within milliseconds (and
`srun uv run ...` forwards one more), so a second SIGTERM must not end the process before its stop checkpoint; Slurm
itself sends SIGKILL when the grace time is over. A second Ctrl-C, typed by a person, interrupts at once.
"""

import signal
import threading

import numpy as np

from cleanrl_utils.processes import slurm_job_id


class Preemption:
    def __init__(self, world_size: int, stop_event: threading.Event):
        self.world_size, self.stop_event = world_size, stop_event
        self.received: list[int] = []  # signals this process received
        self.agreed_signal: int | None = None  # the signal the processes agreed to stop on
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, frame):
        """Stop at the next update boundary and checkpoint (any number of SIGTERMs); a second Ctrl-C interrupts."""
        self.received.append(signum)
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.world_size == 1:
            self.stop_event.set()  # alone, stop the actors now; several processes first agree on the update

    def requested(self) -> bool:
        """Whether any process received a signal; with several processes, every process must call it at the same
        point (the learner loop calls it before each update, main once more after the loop, so a signal that
        reached a peer during the last update still makes the run interrupted in every process)."""
        if self.world_size == 1:
            return bool(self.received)
        from jax.experimental import multihost_utils

        # every process must stop after the same update, or the others would wait in its collectives
        signals = multihost_utils.process_allgather(np.int32(self.received[0] if self.received else 0))
        if signals.any():
            self.agreed_signal = int(signals.max())
        return self.agreed_signal is not None

    @property
    def stop_signal(self) -> int | None:
        """The signal that ended the run (this process's or a peer's), or None if it ran to the end."""
        return self.agreed_signal or (self.received[0] if self.received else None)

    @property
    def exit_code(self) -> int:
        """The shell's code for "ended by this signal" (143 SIGTERM, 130 Ctrl-C), or 0."""
        return 128 + self.stop_signal if self.stop_signal else 0

    def report(self, update: int, run_name: str):
        """How the run stopped, and how to resume it: under Slurm, the job's own requeue (cleanba.slurm_template
        requeues a preempted job; a new submission would be a new job id, hence a new default run name)."""
        if not self.stop_signal:
            return
        job_id = slurm_job_id()
        if job_id is None:
            how = f"run the same command (--run-name {run_name}) to resume"
        else:
            how = (
                f"Slurm job {job_id} resumes it when requeued (cleanba.slurm_template requeues a preempted job; "
                f"by hand: scontrol requeue {job_id}, or any job with --run-name {run_name})"
            )
        print(f"stopped by signal {self.stop_signal} after update {update}: {how}", flush=True)
