"""``python -m bpstrain.launch``: see :mod:`bpstrain.launch._cli`."""

import sys

from bpstrain.launch._cli import main

if __name__ == "__main__":
    sys.exit(main())
