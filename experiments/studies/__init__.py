"""Studies as configs: each module holds one study's constants and run list.

A study module defines ``runs(output_dir)``, every `experiments.sweep.Run` of
the study; ``OUTPUT_DIR`` and ``LONGER_DIR``, where its runs and the longer
runs of ``python -m experiments.study longer`` go by default; and
``STEPS``, the steps between its plateau checks, the least a longer run
trains. ``python -m experiments.study --study NAME`` runs the study of
``experiments/studies/NAME.py``.
"""
