"""``python -m kvvm_bench``: see :mod:`kvvm_bench`."""

import sys

from kvvm_bench.cli import main

sys.exit(main())
