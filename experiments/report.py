"""``python -m experiments.report``: the command of `experiments.analysis.report`
under its shorter name."""

import sys

from experiments.analysis import report

if __name__ == "__main__":
  sys.exit(report.main())
