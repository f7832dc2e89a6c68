"""Preemption: stop cleanly when the scheduler takes the machines back.

A scheduler that ends a job early (Slurm preemption or `scancel`, a
Kubernetes eviction, a spot or preemptible VM, a Cloud TPU maintenance
event) sends SIGTERM first and SIGKILL after a grace period (Slurm's
KillWait and Kubernetes' terminationGracePeriodSeconds: 30 s by default).
The training loop asks `PreemptionWatch.reached(step)` after every step; once
it answers yes, the loop saves a checkpoint of that step, waits until it is
complete and raises `Preempted`, and train.py exits with
`PREEMPTED_EXIT_STATUS`, 143 = 128 + SIGTERM: the status a shell reports for
a process ended by SIGTERM, which schedulers read as "terminated", not as a
failure of the program's own (Slurm with --requeue, a Kubernetes Job's
restart policy, a retry loop in a batch script: each restarts the same
command, which resumes from that checkpoint bit for bit).

Where the notice comes from:

  one process   SIGTERM, caught while the watch is held (`with
                PreemptionWatch() as watch:`, from the main thread) by a
                handler that only sets a flag; the previous handler is put
                back on leaving.
  several       JAX's preemption sync service, which `jax.distributed
                .initialize` starts (`jax_enable_preemption_service`, on by
                default): it catches SIGTERM in any process and makes the
                processes agree on the step at which to stop, so that
                `jax.experimental.multihost_utils.reached_preemption_sync_point`
                is true on every process at that same step and all save that
                checkpoint together. No Python handler is installed there (it
                would replace JAX's). With the service off, several processes
                get no notice (a process-local flag would have them stop at
                different steps): SIGTERM ends them, and the run resumes
                from its last periodic checkpoint.

The notice is read between steps: an evaluation in progress finishes first.
"""

from __future__ import annotations

import logging
import signal
import threading

import jax
from jax.experimental import multihost_utils

logger = logging.getLogger(__name__)

# 128 + SIGTERM: what a shell reports for a process ended by SIGTERM.
PREEMPTED_EXIT_STATUS = 128 + int(signal.SIGTERM)


class Preempted(Exception):
  """Training stopped on a preemption notice after saving checkpoint `step`
  in `directory`; running the same command again resumes from it."""

  def __init__(self, step: int, directory, reason: str):
    super().__init__(f"preempted ({reason}) at step {step}: saved checkpoint {step} in "
                     f"{directory}; run the same command again to resume from it")
    self.step, self.directory, self.reason = step, directory, reason


class PreemptionWatch:
  """Says, step by step, whether a preemption notice has arrived (module
  docstring). A context manager: the SIGTERM handler of a single process is
  installed on entering and the previous one restored on leaving."""

  def __init__(self):
    self.signalled = False     # SIGTERM caught by this process's handler
    self.reason = ""
    self._previous = None
    self._installed = False

  def __enter__(self) -> "PreemptionWatch":
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
      self._installed = True
    return self

  def __exit__(self, *exc_info) -> None:
    if self._installed:
      # (None: the previous handler was not installed from Python; the default is the
      # closest Python can put back.)
      signal.signal(signal.SIGTERM,
                    signal.SIG_DFL if self._previous is None else self._previous)
      self._installed = False

  def _on_sigterm(self, signum, frame) -> None:
    del signum, frame
    self.signalled = True   # (nothing else: the loop acts between steps)

  def reached(self, step: int) -> bool:
    """Whether to save `step` and stop. Call it after every step, on every
    process, with the same steps (JAX's sync protocol counts on it)."""
    try:
      synced = multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError:   # the preemption service is off (module docstring)
      synced = False
    if synced or self.signalled:
      if not self.reason:
        self.reason = "SIGTERM" if self.signalled else "a preemption notice"
        logger.warning("Preemption (%s): saving a checkpoint at step %d, then stopping.",
                       self.reason, step)
      return True
    return False
