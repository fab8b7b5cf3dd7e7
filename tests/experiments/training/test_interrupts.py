"""Tests for experiments/training/interrupts.py: the signals a run takes
over while it trains. How a run stops on them is tested end to end in
tests/experiments/test_train.py."""

import signal

from experiments.training import interrupts


def test_a_signal_the_run_was_started_ignoring_stays_ignored():
  # SIGINT as from a terminal, whatever started the tests; SIGTERM ignored.
  previous = {signal.SIGINT: signal.signal(signal.SIGINT,
                                           signal.default_int_handler),
              signal.SIGTERM: signal.signal(signal.SIGTERM, signal.SIG_IGN)}
  try:
    with interrupts.StopRequests():
      assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
      assert signal.getsignal(signal.SIGINT) not in (
          signal.SIG_IGN, signal.default_int_handler)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) == signal.default_int_handler
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)
