"""The error of a command line that cannot run as given: `UsageError`.

The rule, for every module of ``experiments``: a lower layer (the data, the
models, the run directory, the loop) raises `UsageError`, or an exception
type of its own, where the user's input is at fault, with a message that
says how to fix it; it never prints it or exits. Only the command-line edge,
a command's ``main`` function, turns these errors into its usage message on
stderr and exit status 2, without a traceback.

The training loop raises no `UsageError`: ``experiments.train`` resolves
and claims a run before it. What it can still meet, the run directory
taken by another process, records damaged or images that stop decoding
while it trains, have types of their own, which the train command converts.
"""


class UsageError(ValueError):
  """A command line that cannot run as given; the message says how to fix it."""
