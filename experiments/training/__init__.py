"""The training loop of one run, split the way Flax's imagenet example and
big_vision split theirs.

`loop` (``train(spec, claimed) -> record``) reads a resolved
``config.RunSpec`` and its claimed run directory, and prints no result;
`steps` builds the model and the jitted train and eval steps; `evaluate`
evaluates every domain and sums the training metrics; `sharding` places
batches and state on the devices; `progress` is the progress bar and what
the run says on stderr; `interrupts` turns SIGINT and SIGTERM into a stop at
a checkpointed step; `compile_cache` points JAX's persistent compilation
cache at the run's; `weight_averaging` runs ``--averaging``
(`experiments.averaging`) along the loop. What the loop writes is
`experiments.rundir`'s contract.
"""
