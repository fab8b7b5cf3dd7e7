import os
import sys

# The tests import their NumPy oracle as a sibling module.
sys.path.insert(0, os.path.dirname(__file__))
