"""Studies as configs: each module holds one study's constants and run list.

A study module defines ``runs(output_dir)``, every
`experiments.runs.run.Run` of the study, and ``OUTPUT_DIR``, where they go
by default (its longer runs go beside it, in ``OUTPUT_DIR`` with ``_longer``
appended: `experiments.runs.rerun`); it may name in ``REQUIREMENTS`` a file
of the repository that locks the versions its runs trained with.
``python -m experiments.runs.study --study NAME`` runs the study of
``experiments/studies/NAME.py``.
"""
