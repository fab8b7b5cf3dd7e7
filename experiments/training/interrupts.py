"""Signals that stop a run at a checkpointed step.

How a run stops on SIGINT and SIGTERM, and what it leaves, is
`experiments.rundir`'s contract ("Interrupts").
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import orbax.checkpoint as ocp

# The signals that stop a run at its next step, once it has checkpointed it.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
  """A run stopped by a signal of `STOP_SIGNALS`, after the checkpoint of
  its last step.

  Attributes:
    signum: the signal's number.
  """

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


class StopRequests:
  """Catches `STOP_SIGNALS` while a run trains, for it to stop at a step.

  The first signal sets ``signum`` (the loop checkpoints the step it is in,
  if not checkpointed yet, then stops); a second raises `Interrupted` at
  once, which loses the steps since the last checkpoint. Only the main
  thread receives signals: in another, nothing is caught.
  """

  def __init__(self):
    self.signum = None
    self._previous = {}

  def __enter__(self) -> StopRequests:
    if threading.current_thread() is threading.main_thread():
      # A signal the run was started ignoring (nohup, a launcher's own
      # signal) stays ignored.
      self._previous = {s: signal.signal(s, self._handle)
                        for s in STOP_SIGNALS
                        if signal.getsignal(s) != signal.SIG_IGN}
    return self

  def __exit__(self, *exc_info) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)

  def _handle(self, signum: int, frame: Any) -> None:
    del frame
    if self.signum is not None:
      raise Interrupted(signum)
    self.signum = signum
    print(f"\n{signal.Signals(signum).name}: stopping once the step in "
          "progress, if any, is checkpointed (again to stop at once, from "
          "the last checkpoint).", file=sys.stderr)


@contextlib.contextmanager
def checkpoint_kept_on_interrupt(
    manager: Callable[[], ocp.CheckpointManager | None]):
  """On Ctrl-C, waits for the checkpoint being written (of ``manager()``,
  the run's manager once it has one) before stopping, so that a rerun
  resumes from it."""
  try:
    yield
  except KeyboardInterrupt:
    if manager() is not None:
      manager().wait_until_finished()
    raise
