"""The error of a command line that cannot run as given: `UsageError`.

The rule, for every module of ``experiments``: a lower layer (the data, the
models, the run directory) raises `UsageError`, or an exception
type of its own, where the user's input is at fault, with a message that
says how to fix it; it never prints it or exits. Only the command-line edge,
a command's ``main`` function, turns these errors into its usage message on
stderr and exit status 2, without a traceback.

The training loop raises none: ``experiments.train`` resolves and claims a
run before the loop trains it, and what the loop can still meet (the run
directory taken by another process, records or images damaged while it
trains) has a type of its own, which the train command converts.
"""


class UsageError(ValueError):
  """A command line that cannot run as given; the message says how to fix it."""
