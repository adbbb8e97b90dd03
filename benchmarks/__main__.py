"""Run the whole suite, one benchmark after another: ``python -m benchmarks [--quick] [--only NAME ...]``."""

import sys

from benchmarks.harness import main
from benchmarks.suite import SUITE

sys.exit(main(SUITE))
