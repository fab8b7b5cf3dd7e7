"""Runs on disk, and many of them.

`records` is a run directory (its files, its records), `environment` what
of its machine a run records there, and `convergence` the plateau criterion
read from the records; `sweep` launches and lists the runs of a sweep,
`study` those of a study (each a config in `experiments.studies`), and
`rerun` retrains finished runs of either.
"""
