"""Entry point of ``python -m bpstrain.bench``; see ``bpstrain.bench.cli``."""

import sys

from bpstrain.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
