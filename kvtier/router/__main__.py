"""``python -m kvtier.router ...`` is ``kvtier router ...``."""

import sys

from kvtier.cli import main

sys.exit(main(["router", *sys.argv[1:]]))
