"""What-if benchmarks on XLA:CPU, written to choose the digits study's setup.

`grad_accumulation` times an ERM step's gradient accumulated over
micro-batches against the whole batch's; `vmap_trials` times the study's
trials trained side by side under ``jax.vmap`` against one after another.
Their results are under ``results/``; docs/study.md reads them.
"""
